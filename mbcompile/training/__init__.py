"""The training face: flags (``flags``), the YAML configuration (``config``), the
``Trainer`` (``trainer``), learning-rate scaling (``lr_scaling``), monitors
(``monitors``) and the ``mbcompile`` command (``cli``)."""
