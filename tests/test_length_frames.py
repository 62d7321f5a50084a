"""A call's split under ``mbs="auto"`` and a memory budget, where its batch or lengths are
not the example's: a variant reads the length model in the model's frame, each symbolic
dim apart, and a forward-only call is never refused by the training step's memory.

Oracles: a compile for the call's own batch and lengths (probed exactly there), and eager.
"""

from __future__ import annotations

import copy
import warnings

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

import mbcompile
from mbcompile.planning.systems import SystemSpec

V, D = 64, 32


def _budget(memory: float) -> SystemSpec:
    return SystemSpec("budget", memory_bytes=memory, peak_flops=1e12, peak_flops_fp32=1e12,
                      memory_bandwidth=1e11, optimizer_bytes_per_param=8)


class EncDec(nn.Module):
    """Attention over an encoder length S, a decoder length T and across: two symbolic dims
    whose memory grows apart."""

    def __init__(self) -> None:
        super().__init__()
        self.emb, self.q, self.k = nn.Embedding(V, D), nn.Linear(D, D), nn.Linear(D, D)
        self.head = nn.Linear(D, V)

    def forward(self, src: torch.Tensor, tgt: torch.Tensor, labels: torch.Tensor
                ) -> torch.Tensor:
        e = self.emb(src)
        e = torch.softmax(self.q(e) @ self.k(e).transpose(1, 2), -1) @ e
        d = self.emb(tgt)
        d = torch.softmax(self.q(d) @ self.k(d).transpose(1, 2), -1) @ d
        d = torch.softmax(self.q(d) @ self.k(e).transpose(1, 2), -1) @ e
        return F.cross_entropy(self.head(d).flatten(0, 1), labels.flatten())


def _encdec_batch(b: int, s: int, t: int) -> tuple[torch.Tensor, ...]:
    g = torch.Generator().manual_seed(b * 1000 + s * 10 + t)
    return (torch.randint(0, V, (b, s), generator=g), torch.randint(0, V, (b, t), generator=g),
            torch.randint(0, V, (b, t), generator=g))


def test_a_short_batch_with_two_lengths_reads_the_length_model_in_its_frame():
    """Example (S, T) = (40, 10), gbs 8; a short batch of 5 first seen at (40, 40) ran mbs 5
    (its call read as no longer than its own example: the model read at T = 10), where a
    compile for it at (40, 40) fits mbs 3 at most (mbs 5 needs 611 of 450 kB)."""
    budget = _budget(4.5e5)
    dyn = {n: {1: (2, 256)} for n in ("src", "tgt", "labels")}
    torch.manual_seed(0)
    model = EncDec()
    cm = mbcompile.compile(model, 8, 1, "auto", system=budget, dynamic=dyn,
                           example_inputs=_encdec_batch(8, 40, 10))
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        cm(*_encdec_batch(8, 40, 10)).backward()
        call = _encdec_batch(5, 40, 40)
        cm(*call).backward()
        fresh = mbcompile.compile(copy.deepcopy(model), 5, 1, "auto", system=budget,
                                  dynamic=dyn, example_inputs=call)
    assert fresh.plan.mbs < 5
    assert cm.plan.gbs == 5 and cm.plan.mbs <= fresh.plan.mbs


class Attending(nn.Module):
    """Dropout and attention over the length: memory quadratic in it."""

    def __init__(self) -> None:
        super().__init__()
        self.emb, self.drop = nn.Embedding(V, D), nn.Dropout(0.5)
        self.q, self.head = nn.Linear(D, D), nn.Linear(D, V)

    def forward(self, ids: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        h = self.drop(self.emb(ids))
        a = torch.softmax(self.q(h) @ h.transpose(1, 2) / 8, -1) @ h
        return F.cross_entropy(self.head(a).flatten(0, 1), labels.flatten())


def _batch(b: int, length: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(100 * b + length)
    return torch.randint(0, V, (b, length), generator=g), torch.randint(0, V, (b, length),
                                                                         generator=g)


@pytest.mark.parametrize("how", ["eval", "no_grad"])
def test_a_forward_only_call_too_long_for_the_training_step_runs_as_eager(how):
    """A budget the training step fits only at short lengths: forward-only calls (eval mode,
    or ``no_grad``) of every batch size at lengths where no training split fits run, at
    the least MBS, and return eager's loss (they were refused with the training step's
    peak: 420 of 300 kB, of which 205 kB saved for a backward that never comes)."""
    torch.manual_seed(0)
    model = Attending()
    ref = copy.deepcopy(model)
    dyn = {"ids": {1: (1, 256)}, "labels": {1: (1, 256)}}
    cm = mbcompile.compile(model, 8, 2, "auto", system=_budget(3e5), dynamic=dyn,
                           example_inputs=_batch(8, 12))
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        cm(*_batch(8, 12)).backward()
        with pytest.raises(mbcompile.DoesNotFitError):  # training at 150 does not fit
            cm(*_batch(8, 150))
        if how == "eval":
            model.eval()
            ref.eval()
        with torch.no_grad():
            for b in (8, 5, 1):
                for length in (90, 150):
                    x = _batch(b, length)
                    want = ref(*x) if how == "eval" else None
                    got = cm(*x)
                    assert cm.plan.gbs == b and cm.plan.mbs == 1, (b, length)
                    if want is not None:  # dropout off: eager's value (no_grad: drawn)
                        assert torch.allclose(got, want, rtol=1e-5, atol=0), (b, length)
