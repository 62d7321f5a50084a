"""Constructs: Python state outside the model's modules (issue 35): module globals read two
modules down, a global dict, a closure's variable, a helper function swapped, a global
counter, a global list and namespace written, another module's globals written, a global
generator; and what cannot be replayed (a file written, Python's and numpy's random).

Each instance is built from a fresh copy of this file (``fresh.py``), so its globals are its
own; the oracle compares them (``module_state``) against the eager reference's copy.
"""

from __future__ import annotations

import os
import random
import types
from typing import Any

import numpy as np
import torch
from torch import manual_seed as seed_everything
from torch.random import fork_rng

from .base import WithLinear
from .fresh import fresh_module, module_state

helpers = fresh_module("global_helpers")
SETTINGS = {"scale": 0.5, "hard": False}
STATS = types.SimpleNamespace(calls=0, last=None)
LOG: list[Any] = []
CALLS = 0
GEN = torch.Generator().manual_seed(7)


def _make_scaler(factor: float) -> tuple[Any, Any]:
    def scale(h: torch.Tensor) -> torch.Tensor:
        return h * factor

    def set_factor(value: float) -> None:
        nonlocal factor
        factor = value
    return scale, set_factor


SCALER, SET_FACTOR = _make_scaler(0.5)


class ModuleGlobals(WithLinear):
    """A construct with module-level state of its own: ``CONSTRUCTS[name]()`` builds the
    class of the same name from a fresh copy of this file."""

    _fresh = False

    def __new__(cls, *args: Any, **kwargs: Any) -> Any:
        if cls._fresh:
            return super().__new__(cls)
        kind = getattr(fresh_module("globalstate"), cls.__name__)
        kind._fresh = True
        return kind()

    def module_state(self) -> dict[str, Any]:
        return module_state(helpers, _this())


def _this() -> types.ModuleType:
    import sys
    return sys.modules[__name__]


class HelperGlobal(ModuleGlobals):
    """``helpers.scaled(t)`` reads ``SCALE``, a global of another module; mutate changes it."""

    def forward(self, h, x):
        return h + helpers.scaled(torch.tanh(self.lin(h))), None, None

    def mutate(self, root):
        helpers.SCALE = 2.0


class HelperSwapped(ModuleGlobals):
    """``helpers.activation(t)``: mutate rebinds that function in its module."""

    def forward(self, h, x):
        return h + helpers.activation(self.lin(h)), None, None

    def mutate(self, root):
        helpers.activation = helpers.softsign


class GlobalDict(ModuleGlobals):
    """``SETTINGS["scale"]`` and ``if SETTINGS["hard"]``: a module-level dict; mutate flips."""

    def forward(self, h, x):
        h = h + torch.tanh(self.lin(h)) * SETTINGS["scale"]
        return (h.clamp(-0.5, 0.5) if SETTINGS["hard"] else h), None, None

    def mutate(self, root):
        SETTINGS["hard"] = True


class ClosureFactor(ModuleGlobals):
    """``SCALER(t)`` multiplies by a closure's variable; mutate sets it (``nonlocal``)."""

    def forward(self, h, x):
        return h + SCALER(torch.tanh(self.lin(h))), None, None

    def mutate(self, root):
        SET_FACTOR(2.0)


class GlobalCounter(ModuleGlobals):
    """``global CALLS; CALLS += 1`` read by a schedule in the same forward: once per step."""

    def forward(self, h, x):
        global CALLS
        CALLS += 1
        return h + torch.tanh(self.lin(h)) * (1.0 + 0.1 * CALLS), None, None

    def mutate(self, root):
        global CALLS
        CALLS = 10


class GlobalLog(ModuleGlobals):
    """``LOG.append(...)`` and ``STATS.calls += 1; STATS.last = ...``: logging into a global
    list and a module-level namespace, once per step with the full batch's values."""

    def forward(self, h, x):
        h = h + torch.tanh(self.lin(h))
        LOG.append(h.detach().sum())
        STATS.calls += 1
        STATS.last = h.detach().mean(0)
        return h, None, None


class HelperWrites(ModuleGlobals):
    """``helpers.record(t)`` writes ``COUNT`` and ``LAST``, globals of another module."""

    def forward(self, h, x):
        h = h + torch.tanh(self.lin(h))
        helpers.record(h.detach())
        return h, None, None


