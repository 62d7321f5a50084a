"""Embedding settings whose effect reaches past the rows each sample looks up: exact or refused.

Both were split silently before (a hunt of autograd building blocks, findings 2 and 6):

- ``scale_grad_by_freq=True`` (``nn.Embedding``, ``F.embedding``, ``aten.embedding``,
  ``nn.EmbeddingBag``): backward divides each row's gradient by its index's count in the
  batch, and each microbatch counted only its own ids (the table's gradient was off by a
  relative 1). The lookup now couples samples: it runs on the whole batch in a two-phase
  step, or is refused with ``coupling="reject"``.
- ``max_norm`` with the table read elsewhere too (a tied head ``F.linear(h, emb.weight)``):
  the lookup renormalises its rows in place, and eager's head reads them after the whole
  batch's rows were renormalised, each microbatch's after its own (loss 2.81 vs 2.39). Now
  a two-phase step, or refused where a read does not follow from the lookup's output.

What splits exactly stays split: ``max_norm`` alone, ``scale_grad_by_freq=False``,
``padding_idx``. Every comparison is float64 against a deep copy made before compile, on
the uneven plan gbs 7 over 2 systems at mbs 2 (microbatches 2, 2 | 2, 1), over two steps.
"""

from __future__ import annotations

import copy
import warnings
from collections.abc import Callable
from typing import Any

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F
from models import TOL, plan_free, rel_err

import mbcompile
from mbcompile import MixingError

pytestmark = pytest.mark.usefixtures("float64_default")  # conftest.py

GBS, NUM_CSX, MBS = 7, 2, 2
VOCAB, D, CLASSES, T = 10, 4, 3, 5
HERE = r"\S*test_embedding_flags\.py:\d+"  # the user's line, in every refusal


