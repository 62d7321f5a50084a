"""``python -m mbcompile``: the same as the ``mbcompile`` command."""

import sys

from mbcompile.training.cli.main import main

if __name__ == "__main__":
    sys.exit(main())