class GlobalGenerator(ModuleGlobals):
    """Noise from ``GEN``, a module-level generator (not the model's); mutate reseeds it."""

    def forward(self, h, x):
        noise = torch.randn(h.shape, generator=GEN, dtype=h.dtype)
        return h + torch.tanh(self.lin(h)) * (1 + 0.1 * noise), None, None

    def mutate(self, root):
        GEN.manual_seed(11)


class GlobalGeneratorSeed(ModuleGlobals):
    """``GEN.manual_seed(0)`` in forward, ``GEN`` a module-level generator: refused."""

    def forward(self, h, x):
        GEN.manual_seed(0)
        return h + torch.randn(h.shape, generator=GEN, dtype=h.dtype) * 0.1, None, None


class SeedImported(ModuleGlobals):
    """``manual_seed`` imported by another name (``from torch import manual_seed as ...``),
    called in forward: refused."""

    def forward(self, h, x):
        seed_everything(0)
        return h + torch.tanh(self.lin(h)) * torch.rand(h.size(0), 1, dtype=h.dtype), None, None


class ForkRngImported(ModuleGlobals):
    """``fork_rng`` imported by name, a draw inside it: refused."""

    def forward(self, h, x):
        with fork_rng(devices=[]):
            r = torch.rand(h.size(0), 1, dtype=h.dtype)
        return h + torch.tanh(self.lin(h)) * r, None, None


class RngStateRead(ModuleGlobals):
    """``torch.get_rng_state()`` kept in an attribute: the state eager reads in forward."""

    def forward(self, h, x):
        self.state = torch.get_rng_state()
        return h + torch.tanh(self.lin(h)), None, None


class FileWrite(ModuleGlobals):
    """A file written in forward: refused (a file cannot be written once per step later)."""

    def forward(self, h, x):
        with open(os.devnull, "w") as f:
            f.write("step\n")
        return h + torch.tanh(self.lin(h)), None, None


class PythonRandom(ModuleGlobals):
    """``random.random()`` scales the block: a draw Python's generator makes: refused."""

    def forward(self, h, x):
        return h + torch.tanh(self.lin(h)) * (1 + random.random()), None, None


class NumpyRandom(ModuleGlobals):
    """``np.random.rand()`` scales the block: a draw numpy's generator makes: refused."""

    def forward(self, h, x):
        return h + torch.tanh(self.lin(h)) * float(1 + np.random.rand()), None, None


class LocalGenerator(ModuleGlobals):
    """``g = torch.Generator().manual_seed(0)`` made in forward: the same noise every step."""

    def forward(self, h, x):
        g = torch.Generator().manual_seed(0)
        noise = torch.randn(h.shape, generator=g, dtype=h.dtype)
        return h + torch.tanh(self.lin(h)) * (1 + 0.1 * noise), None, None


class ClassAttribute(ModuleGlobals):
    """``self.SCALE``, a class attribute (no instance one); mutate sets it on the class."""

    SCALE = 0.5

    def forward(self, h, x):
        return h + torch.tanh(self.lin(h)) * self.SCALE, None, None

    def mutate(self, root):
        type(self).SCALE = 2.0


class Schedule:
    """A callable object holding its state (a warmup factor): ``SCHEDULE(t)``."""

    def __init__(self) -> None:
        self.factor = 0.5

    def __call__(self, t: torch.Tensor) -> torch.Tensor:
        return t * self.factor


SCHEDULE = Schedule()


class GlobalSchedule(ModuleGlobals):
    """``SCHEDULE(t)``, a module-level callable object; mutate changes its attribute."""

    def forward(self, h, x):
        return h + SCHEDULE(torch.tanh(self.lin(h))), None, None

    def mutate(self, root):
        SCHEDULE.factor = 2.0


class HeldSchedule(ModuleGlobals):
    """``self.schedule(t)``, a callable object held in an attribute; mutate changes it."""

    def __init__(self) -> None:
        super().__init__()
        self.schedule = Schedule()

    def forward(self, h, x):
        return h + self.schedule(torch.tanh(self.lin(h))), None, None

    def mutate(self, root):
        self.schedule.factor = 2.0
