"""The guards as one function (``passes/guard_code.py``): never looser than the guards.

Every guard kind a capture records (a plain value, a tensor by identity, a container or
config object by its fingerprint, a global, a method that must not be shadowed) is held
on an object, changed in each way a user changes it, and after each change the fast check
must say "holds" only where ``failed_guard`` finds that every guard holds; unchanged, it
must say "holds", walking the kinds it knows itself (else it would cost as much as before).
"""

from __future__ import annotations

import collections
import copy
import enum
import types
import warnings
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F
from models import plan_free, rel_err

import mbcompile
from mbcompile.passes.guard_code import _walker, fast_check
from mbcompile.passes.guard_values import fingerprint
from mbcompile.passes.guards import MISSING, Guard, NumberInput, failed_guard


class Mode(enum.Enum):
    SOFT = 1
    HARD = 2


@dataclass
class Config:
    beta: float = 0.5
    sizes: tuple[int, ...] = (2, 3)


Point = collections.namedtuple("Point", "x y")
TENSOR = torch.zeros(3)

#: name -> the value held at capture; walked: whether the fast check alone says "holds"
VALUES: dict[str, tuple[Any, bool]] = {
    "flags": ({"clip": False, "scale": True, "mode": Mode.SOFT}, True),
    "nested": ({"a": {"b": [1, 2.0, "x"]}, "c": (None, 3)}, True),
    "list": ([1, 2, 3], True),
    "config": (Config(), True),
    "namespace": (types.SimpleNamespace(p=0.1, on=True), True),
    "empty": ({}, True),
    "shared": ({"a": [1], "b": None}, True),
    "twins": ({"a": [1], "b": [1]}, True),  # equal lists: one object under both keys is not
    "labels": (types.SimpleNamespace(p=0.1, id2label={0: "x", 1: "y"}, heads=[2, (4, 8)]),
               True),  # a transformers config: plain values, dicts and lists in its dict
    "ordered": (collections.OrderedDict(a=1), True),  # walked, but not a dict: the guard says
    "named": (Point(1, 2), False),
    "with_tensor": ({"t": TENSOR}, False),  # an identity in the image
    "set": ({1, 2}, False),
    "set_of_tuples": ({(1,), (2, 3)}, False),
}

#: how a user changes a container: each leaves the value changed, or equal but another
#: object, type or order (where the fingerprint compares by value, equal may hold)
CHANGES: list[Callable[[Any], Any]] = [
    lambda v: v,  # unchanged
    copy.deepcopy,  # an equal copy
    lambda v: {**v, "new": 1} if isinstance(v, dict) else v,
    lambda v: {k: v[k] for k in reversed(list(v))} if isinstance(v, dict) else v,  # order
    lambda v: {k: (1 if x is True else x) for k, x in v.items()} if isinstance(v, dict) else v,
    lambda v: {k: torch.ones(2) for k in v} if isinstance(v, dict) else v,  # tensors' ==
    lambda v: collections.OrderedDict(v) if isinstance(v, dict) else v,
    lambda v: tuple(v) if isinstance(v, list) else v,
    lambda v: [*v, 4] if isinstance(v, list) else v,
    lambda v: _set_attr(v, "beta", 0.25),
    lambda v: _set_attr(v, "p", 0.1 + 1e-9),
    lambda v: _share(v),
    lambda v: _relabel(v),
    lambda v: {("tuple", (1,)), ("tuple", (2, 3))} if isinstance(v, set) else v,  # its image
]


def _set_attr(v: Any, name: str, value: Any) -> Any:
    if hasattr(v, "__dict__") and name in vars(v):
        v = copy.copy(v)
        setattr(v, name, value)
    return v


def _relabel(v: Any) -> Any:
    """One value deep inside a config object changed (a label, a head count)."""
    if isinstance(v, types.SimpleNamespace) and "id2label" in vars(v):
        v.id2label[1], v.heads[1] = "z", (4, 9)
    return v


def _share(v: Any) -> Any:
    """The same list under two keys: the fingerprint meets it twice (an identity)."""
    if isinstance(v, dict) and "a" in v and isinstance(v["a"], list):
        return {**v, "b": v["a"]}
    return v


def _fast_never_looser(guards: list[Guard]) -> bool:
    said = fast_check(guards)()
    truth = failed_guard(guards) is None
    assert not said or truth, "the fast check says a failed guard holds"
    return said


@pytest.mark.parametrize("name", VALUES)
def test_a_container_guard(name):
    value, walked = VALUES[name]
    for i, change in enumerate(CHANGES):
        holder = types.SimpleNamespace(x=value)
        guard = Guard(holder, "x", value, contents=fingerprint(value)[0])
        holder.x = change(copy.deepcopy(value) if i else value)
        said = _fast_never_looser([guard])
        if i == 0:
            assert said, f"{name} unchanged"
    # the kinds it does not walk are asked of the guard itself (as fast as before, no faster)
    assert (_walker(fingerprint(value)[0]) is not None) == walked


@pytest.mark.parametrize("value", [1.0, 1, True, "s", None, Mode.SOFT, (1, 2.0), MISSING])
def test_a_plain_value_guard(value):
    for now in [value, 1.0, 1, True, 0, "s", None, Mode.HARD, (1, 2.0), (1, 2), MISSING,
                torch.tensor(1.0)]:
        holder = types.SimpleNamespace()
        if now is not MISSING:
            holder.x = now
        _fast_never_looser([Guard(holder, "x", value)])
    holder = types.SimpleNamespace(x=value)
    if value is not MISSING:
        assert fast_check([Guard(holder, "x", value)])()


