"""``compile(outputs=...)``: a training step returns (and keeps per microbatch) only what
is asked for, the memory model counts only that, and the numbers stay the full batch's."""

from __future__ import annotations

import copy
from dataclasses import replace

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

import mbcompile
from mbcompile.check import relative_error
from mbcompile.models import make_mlp, make_tiny_gpt
from mbcompile.planning.systems import get_system

GBS = 16


class DictOut(nn.Module):
    """Returns a dict, as HuggingFace models do: loss, logits and features."""

    def __init__(self) -> None:
        super().__init__()
        self.enc, self.head = nn.Linear(8, 16), nn.Linear(16, 3)

    def forward(self, x: torch.Tensor, y: torch.Tensor) -> dict[str, torch.Tensor]:
        h = torch.tanh(self.enc(x))
        logits = self.head(h)
        return {"loss": F.cross_entropy(logits, y), "logits": logits, "features": h}


def _dict_batch() -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(1)
    return (torch.randn(GBS, 8, generator=g, dtype=torch.float64),
            torch.randint(0, 3, (GBS,), generator=g))


def _eager(model: nn.Module, batch: tuple) -> tuple[object, nn.Module]:
    ref = copy.deepcopy(model)
    out = ref(*batch)
    (out["loss"] if isinstance(out, dict) else out[0]).backward()
    return out, ref


@pytest.mark.parametrize("outputs", ["all", "loss", ["logits"], ("features", "logits")])
def test_kept_outputs_are_returned_and_the_rest_are_none(outputs):
    torch.manual_seed(0)
    model, batch = DictOut().double(), _dict_batch()
    want, ref = _eager(model, batch)
    cm = mbcompile.compile(model, GBS, 2, 3, example_inputs=batch, outputs=outputs)
    out = cm(*batch)
    kept = {"loss", "logits", "features"} if outputs == "all" else {"loss", *(
        [] if outputs == "loss" else outputs)}
    for key in ("loss", "logits", "features"):
        if key in kept:
            assert relative_error(out[key], want[key]) <= 1e-12, key
        else:
            assert out[key] is None, key
    out["loss"].backward()
    for a, b in zip(model.parameters(), ref.parameters()):
        assert relative_error(a.grad, b.grad) <= 1e-12
    # what is not kept is not an output of the body either: never kept per microbatch
    body_out = next(n for n in reversed(cm.graph_module.body.graph.nodes) if n.op == "output")
    assert len(body_out.all_input_nodes) == 2 + sum(k in kept for k in ("logits", "features"))


def test_the_memory_model_counts_only_what_is_kept():
    model, batch = make_tiny_gpt(GBS)
    every = mbcompile.compile(model, GBS, 2, 4, example_inputs=batch, compile_only=True)
    loss = mbcompile.compile(model, GBS, 2, 4, example_inputs=batch, outputs="loss",
                             compile_only=True)
    assert every.estimate.memory.outputs > 0 and loss.estimate.memory.outputs == 0
    assert loss.estimate.memory.peak < every.estimate.memory.peak


def test_a_larger_mbs_fits_when_logits_are_not_kept():
    """A system with room for microbatches of 8 when the logits are dropped, not when the
    earlier microbatches' logits are kept: an int MBS fits or not, and auto sees it."""
    model, batch = make_tiny_gpt(GBS, vocab=512)
    host = get_system("host")
    peak = {o: mbcompile.compile(model, GBS, 1, 8, example_inputs=batch, outputs=o,
                                 compile_only=True).estimate.memory.peak
            for o in ("all", "loss")}
    assert peak["loss"] < peak["all"]
    tight = replace(host, name="tight", memory_bytes=(peak["loss"] + peak["all"]) / 2)
    # (without activation checkpointing, the other way to make it fit)
    with pytest.raises(mbcompile.DoesNotFitError):
        mbcompile.compile(model, GBS, 1, 8, example_inputs=batch, system=tight,
                          compile_only=True, recompute=False)
    mbcompile.compile(model, GBS, 1, 8, example_inputs=batch, outputs="loss", system=tight,
                      compile_only=True, recompute=False)
    chosen = {o: mbcompile.compile(model, GBS, 1, "auto", example_inputs=batch, outputs=o,
                                   system=tight, compile_only=True, recompute=False).plan.mbs
              for o in ("all", "loss")}
    assert chosen["loss"] >= 8 and chosen["loss"] >= chosen["all"]


