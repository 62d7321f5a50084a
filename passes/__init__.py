"""mbcompile's compiler passes, one module each (installed as ``mbcompile.passes``).

capture (``capture``, ``export_capture``; ``unwrap`` for wrappers) -> state updates
(``state_updates``) -> shapes (``shape_prop``, on the one fake-tensor interpreter
``fake_probe`` that the cost model runs too) -> batch analysis (``batch_analysis``, rules
in the package ``rules``, token-dispatch regions among them) -> microbatch rewrite
(``microbatch_rewrite``). The vocabulary they share lives here too: ``facts`` (the
``node.meta`` keys they write), ``errors``, ``partials`` (per-microbatch partial sums)
and ``ops`` (the backend-neutral split/loop/accumulate/collective ops the rewrite
inserts). Nothing here imports the rest of mbcompile: the passes depend only downward.
"""

__all__: list[str] = []
