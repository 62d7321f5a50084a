"""A list forward appends to, reached other than through an attribute or constant keys:
exact while forward only appends to it, refused where it also reads it (issue 35).

The append is replayed once per step (``side_effects.Extend``); a read of the same list
(its length, an index, a loop) would be fixed by the trace at its compile-time length.
``passes/read_paths.py`` follows how forward reaches it: ``self.box.get("seen")``, a key
held in a variable, an attribute of an object the model holds, a method of that object
(its code), a function given the container, a global's entry. Each read is refused at
compile with ``CaptureError`` naming the list and the fix, the model, its containers and
the globals as they were; each append-only form is exact against eager over three steps
(the models, plans and comparisons of ``test_python_state.py``), under torch.export
too, whose non-strict trace puts a module's lists and dicts back as copies
(``python_state._rebuilt``: the user's own are kept, and forward's appends land there).
"""

from __future__ import annotations

import dataclasses
import warnings
from collections.abc import Iterator
from typing import Any, ClassVar

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F
from test_python_state import _batch, _compile, _picture, _three_steps

import mbcompile

pytestmark = pytest.mark.usefixtures("float64_default")  # conftest.py


@dataclasses.dataclass
class Holder:
    """A plain object the model holds, with a list forward appends to."""

    seen: list[Any] = dataclasses.field(default_factory=list)

    def update(self, value: Any) -> None:  # only appends: exact
        self.seen.append(value)

    def bump(self, value: Any) -> int:  # appends, then reads the length: refused
        self.seen.append(value)
        return len(self.seen)


@dataclasses.dataclass
class Counter:
    """A callable object of the user's whose call appends and reads its own list."""

    log: list[Any] = dataclasses.field(default_factory=list)

    def __call__(self, value: Any) -> int:
        self.log.append(value)
        return len(self.log)


BOXES: dict[str, list[Any]] = {"seen": []}  # a global dict forward reaches a list in
HOLDER = Holder()  # a global object holding one


def _count(box: dict[str, list[Any]]) -> int:
    return len(box["seen"])


