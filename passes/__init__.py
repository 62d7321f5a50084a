"""mbcompile's compiler passes, one module each (installed as ``mbcompile.passes``).

capture -> shape_prop -> batch_analysis (rules in batch_rules) -> microbatch_rewrite.
The ``node.meta`` keys they write are documented in ``facts``.
"""

__all__: list[str] = []
