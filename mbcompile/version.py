"""mbcompile's version, in a module of its own so that modules inside the package can read
it without importing the package root (``mbcompile.__version__`` reads it from here).
pyproject.toml's ``version`` is the same number (tests/test_layering.py checks it)."""

__version__ = "0.1.0"
