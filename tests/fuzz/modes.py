"""Constructs: grad-mode regions, autocast regions and tensor hooks."""

from __future__ import annotations

import torch

from .base import (
    BF16_REL,
    WIDTH,
    WithLinear,
    _lin,
)

# ----- grad-mode regions --------------------------------------------------- #


class NoGradTeacher(WithLinear):
    """``with torch.no_grad():`` teacher branch multiplying the student's output."""

    def __init__(self) -> None:
        super().__init__()
        self.teacher = _lin()

    def forward(self, h, x):
        with torch.no_grad():
            t = torch.tanh(self.teacher(h))
        return self.lin(h) * (1 + t), None, None


class SetGradEnabledAttr(WithLinear):
    """``with torch.set_grad_enabled(self.train_aux):``; mutate turns it on."""

    def __init__(self) -> None:
        super().__init__()
        self.aux = _lin()
        self.train_aux = False

    def forward(self, h, x):
        with torch.set_grad_enabled(self.train_aux):
            t = torch.sigmoid(self.aux(h))
        return self.lin(h) + t * h, None, None

    def mutate(self, root):
        self.train_aux = True


class SetGradEnabledCall(WithLinear):
    """``torch.set_grad_enabled(False)`` called as a function, then the mode restored."""

    def __init__(self) -> None:
        super().__init__()
        self.aux = _lin()

    def forward(self, h, x):
        prev = torch.is_grad_enabled()
        torch.set_grad_enabled(False)
        t = torch.tanh(self.aux(h))
        torch.set_grad_enabled(prev)
        return self.lin(h) * (1 + t), None, None


class InferenceMode(WithLinear):
    """``torch.inference_mode()`` region, its result ``.clone()``d for autograd as users must."""

    def __init__(self) -> None:
        super().__init__()
        self.aux = _lin()

    def forward(self, h, x):
        with torch.inference_mode():
            t = torch.tanh(self.aux(h))
        return self.lin(h) * (1 + t.clone()), None, None


class NoGradDecorated(WithLinear):
    """A helper decorated with ``@torch.no_grad()`` (a distillation target)."""

    def __init__(self) -> None:
        super().__init__()
        self.aux = _lin()

    @torch.no_grad()
    def target(self, h):
        return torch.softmax(self.aux(h), -1)

    def forward(self, h, x):
        return self.lin(h) + self.target(h) * h, None, None


class EnableGradNested(WithLinear):
    """``torch.enable_grad()`` nested inside ``torch.no_grad()``."""

    def __init__(self) -> None:
        super().__init__()
        self.aux = _lin()

    def forward(self, h, x):
        with torch.no_grad():
            a = torch.tanh(self.aux(h))
            with torch.enable_grad():
                b = self.lin(h)
        return a * b + b, None, None


class RequiresGradToggle(WithLinear):
    """A weight whose ``requires_grad`` is switched off after compile (eager: ``.grad`` None)."""

    def mutate(self, root):
        self.lin.weight.requires_grad_(False)


# ----- autocast ---------------------------------------------------------------- #


class AutocastBf16(WithLinear):
    """``torch.autocast("cpu", dtype=torch.bfloat16)`` around a float32 Linear on ``h.float()``.

    Eager: the Linear runs in bf16 (autocast casts float32 only; the model's float64 values
    would pass through unchanged, so the block keeps float32 weights and casts ``h``). The
    bf16 result is returned as an extra output (its dtype is compared exactly), with the
    block's float64 output. ``probe`` is ``h``'s own bf16 rounding, amplified and detached:
    an identity matmul under autocast rounds its input to bf16, row by row, so it is exact
    under any split, and about 0.5 of ``h`` away from what a forward that ignores the region
    computes (far above ``BF16_REL``). ``self.amp`` is read as ``enabled=``; mutate turns
    autocast off."""

    rel = BF16_REL
    keep_float32 = True

    def __init__(self) -> None:
        super().__init__()
        self.register_buffer("eye", torch.eye(WIDTH))
        self.amp = True

    def forward(self, h, x):
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=self.amp):
            z = self.lin(h.float())
            q = h.float() @ self.eye
        probe = (256 * (q.double() - h)).detach()
        out = h + torch.tanh(z.double()) + probe
        return out, (z, out), None

    def mutate(self, root):
        self.amp = False


class AutocastDecorated(WithLinear):
    """A helper decorated with ``@torch.autocast("cpu", dtype=torch.bfloat16)``."""

    rel = BF16_REL
    keep_float32 = True

    @torch.autocast("cpu", dtype=torch.bfloat16)
    def project(self, h):
        return self.lin(h.float())

    def forward(self, h, x):
        z = self.project(h)
        return h + torch.tanh(z.double()), z, None


# ----- tensor hooks -------------------------------------------------------------- #


class TensorHookLinear(WithLinear):
    """``h.register_hook(lambda g: g * self.scale)``: linear in the gradient; mutate rescales."""

    def __init__(self) -> None:
        super().__init__()
        self.scale = 0.5

    def forward(self, h, x):
        h = torch.tanh(self.lin(h))
        h.register_hook(lambda g: g * self.scale)
        return h, None, None

    def mutate(self, root):
        self.scale = 3.0


class TensorHookClamp(WithLinear):
    """``h.register_hook(lambda g: g.clamp(-c, c))``: per element but not linear (the gradient's
    scale, 1/B in a mean loss, decides what is clipped)."""

    def __init__(self) -> None:
        super().__init__()
        self.clip = 0.01

    def forward(self, h, x):
        h = torch.tanh(self.lin(h))
        h.register_hook(lambda g: g.clamp(-self.clip, self.clip))
        return h, None, None


class TensorHookNorm(WithLinear):
    """``h.register_hook(lambda g: g / g.norm())``: the norm is over the whole batch."""

    def forward(self, h, x):
        h = torch.tanh(self.lin(h))
        h.register_hook(lambda g: g / (g.norm() + 1e-3))
        return h, None, None
