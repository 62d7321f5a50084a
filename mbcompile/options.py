"""``compile()``'s keyword options, each declared once: its name, default and one line.

>>> options = CompileOptions.of({"outputs": "loss", "recompute": True})
>>> options.outputs, options.capture
('loss', 'auto')

Every face of an option is this declaration: ``compile()``'s signature (its
``__signature__`` is built from the fields), ``make_request``'s checks (which read
``Request.options``), the Trainer's ``COMPILE_OPTIONS`` and docs/api.md (both checked
against it by ``tests/test_options.py``), as torchtitan derives its CLI from one
``JobConfig``. Adding an option is one field here, its check in ``make_request`` if it
needs one, and its line in docs/api.md.
"""

from __future__ import annotations

import dataclasses
import inspect
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from mbcompile.errors import ArgumentTypeError

if TYPE_CHECKING:
    from mbcompile.execution.noise import NoiseScale

__all__ = ["CompileOptions", "option_names", "signature_with_options"]


def _option(default: Any, doc: str) -> Any:
    return field(default=default, metadata={"doc": doc})


@dataclass(frozen=True)
class CompileOptions:
    """The keyword options of ``mbcompile.compile``, with their defaults (docs/api.md
    describes each at length)."""

    example_inputs: Any = _option(None, "one example call's positional arguments (any batch "
                                        "size)")
    example_kwargs: Mapping[str, Any] | None = _option(None, "the example call's keywords")
    in_dims: Any = _option(0, "the batch dim of the inputs: an int, a tuple per positional "
                              "input, a dict per keyword (None: unbatched)")
    system: Any = _option(None, "a system preset name or a SystemSpec (None: 'host')")
    backend: str = _option("auto", "'auto' (an initialised process group of more than one "
                                   "rank: 'torch.distributed', else 'simulated'), "
                                   "'simulated' or 'torch.distributed'")
    measure_noise_scale: bool | NoiseScale = _option(
        False, "True or a NoiseScale: the gradient noise scale every training step")
    capture: str = _option("auto", "'auto', 'fx' or 'export'")
    batch_norm: str = _option("full_batch", "'full_batch' or 'per_microbatch' statistics "
                                            "for BatchNorm in training")
    coupling: str = _option("two_phase", "'two_phase' (ops that mix samples run exactly) or "
                                         "'reject' (a MixingError)")
    outputs: Any = _option("all", "what a training step returns: 'all', 'loss' or output "
                                  "names")
    torch_compile: bool | Mapping[str, Any] = _option(
        False, "True or torch.compile keyword arguments: the body compiled")
    recompute: bool | str = _option("auto", "activation checkpointing per block: 'auto', "
                                            "True or False")
    reshard_after_forward: bool | str = _option("auto", "FSDP2's setting for a sharded "
                                                        "model: 'auto', True or False")
    gradient_sync: str = _option("auto", "when FSDP2 reduce-scatters gradients: 'auto', "
                                         "'step' or 'microbatch'")
    nonfinite: str = _option("return", "a non-finite loss: 'return' it with its gradients, "
                                       "as eager does (GradScaler skips the step), or "
                                       "'raise' and roll the step back")
    compile_only: bool = _option(False, "trace, analyse, plan and estimate; the module does "
                                        "not run")
    validate_only: bool = _option(False, "stop after capture and batch analysis: a "
                                         "Validation")
    measure: bool | int = _option(False, "True or a repetition count: time each MBS "
                                         "evaluated on this host")
    cost_model: bool = _option(True, "False: planned without the cost model's probes")
    batch_sizes: str = _option("any", "'any' (another batch size is planned on first sight) "
                                      "or 'fixed'")
    dynamic: Any = _option("auto", "non-batch dims that may vary between calls: 'auto' "
                                   "(symbolic from the first change), True (all), False "
                                   "(fixed), or {input: {dim: (min, max)}}")
    optimizer: Any = _option(None, "the optimizer (or its name) the plan sizes its state for")
    shard: str | None = _option(None, "'fsdp': plan FSDP2 over num_csx ranks, compile-only")
    precision: str = _option("auto", "the autocast the step runs under, as the plan sizes "
                                     "activations: 'auto' (compile()'s own), '32', "
                                     "'bf16-mixed' or 'fp16-mixed'")

    @classmethod
    def of(cls, options: Mapping[str, Any]) -> CompileOptions:
        """The options given by name (``compile()``'s ``**options``); an unknown name is
        an ``ArgumentTypeError`` that lists the known ones."""
        unknown = sorted(set(options) - set(option_names()))
        if unknown:
            raise ArgumentTypeError(
                f"compile() got an unexpected keyword argument {unknown[0]!r}; its options "
                f"are {', '.join(option_names())}")
        return cls(**options)

    @property
    def planning_only(self) -> bool:
        """Nothing runs: a plan (``compile_only``) or a validation (``validate_only``)."""
        return self.compile_only or self.validate_only


def option_names() -> tuple[str, ...]:
    """The options' names, in ``compile()``'s order."""
    return tuple(f.name for f in dataclasses.fields(CompileOptions))


def signature_with_options(fn: Any) -> inspect.Signature:
    """``fn``'s signature with its ``**options`` replaced by one keyword-only parameter per
    option, with its default: what ``inspect.signature(mbcompile.compile)`` shows."""
    sig = inspect.signature(fn)
    named = [p for p in sig.parameters.values() if p.kind != p.VAR_KEYWORD]
    options = [inspect.Parameter(f.name, inspect.Parameter.KEYWORD_ONLY, default=f.default,
                                 annotation=f.type)
               for f in dataclasses.fields(CompileOptions)]
    return sig.replace(parameters=[*named, *options])