def batch(seed: int = 1) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(ids, x, y): 35 ids over a vocabulary of 10, so rows repeat within the batch."""
    g = torch.Generator().manual_seed(seed)
    return (torch.randint(0, VOCAB, (GBS, T), generator=g),
            torch.randn(GBS, D, generator=g), torch.randint(0, CLASSES, (GBS,), generator=g))


class Lookup(nn.Module):
    """One spelling of the lookup, pooled per sample, then a classifier."""

    def __init__(self, kind: str, **flags: Any) -> None:
        super().__init__()
        self.kind, self.flags = kind, flags
        if kind == "module":
            self.e = nn.Embedding(VOCAB, D, **flags)
        elif kind == "bag":
            self.e = nn.EmbeddingBag(VOCAB, D, mode="sum", **flags)
        else:
            self.w = nn.Parameter(torch.randn(VOCAB, D))
        self.o = nn.Linear(D, CLASSES)
        with torch.no_grad():
            for p in (self.e.weight if hasattr(self, "e") else self.w,):
                p.mul_(3)  # rows with norms above max_norm

    def forward(self, ids: torch.Tensor, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        if self.kind == "module":
            h = self.e(ids).mean(1)
        elif self.kind == "bag":
            h = self.e(ids)
        elif self.kind == "functional":
            h = F.embedding(ids, self.w, **self.flags).mean(1)
        else:  # aten.embedding(weight, ids, padding_idx, scale_grad_by_freq)
            by_freq = self.flags.get("scale_grad_by_freq", False)
            h = torch.ops.aten.embedding(self.w, ids, -1, by_freq).mean(1)
        return F.cross_entropy(self.o(h + x), y)


class Tied(nn.Module):
    """``nn.Embedding(max_norm=1)`` whose table another node reads too (``how``)."""

    def __init__(self, how: str) -> None:
        super().__init__()
        self.how = how
        self.e = nn.Embedding(VOCAB, D, max_norm=1.0)
        self.l, self.a = nn.Linear(D, D), nn.Linear(D, D)
        self.head = nn.Linear(D, VOCAB, bias=False)
        with torch.no_grad():
            self.e.weight.mul_(3)
        if how == "shared":
            self.head.weight = self.e.weight  # tied as Hugging Face ties lm_head

    def forward(self, ids: torch.Tensor, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        if self.how == "functional":
            h = self.l(F.embedding(ids, self.e.weight, max_norm=1.0).mean(1))
            return F.cross_entropy(F.linear(h, self.e.weight), y % VOCAB)
        h = self.l(self.e(ids).mean(1))
        if self.how == "linear":
            logits = F.linear(h, self.e.weight)
        elif self.how == "shared":
            logits = self.head(h)
        elif self.how == "twice":  # the same layer again: it reads only rows it renormalises
            logits = self.head(h + self.e(ids.flip(1))[:, 0])
        elif self.how == "early":  # a read that does not follow from the lookup's output
            logits = F.linear(h, self.head.weight) + F.linear(self.a(x), self.e.weight)
        else:  # "penalty": a batch-free read of the table
            return F.cross_entropy(self.head(h), y % VOCAB) + self.e.weight.pow(2).sum()
        return F.cross_entropy(logits, y % VOCAB)


def compile_quietly(model: nn.Module, plan: tuple[int, int, Any] = (GBS, NUM_CSX, MBS),
                    **options: Any) -> Any:
    gbs, num_csx, mbs = plan
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # TwoPhaseWarning: the coupled part is most of it
        return mbcompile.compile(model, gbs, num_csx, mbs, example_inputs=batch(),
                                 **plan_free(mbs, **options))


def assert_steps_match_eager(make: Callable[[], nn.Module], plan: tuple[int, int, Any] = (
        GBS, NUM_CSX, MBS), **options: Any) -> Any:
    """Two SGD steps of the compiled model equal two of a deep copy taken before compile:
    the loss, every gradient, every parameter after the step (``max_norm`` writes rows)."""
    torch.manual_seed(0)
    model = make()
    ref = copy.deepcopy(model)
    cm = compile_quietly(model, plan, **options)
    opts = [torch.optim.SGD(m.parameters(), lr=0.5) for m in (model, ref)]
    for seed in (1, 2):
        inputs = batch(seed)
        got, want = cm(*inputs), ref(*inputs)
        got.backward()
        want.backward()
        assert rel_err(got.detach(), want.detach()) <= TOL, (seed, got.item(), want.item())
        for (name, p), q in zip(model.named_parameters(), ref.parameters()):
            assert (p.grad is None) == (q.grad is None), (seed, name)
            if q.grad is not None:
                assert rel_err(p.grad, q.grad) <= TOL, (seed, name, rel_err(p.grad, q.grad))
            assert rel_err(p.detach(), q.detach()) <= TOL, (seed, name)
        for opt in opts:
            opt.step()
            opt.zero_grad(set_to_none=True)
    return cm


def assert_refused_unchanged(model: nn.Module, match: str, **options: Any) -> None:
    """``compile`` raises ``MixingError`` matching ``match`` and leaves the model as it was."""
    state = copy.deepcopy(model.state_dict())
    with pytest.raises(MixingError, match=match):
        compile_quietly(model, **options)
    assert all(torch.equal(v, state[k]) for k, v in model.state_dict().items())
    assert all(p.grad is None for p in model.parameters())


# ------------------------------------------------------------- scale_grad_by_freq=True

BY_FREQ = [("module", "fx"), ("module", "export"), ("functional", "fx"),
           ("functional", "export"), ("aten", "fx"), ("aten", "export"), ("bag", "fx"),
           ("bag", "export")]


@pytest.mark.parametrize("kind,capture", BY_FREQ)
def test_scale_grad_by_freq_runs_as_the_full_batch(kind: str, capture: str) -> None:
    cm = assert_steps_match_eager(lambda: Lookup(kind, scale_grad_by_freq=True),
                                  capture=capture)
    assert cm.analysis.two_phase


# export's EmbeddingBag flattens the (B, L) ids with an arange of the batch: coupled there first
@pytest.mark.parametrize("kind,capture", [c for c in BY_FREQ if c != ("bag", "export")])
def test_scale_grad_by_freq_refused_when_coupling_is_rejected(kind: str, capture: str) -> None:
    torch.manual_seed(0)
    layer = r"(?=.*(?:\(module 'e'\)|\(layer 'e'\)))" if kind in ("module", "bag") else ""
    assert_refused_unchanged(
        Lookup(kind, scale_grad_by_freq=True),
        rf"(?s){layer}.*at {HERE}.*scale_grad_by_freq=True: backward divides each row's "
        r"gradient by how often its index occurs in the whole batch.*fix:.*"
        r"scale_grad_by_freq=False.*mbs='none'", capture=capture, coupling="reject")


@pytest.mark.parametrize("capture", ["fx", "export"])
def test_scale_grad_by_freq_runs_unsplit_when_asked(capture: str) -> None:
    """The refusal's last fix: one system, one microbatch."""
    cm = assert_steps_match_eager(lambda: Lookup("module", scale_grad_by_freq=True),
                                  plan=(GBS, 1, "none"), capture=capture, coupling="reject")
    assert cm.plan.num_microbatches == 1


