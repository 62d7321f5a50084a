"""Helpers for the training libraries people use around a compiled module.

One module per library (``mbcompile.integrations.transformers``, ...), each imported only
by whoever uses that library: importing mbcompile never imports them.
"""