def test_eval_mode_returns_every_output():
    torch.manual_seed(0)
    model, batch = DictOut().double(), _dict_batch()
    cm = mbcompile.compile(model, GBS, 2, 3, example_inputs=batch, outputs="loss")
    model.eval()
    with torch.no_grad():
        out = cm(*batch)
    assert out["logits"] is not None and out["features"] is not None


def test_bad_outputs_are_refused_with_the_names():
    model, batch = DictOut().double(), _dict_batch()
    with pytest.raises(mbcompile.InputError, match="'logit'.*outputs are"):
        mbcompile.compile(model, GBS, 2, 3, example_inputs=batch, outputs=["logit"])
    with pytest.raises(mbcompile.InputError, match="must be one of"):
        mbcompile.compile(model, GBS, 2, 3, example_inputs=batch, outputs="logits")
    with pytest.raises(mbcompile.ArgumentTypeError):
        mbcompile.compile(model, GBS, 2, 3, example_inputs=batch, outputs=3)
    no_loss = nn.Linear(8, 3)
    with pytest.raises(mbcompile.InputError, match="needs a loss"):
        mbcompile.compile(no_loss, GBS, 2, 3, example_inputs=(torch.randn(GBS, 8),),
                          outputs="loss")


def test_tuple_outputs_are_named_by_position():
    model, batch = make_mlp(GBS, dtype=torch.float64)
    out = mbcompile.compile(model, GBS, 2, 4, example_inputs=batch, outputs="loss")(*batch)
    full = model(*batch)
    assert isinstance(out, tuple) and len(out) == len(full)
    assert relative_error(out[0], full[0]) <= 1e-12 and all(o is None for o in out[1:])


def test_the_trainer_keeps_outputs_only_for_its_metrics():
    model, batch = make_tiny_gpt(GBS)
    plain = mbcompile.Trainer(model, torch.optim.SGD(model.parameters(), lr=0.1), gbs=GBS,
                              num_csx=2, progress=False)
    assert plain.compile("train", batch)(*batch)[1] is None  # logits: not kept
    metric = {"logit_mean": lambda out, b: out[1].mean()}
    measured = mbcompile.Trainer(model, torch.optim.SGD(model.parameters(), lr=0.1), gbs=GBS,
                                 num_csx=2, progress=False, metrics=metric)
    assert measured.compile("train", batch)(*batch)[1] is not None


class CoupledOut(nn.Module):
    """A loss that couples samples (the root of a batch mean): a two-phase step."""

    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(4, 3)

    def forward(self, x: torch.Tensor, y: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        out = self.lin(x)
        return F.mse_loss(out, y).sqrt(), out


@pytest.mark.parametrize("step", ["split", "two-phase"])
@pytest.mark.parametrize("asks", ["retain_grad", "register_hook"])
def test_an_output_that_asks_for_its_gradient_is_refused_and_changes_nothing(step: str,
                                                                            asks: str) -> None:
    """The step's backward ran in the call, for the loss: the logits are not on the loss's
    graph, so ``logits.retain_grad()`` got None silently where eager's gets dL/dlogits."""
    torch.manual_seed(0)
    if step == "split":
        model, (x, y) = make_tiny_gpt(batch=7, dtype=torch.float64)
    else:
        model = CoupledOut().double()
        x, y = torch.randn(7, 4, dtype=torch.float64), torch.randn(7, 3, dtype=torch.float64)
    eager = copy.deepcopy(model)
    cm = mbcompile.compile(model, 7, 2, 2, example_inputs=(x, y), cost_model=False)
    loss, out = cm(x, y)
    if asks == "retain_grad":
        out.retain_grad()
    else:
        out.register_hook(lambda g: g)
    with pytest.raises(mbcompile.MicrobatchError, match="asks for its gradient"):
        loss.backward()
    assert all(p.grad is None for p in model.parameters())
    loss, out = cm(x, y)  # without asking: eager's step
    loss.backward()
    eager(x, y)[0].backward()
    assert all(relative_error(p.grad, q.grad) <= 1e-10
               for p, q in zip(model.parameters(), eager.parameters()))