class Reached(nn.Module):
    """Appends to a list reached in one of the ways ``READS``/``APPENDS`` name."""

    LOG: ClassVar[list[Any]] = []  # shared by every instance: the class's own
    TABLE: ClassVar[dict[str, float]] = {"scale": 2.0}

    def __init__(self, kind: str, capture: str) -> None:
        super().__init__()
        self.a, self.kind, self.capture = nn.Linear(4, 3), kind, capture
        self.box: dict[str, list[Any]] = {"seen": []}
        self.holder, self.counter = Holder(), Counter()
        self.history: list[Any] = [1.0, 2.0]
        self.key = "seen"

    def forward(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        loss = F.mse_loss(self.a(x), y)
        # under export a write of a tensor is refused on its own: append a number there
        v = loss.detach() if self.capture == "fx" else 1.0
        key, kind = "seen", self.kind
        if kind == "get":  # eager weighs by 1, 2, 3, ... as the list grows
            self.box.get("seen").append(v)
            return loss * len(self.box.get("seen"))
        if kind == "key in a variable":
            self.box[key].append(v)
            return loss * len(self.box[key])
        if kind == "key in an attribute":
            self.box[self.key].append(v)
            return loss * len(self.box[self.key])
        if kind == "held object":
            self.holder.seen.append(v)
            return loss * len(self.holder.seen)
        if kind == "held object's method":
            return loss * self.holder.bump(v)
        if kind == "callable object":
            return loss * self.counter(v)
        if kind == "loop over the container":
            self.box["seen"].append(v)
            return loss * sum(len(seen) for seen in self.box.values())
        if kind == "function given the container":
            self.box["seen"].append(v)
            return loss * _count(self.box)
        if kind == "slice":
            self.history.append(v)
            return loss * len(self.history[-2:])
        if kind == "global's get":
            BOXES.get("seen").append(v)
            return loss * len(BOXES.get("seen"))
        if kind == "global object":
            HOLDER.seen.append(v)
            return loss * len(HOLDER.seen)
        if kind == "class attribute":
            self.LOG.append(v)
            return loss * len(self.LOG)
        if kind == "append to a class attribute's list":
            self.LOG.append(v)
            return loss * self.TABLE["scale"]
        # only appended, however reached: exact
        if kind == "append through get":
            self.box.get("seen").append(v)
        elif kind == "append through a key in a variable":
            self.box[key].append(v)
        elif kind == "append through setdefault":
            self.box.setdefault("seen", []).append(v)
        elif kind == "append to a held object's list":
            self.holder.seen.append(v)
        elif kind == "append in a held object's method":
            self.holder.update(v)
        elif kind == "append to an attribute's list":  # export rebinds it to a copy
            self.history.append(v)
        elif kind == "append through setdefault of a new key":  # made at the first step only
            self.box.setdefault("new", []).append(v)
        elif kind == "append after a membership test":
            if "fresh" not in self.box:
                self.box["fresh"] = []
            self.box["fresh"].append(v)
        return loss


READS = {
    "get": "self.box['seen']",
    "key in a variable": "self.box['seen']",
    "key in an attribute": "self.box['seen']",
    "held object": "self.holder.seen",
    "held object's method": "self.holder.seen",
    "callable object": "Reached.counter.log",
    "loop over the container": "self.box['seen']",
    "function given the container": "self.box['seen']",
    "slice": "self.history",
    "global's get": "the global BOXES['seen']",
    "global object": "the global HOLDER.seen",
    "class attribute": "Reached.LOG",
}
APPENDS = ["append through get", "append through a key in a variable",
           "append through setdefault", "append to a held object's list",
           "append in a held object's method", "append to an attribute's list",
           "append through setdefault of a new key", "append after a membership test"]


@pytest.fixture(autouse=True)
def _class_state() -> Iterator[None]:
    """The class's list and table as they were before each test (shared by all models)."""
    yield
    Reached.LOG.clear()
    Reached.TABLE["scale"] = 2.0


@pytest.mark.parametrize("capture", ["fx", "export"])
@pytest.mark.parametrize("kind", list(READS))
def test_a_list_appended_and_read_however_reached_is_refused_and_changes_nothing(kind, capture):
    torch.manual_seed(0)
    model = Reached(kind, capture)
    before, ids = _picture(model)
    with pytest.raises(mbcompile.CaptureError) as err:
        _compile(model, _batch(), capture=capture)
    text = str(err.value)
    assert f"reads {READS[kind]}, a list it also appends to" in text, text
    assert "keep a count in a number attribute" in text and "nothing was changed" in text
    after, after_ids = _picture(model)
    assert after_ids == ids and after == before
    assert BOXES == {"seen": []} and HOLDER == Holder() and Reached.LOG == []


def _lists(model: nn.Module) -> Any:
    return model.box, model.holder.seen, model.counter.log, model.history


@pytest.mark.parametrize("capture", ["fx", "export"])
@pytest.mark.parametrize("kind", APPENDS)
def test_a_list_only_appended_to_however_reached_is_exact(kind, capture, capsys):
    torch.manual_seed(0)
    model = Reached(kind, capture)
    _three_steps(model, _lists, capsys, capture=capture)
    grown = (*model.box.values(), model.holder.seen, model.history[2:])
    assert sum(len(seen) for seen in grown) == 3


@pytest.mark.parametrize("capture", ["fx", "export"])
def test_a_list_the_class_holds_is_appended_once_per_step_and_its_table_guarded(capture):
    """``self.LOG.append(...)`` on a list the class holds (not the instance): nothing left
    in it by the compile, one full-batch value per step after; ``self.TABLE["scale"]``
    read from the class: changed after compile, it compiles again (a warning naming it)
    and the step follows it, as eager does."""
    torch.manual_seed(0)
    model = Reached("append to a class attribute's list", capture)
    cm = _compile(model, _batch(), capture=capture)
    assert Reached.LOG == []
    for step in range(3):
        if step == 2:
            Reached.TABLE["scale"] = 3.0
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always", mbcompile.RecompileWarning)
            got = cm(*_batch())
        recompiled = [str(w.message) for w in caught
                      if issubclass(w.category, mbcompile.RecompileWarning)]
        assert (step == 2) == any("Reached.TABLE" in r for r in recompiled), recompiled
        loss = F.mse_loss(model.a(_batch()[0]), _batch()[1])
        assert torch.allclose(got, loss * Reached.TABLE["scale"])
        assert len(Reached.LOG) == step + 1
        appended = Reached.LOG[-1]
        assert torch.allclose(torch.as_tensor(appended), loss.detach()) if capture == "fx" \
            else appended == 1.0


class FirstKept(nn.Module):
    """``setdefault`` of a tensor into a dict made in ``__init__``: eager keeps the first
    step's loss; the key, missing at compile, is guarded missing (compiled again once set).
    ``stats["last"]`` beside it is set at every step, as eager does."""

    def __init__(self) -> None:
        super().__init__()
        self.a, self.box, self.stats = nn.Linear(4, 3), {}, {}

    def forward(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        loss = F.mse_loss(self.a(x), y)
        self.box.setdefault("first", loss.detach())
        self.stats["last"] = loss.detach()
        return loss


def test_a_tensor_put_by_setdefault_keeps_the_first_value_as_eager(capsys):
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", mbcompile.RecompileWarning)
        _three_steps(FirstKept(), lambda m: (m.box, m.stats), capsys)


class LazyInit(nn.Module):
    """State forward makes on its first call: ``hasattr`` and ``getattr`` with a default of
    an attribute that is missing at compile, guarded as missing (compiled again once it
    exists, as eager then takes the other branch), and a ``setdefault`` into the dict it made."""

    def __init__(self) -> None:
        super().__init__()
        self.a = nn.Linear(4, 3)

    def forward(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        loss = F.mse_loss(self.a(x), y)
        if not hasattr(self, "first"):
            self.first = loss.detach()
        self.box = getattr(self, "box", {})
        self.box.setdefault("k", loss.detach())
        return loss


def test_state_made_lazily_on_the_first_call_is_kept_as_eager_keeps_it(capsys):
    """``first`` and ``box["k"]`` hold the first step's loss after every step, as in eager
    (they were written again with each step's loss), under torch.export too (the tensor
    written to an attribute was refused there)."""
    def state(m: nn.Module) -> Any:
        return getattr(m, "first", None), getattr(m, "box", None)

    for capture in ("auto", "export"):
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", mbcompile.RecompileWarning)
            _three_steps(LazyInit(), state, capsys, capture=capture)


def _lengths(value: Any) -> int:
    """The lengths of the lists ``value`` holds, however deep."""
    if isinstance(value, list):
        return len(value)
    return sum(_lengths(v) for v in value.values()) if isinstance(value, dict) else 0


class Deep(nn.Module):
    """A list forward appends to, held 20 levels down in a dict a function reads whole:
    deeper than the search goes, so refused (it was missed: the trace fixed its length)."""

    def __init__(self) -> None:
        super().__init__()
        self.a, self.log = nn.Linear(4, 3), []
        self.deep: dict[str, Any] = {"log": self.log}
        for _ in range(20):
            self.deep = {"inner": self.deep}

    def forward(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        self.log.append(1.0)
        return F.mse_loss(self.a(x), y) * (1 + _lengths(self.deep))


def test_a_list_held_deeper_than_the_search_is_refused():
    model = Deep()
    with pytest.raises(mbcompile.CaptureError, match="more than 16 levels down"):
        _compile(model, _batch())
    assert model.log == []
