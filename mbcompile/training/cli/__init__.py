"""The ``mbcompile`` command: ``main`` parses the command line (``cli.main``, the console
script's entry), and each command has its module (``demo``, ``compile``, ``fit``);
``messages`` holds the exit codes and the one-paragraph error."""
