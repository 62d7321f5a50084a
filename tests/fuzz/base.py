"""The fuzzer's vocabulary: tolerances, the ``Construct`` base class, and the hooks as
module-level functions, as users write them (tests/fuzz/__init__.py says how it all runs)."""

from __future__ import annotations

import torch
import torch.nn as nn

DTYPE = torch.float64
WIDTH = 4
REL = 1e-10  # float64, as tests/test_properties.py
# Autocast to bfloat16: a few units of bf16's rounding (2**-8 = 3.9e-3), on values and on
# sums of bf16 products (a weight gradient summed per microbatch rounds differently from
# one summed over the batch). A construct that ignores autocast is still caught: its
# returned bf16 tensor changes dtype, and its probe term (AutocastBf16) moves by ~0.5.
BF16_REL = 2e-2
# A value's scale is floored (as in test_properties): values that cancel to rounding noise
# are no sign of a wrong split; a gradient's floor is this fraction of the largest one.
SCALE_FLOOR, GRAD_FLOOR = 1e-3, 1e-4
LR = 0.1  # the SGD step between the two compared steps


# --------------------------------------------------------------------------- #
# Constructs: each a tiny block applied to the running activation h of shape (B, 4)
# --------------------------------------------------------------------------- #


class Construct(nn.Module):
    """One forward-time construct. ``forward(h, x)`` returns ``(h, extra, aux)``: the new
    activation, an extra output to return (or None) and a term added to the loss (or None);
    ``x`` is the model's input, for the constructs that write to it."""

    rel = REL  # the comparison's tolerance when this construct is in the model
    keep_float32 = False  # autocast blocks keep float32 weights (autocast casts only float32)
    mutation_only_observes = False  # its mutation adds a reader: eager's values stay the same
    #: Python state (attribute paths below the block) a step is known to leave otherwise than
    #: eager: found by comparing Python state (issue 35), reported, not compared until fixed
    unchecked_state: tuple[str, ...] = ()

    def prepare(self, x: torch.Tensor) -> None:
        """Called on the input before the model reads it (in-place writes to it)."""

    def install(self, root: nn.Module) -> None:
        """Called once the model is built (root-level hooks)."""

    def mutate(self, root: nn.Module) -> None:
        """The Python-state change between the first and the second compared step."""


def _lin() -> nn.Linear:
    return nn.Linear(WIDTH, WIDTH)


class WithLinear(Construct):
    """A construct with one ``nn.Linear`` ``lin`` (made first, so its draws from the seeded
    global generator come before any other layer's) and, when ``seed`` is given, a
    model-owned generator ``g`` seeded with it. Its forward is the tanh residual
    ``h + tanh(lin(h))``: a construct whose point is elsewhere (a hook, a mutation) keeps it.

    >>> class Halved(WithLinear):
    ...     def mutate(self, root):
    ...         self.lin.register_forward_hook(_halve_output)
    """

    seed: int | None = None

    def __init__(self) -> None:
        super().__init__()
        self.lin = _lin()
        if self.seed is not None:
            self.g = torch.Generator().manual_seed(self.seed)

    def forward(self, h, x):
        return h + torch.tanh(self.lin(h)), None, None


# hooks as module-level functions, as users write them
def _halve_output(module: nn.Module, args: tuple, out: torch.Tensor) -> torch.Tensor:
    return out * 0.5 + 0.1


def _center_output(module: nn.Module, args: tuple, out: torch.Tensor) -> torch.Tensor:
    return out - out.mean(0)  # mixes samples: eager's is the full batch's mean


def _double_input(module: nn.Module, args: tuple) -> tuple:
    return (args[0] * 2.0,)


def _shift_input(module: nn.Module, args: tuple) -> tuple:
    return (args[0] + 0.5,)


def _scale_root_loss(module: nn.Module, args: tuple, out: tuple) -> tuple:
    return (out[0] * 2.0, *out[1:])


def _halve_root_x(module: nn.Module, args: tuple) -> tuple:
    return (args[0] * 0.5, *args[1:])


class Plain(WithLinear):
    """Control: a tanh residual, nothing forward-time."""