# ------------------------------------------------------------------ exact when split

SPLIT = [("module", {"padding_idx": 0}, "fx"), ("module", {"padding_idx": 0}, "export"),
         ("functional", {"padding_idx": 0}, "fx"), ("bag", {"padding_idx": 0}, "fx"),
         ("module", {"scale_grad_by_freq": False}, "fx"),
         ("module", {"scale_grad_by_freq": False}, "export"),
         ("aten", {"scale_grad_by_freq": False}, "export"),
         ("module", {"max_norm": 1.0}, "fx"), ("functional", {"max_norm": 1.0}, "fx"),
         ("bag", {"max_norm": 1.0}, "fx")]


@pytest.mark.parametrize("kind,flags,capture", SPLIT)
def test_settings_that_keep_samples_apart_are_split(kind: str, flags: dict[str, Any],
                                                    capture: str) -> None:
    cm = assert_steps_match_eager(lambda: Lookup(kind, **flags), capture=capture)
    assert not cm.analysis.two_phase and cm.analysis.rejected is None


def test_setting_scale_grad_by_freq_after_compile_compiles_again() -> None:
    """The rule read the layer's setting: it is guarded, as a loss's reduction is."""
    torch.manual_seed(0)
    model = Lookup("module")
    cm = compile_quietly(model, capture="fx")
    assert not cm.analysis.two_phase
    model.e.scale_grad_by_freq = True
    ref = copy.deepcopy(model)
    inputs = batch(2)
    with pytest.warns(mbcompile.RecompileWarning, match="scale_grad_by_freq"):
        got = cm(*inputs)
    got.backward()
    ref(*inputs).backward()
    assert cm.analysis.two_phase
    assert rel_err(model.e.weight.grad, ref.e.weight.grad) <= TOL


def test_max_norm_on_the_same_layer_called_twice_is_split() -> None:
    """A second call reads only rows it renormalises itself, as eager's does."""
    cm = assert_steps_match_eager(lambda: Tied("twice"), capture="fx")
    assert not cm.analysis.two_phase


# ------------------------------------------------------------ max_norm with a tied table

@pytest.mark.parametrize("how", ["linear", "shared", "functional"])
def test_max_norm_with_a_tied_head_runs_as_the_full_batch(how: str) -> None:
    cm = assert_steps_match_eager(lambda: Tied(how), capture="fx")
    assert cm.analysis.two_phase


@pytest.mark.parametrize("how", ["linear", "shared"])
def test_max_norm_with_a_tied_head_refused_when_coupling_is_rejected(how: str) -> None:
    torch.manual_seed(0)
    assert_refused_unchanged(
        Tied(how), rf"(?s)\(module 'e'\).*at {HERE}.*max_norm=1.0: it renormalises the rows "
        r"it looks up in place, in its weight, which '\w+' also reads.*a microbatch only the "
        r"rows looked up so far.*fix:.*max_norm=None.*mbs='none'",
        capture="fx", coupling="reject")


@pytest.mark.parametrize("how,reader", [
    pytest.param("early", r"F\.linear\(self\.a\(x\), self\.e\.weight\)", id="early"),
    pytest.param("penalty", r"self\.e\.weight\.pow\(2\)\.sum\(\)", id="penalty")])
def test_max_norm_read_before_the_lookup_is_refused(how: str, reader: str) -> None:
    """A read of the table not computed from the lookup's output would run before it even
    in a two-phase step: refused with the default coupling, naming both lines."""
    torch.manual_seed(0)
    assert_refused_unchanged(
        Tied(how), rf"(?s)torch\.nn\.Embedding \(module 'e'\) at node 'e' cannot be "
        rf"microbatched\n  at {HERE}: h = self\.l\(self\.e\(ids\).*max_norm=1.0.*"
        rf"at {HERE}: .*{reader} is not computed from its output.*fix:.*max_norm=None.*"
        r"mbs='none'", capture="fx")


def test_max_norm_read_before_the_lookup_runs_unsplit_when_asked() -> None:
    cm = assert_steps_match_eager(lambda: Tied("early"), plan=(GBS, 1, "none"), capture="fx")
    assert cm.plan.num_microbatches == 1


def test_max_norm_is_still_refused_by_export() -> None:
    torch.manual_seed(0)
    model = Tied("linear")
    with pytest.raises(mbcompile.CaptureError, match=r"Embedding 'e' has max_norm=1.0"):
        compile_quietly(model, capture="export")
    assert all(p.grad is None for p in model.parameters())
