"""Inputs and outputs as real code passes them (found by a hunt), exact or refused.

- A flag or number inside a batch dict (``{"x": x, "flip": True, "weight": 3.0}``) under
  torch.export: the graph held the example's value, and a call with another silently ran
  it (loss 0.9650 against eager's 1.6952). Now refused at the call, naming the fix;
  under torch.fx a number there is read as the call's, and stays exact.
- The same tensor passed as two inputs (``labels=input_ids``) with forward writing one in
  place: the other read the value before the write (loss 2.7017 against 2.7340). Now
  refused at the call, before anything runs; a copy runs as eager.
- The loss returned twice: backward() was refused as if another output asked for its
  gradient.
- Under torch.fx, ``isinstance(h, torch.Tensor)``, ``torch.is_tensor(h)``, ``str(h.dtype)``
  and ``f"{h.shape[1]}"`` of a traced value answered as of fx's proxy, and a branch on
  them went the other way (loss 0.8751 against 0.8390): ``torch.is_tensor`` answers as
  eager's now; the others are refused at their line, so ``capture="auto"`` takes
  torch.export, which is exact; a string formatted from a traced tensor under export
  (``FakeTensor(...)``) is refused where it is printed or stored.

Float64, gbs 7 over 2 systems at MBS 2, against eager on a deep copy made before compile.
"""

from __future__ import annotations

import copy
from typing import Any

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F
from models import plan_free

import mbcompile

pytestmark = pytest.mark.usefixtures("float64_default")  # conftest.py

GBS, SYSTEMS, MBS = 7, 2, 2


def _pair(n: int = GBS) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(n)
    return torch.randn(n, 4, generator=g), torch.randn(n, 3, generator=g)


class Flagged(nn.Module):
    """Reads a flag (export only: a branch) and a weight out of the batch dict."""

    def __init__(self, branch: bool) -> None:
        super().__init__()
        self.lin, self.branch = nn.Linear(4, 3), branch

    def forward(self, batch: dict[str, Any], y: torch.Tensor) -> torch.Tensor:
        o = self.lin(batch["x"])
        if self.branch and batch["flip"]:
            o = -o
        return F.mse_loss(o, y) * batch["weight"]


def _compiled(capture: str) -> tuple[nn.Module, nn.Module, Any]:
    torch.manual_seed(0)
    model = Flagged(branch=capture == "export")
    eager = copy.deepcopy(model)
    x, y = _pair()
    cm = mbcompile.compile(model, GBS, SYSTEMS, MBS,
                           example_inputs=({"x": x, "flip": False, "weight": 1.0}, y),
                           **plan_free(MBS, capture=capture))
    return model, eager, cm


def test_a_value_inside_an_input_that_export_holds_is_refused_when_it_changes():
    model, eager, cm = _compiled("export")
    x, y = _pair()
    same = {"x": x, "flip": False, "weight": 1.0}
    assert float(cm(same, y)) == pytest.approx(float(eager(same, y)), rel=1e-12)
    for key, value in (("flip", True), ("weight", 3.0), ("weight", 1)):
        with pytest.raises(mbcompile.InputError, match=rf"input batch\['{key}'\] is "
                           rf"{value!r} where the example passed .*fixed at compile time.*"
                           "Fix: pass it as a tensor"):
            cm({**same, key: value}, y)
    assert all(p.grad is None for p in model.parameters())


def test_a_number_inside_an_input_is_the_calls_under_fx():
    _, eager, cm = _compiled("fx")
    x, y = _pair()
    for weight in (1.0, 3.0, 0.5):
        batch = {"x": x, "flip": False, "weight": weight}
        assert float(cm(batch, y)) == pytest.approx(float(eager(batch, y)), rel=1e-12)


class LoggedTwice(nn.Module):
    """Returns its loss twice, as a trainer's log dict does."""

    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(4, 3)

    def forward(self, x: torch.Tensor, y: torch.Tensor) -> dict[str, Any]:
        loss = F.mse_loss(self.lin(x), y)
        return {"loss": loss, "log": {"train_loss": loss}}


