"""Constructs: every way forward touches random numbers that eager makes comparable (issue 35),
and hooks that write (parameter hooks, ``.data``, in place).

Draws that read no sample's data are made once per step at the full batch
(``passes/draws.py``), so they are compared strictly, global generator included; seeding
in forward is refused at compile. Not generated (DESIGN.md's one exception): draws that
read the samples from the global generator (dropout with 0 < p < 1, ``randn_like(h)``).
"""

from __future__ import annotations

import torch
import torch.nn as nn

from .base import DTYPE, WIDTH, WithLinear


class GlobalRand(WithLinear):
    """``r = torch.rand(B, 1)`` from the global generator scales ``h`` and is returned."""

    def forward(self, h, x):
        r = torch.rand(h.size(0), 1, dtype=h.dtype)
        return h + torch.tanh(self.lin(h)) * r, r, None


class GeneratorRandperm(WithLinear):
    """``torch.randperm(B, generator=self.g)``: each sample's place in a permutation of the
    batch, read per sample and returned; mutate reseeds."""

    seed = 5

    def forward(self, h, x):
        perm = torch.randperm(h.size(0), generator=self.g)
        return h + torch.tanh(self.lin(h)) * (1 + 0.1 * perm.unsqueeze(1).to(h.dtype)), perm, None

    def mutate(self, root):
        self.g.manual_seed(99)


class GeneratorShuffle(WithLinear):
    """``h[torch.randperm(B, generator=self.g)]`` mixed into the loss (mixup): couples samples."""

    seed = 6

    def forward(self, h, x):
        perm = torch.randperm(h.size(0), generator=self.g)
        return h + torch.tanh(self.lin(h)), None, 0.1 * (h - h[perm]).pow(2).mean()


class GeneratorTwice(WithLinear):
    """Two draws from one model-owned generator, per-sample then batch-free: the order of
    eager's draws is kept."""

    seed = 8

    def forward(self, h, x):
        a = torch.randn(h.shape, generator=self.g, dtype=h.dtype)
        b = torch.randn(WIDTH, generator=self.g, dtype=DTYPE)
        return h + torch.tanh(self.lin(h)) * (1 + 0.1 * a) + 0.1 * b, None, None


class GeneratorInPlace(WithLinear):
    """``h.new_empty(h.shape).normal_(generator=self.g)``: an in-place fill."""

    seed = 9

    def forward(self, h, x):
        noise = h.new_empty(h.shape).normal_(generator=self.g)
        return h + torch.tanh(self.lin(h)) + 0.1 * noise, None, None


class SeedInForward(WithLinear):
    """``torch.manual_seed(0)`` in forward, then a draw: refused at compile."""

    def forward(self, h, x):
        torch.manual_seed(0)
        return h + torch.tanh(self.lin(h)) * torch.rand(h.size(0), 1, dtype=h.dtype), None, None


class ForkRngDraw(WithLinear):
    """A draw inside ``torch.random.fork_rng()``: refused at compile."""

    def forward(self, h, x):
        with torch.random.fork_rng(devices=[]):
            r = torch.rand(h.size(0), 1, dtype=h.dtype)
        return h + torch.tanh(self.lin(h)) * r, None, None


class GeneratorSeedInForward(WithLinear):
    """``self.g.manual_seed(0)`` in forward, then a draw from it: refused at compile."""

    seed = 2

    def forward(self, h, x):
        self.g.manual_seed(0)
        return h + torch.randn(h.shape, generator=self.g, dtype=h.dtype) * 0.1, None, None


class ParamHookLinear(WithLinear):
    """``weight.register_hook(lambda g: g * 0.5)`` on a parameter: linear in its gradient."""

    def __init__(self) -> None:
        super().__init__()
        self.lin.weight.register_hook(lambda g: g * 0.5)


class PostAccumulateHook(WithLinear):
    """``register_post_accumulate_grad_hook`` scaling ``p.grad`` in place (optimizer in
    backward's shape): eager fires it once per step, on the full gradient."""

    def __init__(self) -> None:
        super().__init__()
        self.lin.weight.register_post_accumulate_grad_hook(_halve_grad)


def _halve_grad(p: torch.Tensor) -> None:
    p.grad.mul_(0.5)  # in place, as an optimizer in backward steps


def _shrink_weight_data(module: nn.Module, args: tuple, out: torch.Tensor) -> None:
    module.weight.data.mul_(0.9)  # a write through .data: once per call in eager


def _halve_in_place(module: nn.Module, args: tuple, out: torch.Tensor) -> None:
    out.mul_(0.5)  # the output changed in place, nothing returned


class HookWritesData(WithLinear):
    """A forward hook on a leaf ``nn.Linear`` writing its weight through ``.data``."""

    def __init__(self) -> None:
        super().__init__()
        self.lin.register_forward_hook(_shrink_weight_data)


class HookInPlaceOutput(WithLinear):
    """A forward hook on a leaf ``nn.Linear`` halving its output in place."""

    def __init__(self) -> None:
        super().__init__()
        self.lin.register_forward_hook(_halve_in_place)


class GeneratorInPlaceAlias(WithLinear):
    """``noise = h.new_zeros(h.shape); noise.normal_(generator=self.g)``: the fill's result
    unused, the filled tensor read through its first name."""

    seed = 10

    def forward(self, h, x):
        noise = h.new_zeros(h.shape)
        noise.normal_(generator=self.g)
        return h + torch.tanh(self.lin(h)) * (1 + 0.1 * noise), None, None


class GlobalInPlace(WithLinear):
    """``h.new_empty(h.size(0), 1).bernoulli_(0.5)``: an in-place fill from torch's global
    generator (a per-sample mask), returned."""

    def forward(self, h, x):
        mask = h.new_empty(h.size(0), 1).bernoulli_(0.5)
        return h + torch.tanh(self.lin(h)) * mask, mask, None


class GeneratorInPlaceLike(WithLinear):
    """``torch.empty_like(h).normal_(generator=self.g)``: the fill of a tensor shaped like h."""

    seed = 11

    def forward(self, h, x):
        noise = torch.empty_like(h).normal_(generator=self.g)
        return h + torch.tanh(self.lin(h)) + 0.1 * noise, None, None


class GeneratorRandint(WithLinear):
    """``torch.randint(0, 3, (B, 1), generator=self.g)``: an integer draw per sample, used as
    a scale and returned."""

    seed = 12

    def forward(self, h, x):
        k = torch.randint(0, 3, (h.size(0), 1), generator=self.g)
        return h + torch.tanh(self.lin(h)) * (1 + 0.1 * k.to(h.dtype)), k, None


class GlobalMask(WithLinear):
    """``torch.rand(B, 1) < 0.5`` from the global generator: a per-sample keep mask (a drop
    path's shape), returned."""

    def forward(self, h, x):
        keep = torch.rand(h.size(0), 1, dtype=h.dtype) < 0.5
        return h + torch.tanh(self.lin(h)) * keep.to(h.dtype), keep, None
