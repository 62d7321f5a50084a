"""Tensors forward writes into Python state, under ``capture="export"`` (issue 30).

torch.export puts back every module attribute it saw assigned, with only a warning for a
tensor: ``self.last = loss.detach()`` ran, and ``self.last`` kept its old value, silently.
The dict keys, list appends and prints that held a tensor were refused. Now each is
replayed once per step with the full batch's values, as under ``capture="fx"``
(``passes/export_writes.py``). Compared with eager on a deep copy, float64, on uneven
plans and at batch sizes other than the example's: the outputs, every ``.grad`` and the
state written. A traced value inside an object that is not a tuple, list or dict is
refused under both captures, with nothing changed (it left the tracer's object in the
model).
"""

from __future__ import annotations

import copy
import types
import warnings
from typing import Any

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F
from models import TOL, plan_free, rel_err

import mbcompile

pytestmark = pytest.mark.usefixtures("float64_default")  # conftest.py

GBS, SYSTEMS, MBS = 7, 2, 2


class Head(nn.Module):
    """A layer that keeps its last per-sample output on itself."""

    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(4, 3)
        self.seen: torch.Tensor | None = None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        o = self.lin(x)
        self.seen = o.detach()  # per-sample: the full batch's rows, in order
        return o


class Writer(nn.Module):
    """Attributes of the model and of a submodule, a dict key, a list append and a print,
    each holding a traced tensor; ``coupled`` takes ``sqrt`` of the loss (a two-phase
    step)."""

    def __init__(self, coupled: bool = False) -> None:
        super().__init__()
        self.head, self.coupled = Head(), coupled
        self.last: torch.Tensor | None = None
        self.stats: dict[str, Any] = {}
        self.history: list[torch.Tensor] = []

    def forward(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        o = self.head(x)
        loss = F.mse_loss(o, y)
        if self.coupled:
            loss = loss.sqrt()
        self.last = loss.detach()
        self.stats["mean"] = o.detach().mean(0)
        self.history.append(loss.detach() * 2)
        print("loss", loss.detach())
        return loss


def _state(m: Writer) -> list[Any]:
    return [m.last, m.head.seen, m.stats.get("mean"), list(m.history)]


def _close(got: Any, want: Any, where: str) -> None:
    assert type(got) is type(want), (where, got, want)
    if isinstance(want, list):
        assert len(got) == len(want), (where, got, want)
        for g, w in zip(got, want):
            _close(g, w, where)
    elif isinstance(want, torch.Tensor):
        assert not got.requires_grad and got.shape == want.shape, (where, got, want)
        assert rel_err(got, want) <= TOL, (where, got, want)
    else:
        assert got == want, (where, got, want)


def _batch(n: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(n)
    return torch.randn(n, 4, generator=g), torch.randn(n, 3, generator=g)


@pytest.mark.parametrize("coupled", [False, True], ids=["plain", "two-phase"])
def test_tensors_written_under_export_are_replayed_as_eager_writes_them(coupled, capsys):
    torch.manual_seed(0)
    model = Writer(coupled)
    eager = copy.deepcopy(model)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        cm = mbcompile.compile(model, GBS, SYSTEMS, MBS, example_inputs=_batch(GBS),
                               **plan_free(MBS, capture="export"))
    assert not [w for w in caught if "assigned during export" in str(w.message)]
    assert capsys.readouterr().out == "" and _state(model) == [None, None, None, []]
    opts = [torch.optim.SGD(m.parameters(), lr=0.1) for m in (model, eager)]
    for n in (GBS, 5, 9):  # the example's batch size, then others
        results = []
        for module, call, opt in ((model, cm, opts[0]), (eager, eager, opts[1])):
            opt.zero_grad(set_to_none=True)
            with warnings.catch_warnings():
                warnings.simplefilter("ignore", mbcompile.MbcompileWarning)
                loss = call(*_batch(n))
            loss.backward()
            results.append((loss.detach(), [p.grad for p in module.parameters()],
                            capsys.readouterr().out))
            opt.step()
        (got, got_grads, got_out), (want, want_grads, want_out) = results
        assert got_out == want_out and want_out.startswith("loss tensor(")
        _close([got, *got_grads], [want, *want_grads], f"batch {n}: loss and grads")
        _close(_state(model), _state(eager), f"batch {n}: state")


def test_a_written_tensor_follows_the_length_of_a_transformers_model():
    """A ``GPT2LMHeadModel`` subclass that logs (captured by torch.export under the default
    capture), at three sequence lengths of one compile."""
    transformers = pytest.importorskip("transformers")

    class Logged(transformers.GPT2LMHeadModel):
        def forward(self, input_ids: torch.Tensor, labels: torch.Tensor, **kw: Any) -> Any:
            out = super().forward(input_ids=input_ids, labels=labels, **kw)
            self.last_loss = out.loss.detach()
            self.transformer.h[0].seen = out.logits.detach().mean(-1)  # (batch, length)
            return out

    torch.manual_seed(0)
    model = Logged(transformers.GPT2Config(
        vocab_size=32, n_positions=32, n_embd=16, n_layer=1, n_head=2, resid_pdrop=0.0,
        embd_pdrop=0.0, attn_pdrop=0.0)).double()
    eager = copy.deepcopy(model)
    ids = torch.randint(0, 32, (5, 9))
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        cm = mbcompile.compile(model, 5, 1, 2, example_kwargs={"input_ids": ids,
                                                               "labels": ids},
                               **plan_free(2))
        for length in (9, 12, 6):
            ids = torch.randint(0, 32, (5, length))
            got, want = cm(input_ids=ids, labels=ids), eager(input_ids=ids, labels=ids)
            got.loss.backward()
            want.loss.backward()
            # transformers computes the loss in float32: that far apart, as eager's own
            assert abs(float(got.loss) - float(want.loss)) < 1e-6
            assert model.transformer.h[0].seen.shape == (5, length)
            _close(model.transformer.h[0].seen, eager.transformer.h[0].seen, f"{length}")
            assert abs(float(model.last_loss) - float(eager.last_loss)) < 1e-6
            for p, q in zip(model.parameters(), eager.parameters()):
                assert rel_err(p.grad, q.grad) <= 1e-6, length


class Boxed(nn.Module):
    """A traced tensor inside a namespace: no container mbcompile rebuilds."""

    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(4, 3)
        self.info: Any = None

    def forward(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        loss = F.mse_loss(self.lin(x), y)
        self.info = types.SimpleNamespace(loss=loss.detach())
        return loss


@pytest.mark.parametrize("capture", ["fx", "export"])
def test_a_traced_tensor_inside_an_object_is_refused_changing_nothing(capture):
    """It was replayed as it was traced: the model kept fx's proxy or export's fake
    tensor."""
    model = Boxed()
    before = copy.deepcopy(model.state_dict())
    with pytest.raises(mbcompile.CaptureError, match=r"Boxed\.forward writes to self\.info a "
                       r"SimpleNamespace that holds a traced tensor.*Fix: store the tensor"):
        mbcompile.compile(model, GBS, SYSTEMS, MBS, example_inputs=_batch(GBS),
                          **plan_free(MBS, capture=capture))
    assert model.info is None
    assert all(torch.equal(v, before[k]) for k, v in model.state_dict().items())


class Worst(nn.Module):
    """A detached metric of the outputs and the targets, written and returned, beside a
    loss that a batch maximum makes a two-phase step."""

    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(4, 3)
        self.worst: torch.Tensor | None = None

    def forward(self, x: torch.Tensor, y: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        o = self.lin(x)
        loss = F.mse_loss(o, y)
        gap = (o.detach() - y).abs().amax()
        self.worst = gap
        return loss, gap


@pytest.mark.parametrize("capture", ["fx", "export"])
def test_a_detached_metric_of_the_targets_carries_no_gradient(capture):
    """Under export it came back requiring grad, with the two-phase step's grad_fn (kept
    alive in the model), and (loss + gap).backward() was refused: export writes mse_loss
    with broadcast_tensors(o, y), whose target output was taken to depend on parameters."""
    torch.manual_seed(0)
    model = Worst()
    eager = copy.deepcopy(model)
    cm = mbcompile.compile(model, GBS, SYSTEMS, MBS, example_inputs=_batch(GBS),
                           **plan_free(MBS, capture=capture))
    (loss, gap), (want_loss, want_gap) = cm(*_batch(GBS)), eager(*_batch(GBS))
    assert not gap.requires_grad and not model.worst.requires_grad
    assert model.worst.grad_fn is None
    (loss + gap).backward()
    (want_loss + want_gap).backward()
    _close([gap, model.worst, *(p.grad for p in model.parameters())],
           [want_gap.detach(), eager.worst, *(p.grad for p in eager.parameters())], "gap")


class Snapshotting(nn.Module):
    """A buffer updated in place, then kept under another name in Python state."""

    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(4, 3)
        self.register_buffer("run", torch.zeros(3))
        self.snap: torch.Tensor | None = None

    def forward(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        o = self.lin(x)
        self.run.add_(o.detach().sum(0))
        self.snap = self.run
        return F.mse_loss(o, y)


def test_a_buffer_kept_in_python_state_is_the_buffer_itself():
    """The buffer became one more output of the export, whose write-back's copy_ then lay
    on that output's path: refused as an op with no batch rule, naming a wrong fix."""
    torch.manual_seed(0)
    model = Snapshotting()
    eager = copy.deepcopy(model)
    cm = mbcompile.compile(model, GBS, SYSTEMS, MBS, example_inputs=_batch(GBS),
                           **plan_free(MBS, capture="export"))
    for n in (GBS, 5):
        cm(*_batch(n)).backward()
        eager(*_batch(n)).backward()
        assert model.snap is model.run and eager.snap is eager.run
        _close(model.run, eager.run, f"batch {n}")


class ItemLogged(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(4, 3)
        self.stats: dict[str, Any] = {}

    def forward(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        loss = F.mse_loss(self.lin(x), y)
        self.stats["loss"] = loss.item()
        return loss


def test_a_number_read_off_a_tensor_under_export_names_item():
    """It was called 'a size read off an input', with a fix (capture='fx') that transformers'
    models cannot take."""
    model = ItemLogged()
    with pytest.raises(mbcompile.CaptureError, match=r"writes a Python number read off a "
                       r"traced tensor .*stats\['loss'\].*store the tensor \(loss.detach\(\)\)"):
        mbcompile.compile(model, GBS, SYSTEMS, MBS, example_inputs=_batch(GBS),
                          **plan_free(MBS, capture="export"))
    assert model.stats == {}