@pytest.mark.parametrize("capture", ["fx", "export"])
def test_the_loss_returned_twice_backpropagates(capture):
    """backward() raised a MicrobatchError about retain_grad or a hook on an output: the
    loss's second place was taken for another output, its own check's hook for the user's."""
    torch.manual_seed(0)
    model = LoggedTwice()
    eager = copy.deepcopy(model)
    cm = mbcompile.compile(model, GBS, SYSTEMS, MBS, example_inputs=_pair(),
                           **plan_free(MBS, capture=capture))
    got, want = cm(*_pair()), eager(*_pair())
    assert got["loss"] is got["log"]["train_loss"]
    got["loss"].backward()
    want["loss"].backward()
    for p, q in zip(model.parameters(), eager.parameters()):
        torch.testing.assert_close(p.grad, q.grad, rtol=1e-12, atol=0)


class Sanitised(nn.Module):
    """Writes its ids in place before the lookup; the labels are read as passed."""

    def __init__(self) -> None:
        super().__init__()
        self.e, self.h = nn.Embedding(11, 8), nn.Linear(8, 11)

    def forward(self, ids: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        ids.masked_fill_(ids == 3, 0)
        return F.cross_entropy(self.h(self.e(ids)).flatten(0, 1), labels.flatten())


@pytest.mark.parametrize("capture", ["fx", "export"])
def test_an_input_written_in_place_that_another_input_aliases_is_refused(capture):
    torch.manual_seed(0)
    model = Sanitised()
    eager = copy.deepcopy(model)
    g = torch.Generator().manual_seed(1)
    ids = torch.randint(0, 11, (GBS, 5), generator=g)
    cm = mbcompile.compile(model, GBS, SYSTEMS, MBS, example_inputs=(ids, ids.clone()),
                           **plan_free(MBS, capture=capture))
    before = ids.clone()
    with pytest.raises(mbcompile.InputError, match="input 'ids' shares memory with input "
                       r"'labels'.*Fix: pass a copy \(labels=ids.clone\(\)\)"):
        cm(ids, ids)
    assert torch.equal(ids, before) and all(p.grad is None for p in model.parameters())
    got = cm(ids, ids.clone())
    want = eager(before, before.clone())
    got.backward()
    want.backward()
    assert float(got) == pytest.approx(float(want), rel=1e-12) and torch.equal(ids, before)
    for p, q in zip(model.parameters(), eager.parameters()):
        torch.testing.assert_close(p.grad, q.grad, rtol=1e-12, atol=0)


class Relabelled(nn.Module):
    """Writes its labels in place (``labels[:, -1] = -100``): a write torch.fx cannot trace."""

    def __init__(self) -> None:
        super().__init__()
        self.e, self.h = nn.Embedding(11, 8), nn.Linear(8, 11)

    def forward(self, ids: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        labels[:, -1] = -100
        return F.cross_entropy(self.h(self.e(ids)).flatten(0, 1), labels.flatten(),
                               ignore_index=-100)


@pytest.mark.parametrize("model_cls, capture", [(Sanitised, "fx"), (Sanitised, "export"),
                                                (Relabelled, "auto")])
@pytest.mark.parametrize("alias", ["same", "view"])
def test_an_example_whose_written_input_another_aliases_is_refused_at_compile(
        model_cls, capture, alias):
    """compile() with ``labels=ids`` for a forward that writes one of them: torch.export
    failed inside torch ("Expected !size_bytes_is_heap_allocated_") with advice about
    data-dependent Python, and fx compiled a module every call of which was refused."""
    torch.manual_seed(0)
    model = model_cls()
    state = copy.deepcopy(model.state_dict())
    ids = torch.randint(0, 11, (GBS, 5), generator=torch.Generator().manual_seed(1))
    before = ids.clone()
    with pytest.raises(mbcompile.InputError, match="shares memory with input .*forward "
                       "writes .* in place.*Fix: pass a copy"):
        mbcompile.compile(model, GBS, SYSTEMS, MBS,
                          example_inputs=(ids, ids if alias == "same" else ids[:, :]),
                          **plan_free(MBS, capture=capture))
    assert torch.equal(ids, before)
    assert all(torch.equal(v, state[k]) for k, v in model.state_dict().items())
    # the same example passed apart compiles and trains as eager
    eager = copy.deepcopy(model)
    cm = mbcompile.compile(model, GBS, SYSTEMS, MBS, example_inputs=(ids, ids.clone()),
                           **plan_free(MBS, capture=capture))
    got, want = cm(ids.clone(), ids.clone()), eager(ids.clone(), ids.clone())
    got.backward()
    want.backward()
    assert float(got) == pytest.approx(float(want), rel=1e-12)
    for p, q in zip(model.parameters(), eager.parameters()):
        torch.testing.assert_close(p.grad, q.grad, rtol=1e-12, atol=0)


class Checks(nn.Module):
    """Branches on what a traced value is, as library-style code does (``capped``: one
    subclass per check, as the fx capture reads the code of the model's classes)."""

    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(4, 3)

    def capped(self, weight: Any, o: torch.Tensor) -> bool:
        raise NotImplementedError

    def forward(self, x: torch.Tensor, y: torch.Tensor, weight: Any = 1.0) -> torch.Tensor:
        o = self.lin(x)
        if self.capped(weight, o):
            weight = weight.clamp(max=0.5)
        return (((o - y) ** 2).mean(1) * weight).mean()


CHECKS = {
    "isinstance": lambda self, w, o: isinstance(w, torch.Tensor),
    "is_tensor": lambda self, w, o: torch.is_tensor(w),
    "str": lambda self, w, o: str(o.dtype) == "torch.float64",
    "format": lambda self, w, o: f"{o.shape[1]}" == "3",
}


@pytest.mark.parametrize("how", ["isinstance", "is_tensor", "str", "format"])
def test_a_branch_on_what_a_traced_value_is_takes_eagers_side(how):
    x, y = _pair()
    w = torch.rand(GBS, generator=torch.Generator().manual_seed(2))
    capture = "fx" if how == "is_tensor" else "auto"
    if capture == "auto":
        with pytest.raises(mbcompile.CaptureError, match="of a traced value .*"
                           r"test_input_structures.*Fix: .*compile with capture='export' "
                           r"\(capture='auto' does\)"):
            mbcompile.compile(_checks(how), GBS, SYSTEMS, MBS, example_inputs=(x, y, w),
                              **plan_free(MBS, capture="fx"))
    torch.manual_seed(0)
    model = _checks(how)
    eager = copy.deepcopy(model)
    cm = mbcompile.compile(model, GBS, SYSTEMS, MBS, example_inputs=(x, y, w),
                           **plan_free(MBS, capture=capture))
    got, want = cm(x, y, w), eager(x, y, w)
    got.backward()
    want.backward()
    assert float(got) == pytest.approx(float(want), rel=1e-12)
    for p, q in zip(model.parameters(), eager.parameters()):
        torch.testing.assert_close(p.grad, q.grad, rtol=1e-12, atol=0)


def _checks(how: str) -> Checks:
    return type(f"Checks_{how}", (Checks,), {"capped": CHECKS[how]})()


class Formatted(nn.Module):
    def __init__(self, stored: bool) -> None:
        super().__init__()
        self.lin, self.stored, self.note = nn.Linear(4, 3), stored, ""

    def forward(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        loss = F.mse_loss(self.lin(x), y)
        if self.stored:
            self.note = f"loss {loss.detach()}"
        else:
            print(f"loss {loss.detach()}")
        return loss


@pytest.mark.parametrize("stored", [False, True], ids=["printed", "stored"])
def test_a_string_formatted_from_a_traced_tensor_is_refused_under_export(stored, capsys):
    """It printed (or kept) "loss FakeTensor(..., size=())" at every step."""
    model = Formatted(stored)
    with pytest.raises(mbcompile.CaptureError, match="formats a traced tensor into a string|"
                       "a string formatted from a traced value"):
        mbcompile.compile(model, GBS, SYSTEMS, MBS, example_inputs=_pair(),
                          **plan_free(MBS, capture="export"))
    assert capsys.readouterr().out == "" and model.note == ""


class FromObject(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(4, 3)

    def forward(self, batch: Any) -> torch.Tensor:
        return F.mse_loss(self.lin(batch.x), batch.y)


def test_a_batch_object_torch_cannot_look_into_is_refused_at_compile():
    """A dataclass (or namespace) batch was compiled with its tensors as constants of the
    graph, nothing split; the next call failed with a long error naming a wrong fix."""
    import types

    x, y = _pair()
    for batch in (types.SimpleNamespace(x=x, y=y),):
        with pytest.raises(mbcompile.InputError, match=r"input 'batch' holds tensors inside a "
                           r"types.SimpleNamespace.*Fix: pass a dict"):
            mbcompile.compile(FromObject(), GBS, SYSTEMS, MBS, example_inputs=(batch,),
                              **plan_free(MBS))


class OwnHead(nn.Module):
    """A model of one's own that returns transformers' output type."""

    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(4, 3)

    def forward(self, x: torch.Tensor, labels: torch.Tensor) -> Any:
        from transformers.modeling_outputs import SequenceClassifierOutput

        logits = self.lin(x)
        return SequenceClassifierOutput(loss=F.cross_entropy(logits, labels), logits=logits)


@pytest.mark.parametrize("capture", ["fx", "export"])
def test_a_transformers_output_made_by_ones_own_model_is_eagers(capture):
    """Its constructor was refused as a write into an object of the package's."""
    pytest.importorskip("transformers")
    torch.manual_seed(0)
    model = OwnHead()
    eager = copy.deepcopy(model)
    x = _pair()[0]
    labels = torch.randint(0, 3, (GBS,), generator=torch.Generator().manual_seed(3))
    cm = mbcompile.compile(model, GBS, SYSTEMS, MBS, example_inputs=(x, labels),
                           **plan_free(MBS, capture=capture))
    got, want = cm(x, labels), eager(x, labels)
    assert type(got) is type(want)
    got.loss.backward()
    want.loss.backward()
    torch.testing.assert_close(got.logits, want.logits, rtol=1e-12, atol=0)
    for p, q in zip(model.parameters(), eager.parameters()):
        torch.testing.assert_close(p.grad, q.grad, rtol=1e-12, atol=0)


class Masked(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(4, 3)

    def forward(self, batch: dict[str, Any], y: torch.Tensor) -> torch.Tensor:
        o = self.lin(batch["x"])
        if batch["mask"] is not None:
            o = o * batch["mask"][:, None]
        return F.mse_loss(o, y)


def test_a_none_entry_of_a_batch_dict_is_captured_by_export_under_auto():
    """torch.fx traced the dict as one proxy, so ``is not None`` held and the analysis
    refused the lookup of None with a misleading MixingError; auto now tries export."""
    torch.manual_seed(0)
    model = Masked()
    eager = copy.deepcopy(model)
    x, y = _pair()
    batch = {"x": x, "mask": None}
    cm = mbcompile.compile(model, GBS, SYSTEMS, MBS, example_inputs=(batch, y),
                           **plan_free(MBS))
    got, want = cm(batch, y), eager(batch, y)
    assert float(got) == pytest.approx(float(want), rel=1e-12)


def test_an_empty_batch_is_named_as_such():
    """It raised PlanError 'gbs must be at least 1, got 0', naming what the call did not
    pass."""
    model = LoggedTwice()
    cm = mbcompile.compile(model, GBS, SYSTEMS, MBS, example_inputs=_pair(), **plan_free(MBS))
    x, y = _pair()
    with pytest.raises(mbcompile.InputError, match=r"input 'x' has no samples \(its batch dim "
                       "is 0\\); a step needs at least one"):
        cm(x[:0], y[:0])


class Complex(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(4, 3)

    def forward(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        z = torch.complex(self.lin(x), x[:, :3])
        return ((z * z.conj()).real - y).pow(2).mean()


@pytest.mark.parametrize("capture", ["fx", "export"])
def test_a_conjugate_is_per_sample_under_both_captures(capture):
    """torch.export writes z.conj() as aten._conj, which had no batch rule: refused."""
    torch.manual_seed(0)
    model = Complex()
    eager = copy.deepcopy(model)
    cm = mbcompile.compile(model, GBS, SYSTEMS, MBS, example_inputs=_pair(),
                           **plan_free(MBS, capture=capture))
    got, want = cm(*_pair()), eager(*_pair())
    got.backward()
    want.backward()
    assert float(got) == pytest.approx(float(want), rel=1e-12)
    for p, q in zip(model.parameters(), eager.parameters()):
        torch.testing.assert_close(p.grad, q.grad, rtol=1e-12, atol=1e-15)