def test_identity_items_fed_numbers_and_many_guards_at_once():
    holder = types.SimpleNamespace(t=TENSOR, n=0.5)
    space = {"SCALE": 2.0}
    feeds = NumberInput(0.5)
    guards = [Guard(holder, "t", TENSOR, identity=True),
              Guard(space, "SCALE", 2.0, item=True, where="the global SCALE"),
              Guard(holder, "n", 0.5, feeds=feeds),
              Guard(holder, "method", MISSING, identity=True)]
    assert fast_check(guards)()
    holder.n = 0.75  # a fed number: any float holds, and is fed
    assert _fast_never_looser(guards) and feeds.value == 0.75
    for change in [lambda: setattr(holder, "t", TENSOR.clone()),
                   lambda: space.update(SCALE=3.0), lambda: setattr(holder, "n", 1),
                   lambda: setattr(holder, "method", print)]:
        change()
        assert not _fast_never_looser(guards)
    assert fast_check([])()


class _Scaled:
    SCALE = 2.0


class _Holder:
    def __init__(self, **attrs: Any) -> None:
        vars(self).update(attrs)


def test_the_guards_on_one_object_read_the_dict_it_holds_now():
    """The guards on one object's attributes share one fetch of its ``__dict__``: one given
    a new ``__dict__`` (equal or not), a fed number and a container among them, a class
    attribute (a mappingproxy) and a global all still answer as the guards do, with the
    check made once (as ``GuardCache`` keeps it)."""
    feeds = NumberInput(0.5)
    holder, space = _Holder(n=0.5, a=1.0, t=TENSOR, on=True, d={"k": 1}), {"flag": True}
    guards = [Guard(holder, "n", 0.5, feeds=feeds), Guard(holder, "a", 1.0),
              Guard(holder, "t", TENSOR, identity=True), Guard(holder, "on", True),
              Guard(holder, "d", holder.d, contents=fingerprint(holder.d)[0]),
              Guard(space, "flag", True, item=True), Guard(_Scaled, "SCALE", 2.0)]
    check = fast_check(guards)

    def never_looser() -> bool:
        assert not check() or failed_guard(guards) is None, "says a failed guard holds"
        return check()

    assert never_looser()
    kept = holder.__dict__
    holder.__dict__ = dict(kept)  # equal: the guards hold, the fast check may not
    never_looser()
    holder.__dict__ = {**kept, "a": 0.5}  # the dict read at compile still says 1.0
    assert not never_looser()
    holder.__dict__ = kept
    assert never_looser()
    for change, undo in [(lambda: setattr(holder, "on", 1), lambda: setattr(holder, "on", True)),
                         (lambda: holder.d.update(k=2), lambda: holder.d.update(k=1)),
                         (lambda: delattr(holder, "a"), lambda: setattr(holder, "a", 1.0)),
                         (lambda: space.update(flag=1), lambda: space.update(flag=True)),
                         (lambda: setattr(_Scaled, "SCALE", 3.0),
                          lambda: setattr(_Scaled, "SCALE", 2.0)),
                         (lambda: setattr(holder, "t", TENSOR.clone()),
                          lambda: setattr(holder, "t", TENSOR))]:
        change()
        assert not never_looser()
        undo()
        assert never_looser()


class _Settings:
    """A config object as transformers' are: plain values and a dict of them."""

    def __init__(self) -> None:
        self.scale, self.labels, self.unused = 2.0, {"pos": 1.0, "neg": -1.0}, "x"


class _Configured(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.lin, self.config = nn.Linear(4, 3), _Settings()

    def forward(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        out = self.lin(x) * self.config.scale * self.config.labels["neg"]
        return F.mse_loss(out, y)


def test_a_config_value_changed_compiles_again_and_an_earlier_one_is_found():
    """A config object's guard is checked by its generated walk on every call: a value
    changed deep in its dict compiles again (gbs 7 over 2 systems, mbs 2, each loss and
    gradient equal to eager's); going back to the earlier state compiles nothing."""
    torch.manual_seed(0)
    model = _Configured()
    x, y = torch.randn(7, 4, dtype=torch.float64), torch.randn(7, 3, dtype=torch.float64)
    model.double()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", mbcompile.MbcompileWarning)
        cm = mbcompile.compile(model, 7, 2, 2, example_inputs=(x, y), **plan_free(2))
    config = next(g for g in cm._compiled().guards if g.name == "config")
    assert _walker(config.contents) is not None  # the fast check walks it itself
    states = [(2.0, -1.0), (2.0, -0.5), (2.0, -1.0)]  # a value deep in its dict, and back
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always", mbcompile.RecompileWarning)
        for scale, neg in states:
            model.config.scale, model.config.labels["neg"] = scale, neg
            for p in model.parameters():
                p.grad = None
            loss = cm(x, y)
            loss.backward()
            grads = [p.grad.clone() for p in model.parameters()]
            for p in model.parameters():
                p.grad = None
            want = model(x, y)
            want.backward()
            assert rel_err(loss.detach(), want.detach()) < 1e-12
            assert all(rel_err(g, p.grad) < 1e-12 for g, p in zip(grads, model.parameters()))
    recompiles = [w for w in caught if issubclass(w.category, mbcompile.RecompileWarning)]
    assert len(recompiles) == 1 and "config" in str(recompiles[0].message)
    assert sum(len(entries) for entries in cm._cache.values()) == 2
