"""A symbolic dim at size 1: its own step, compiled once (``variants.for_size_one``).

torch.export takes a symbolic size to be 2 or more, and so do mbcompile's rules
(``squeeze()`` is specialised to the dims of size 1 at the example). Found by a hunt,
each silent or a crash before:

- a branch on ``T > 1`` under export ran its ``T > 1`` side at T=1 (loss 3.9327 against
  eager's 3.6868; a gradient where eager's is None);
- ``squeeze()`` kept a length of 1 (scores (4, 1) against eager's (4,), the loss 1.1530
  against 1.3881);
- an example of length 1 made every other length fail (export cannot make a dim of size
  1 symbolic), with an error that blamed the batch dim.

Each call is compared with eager's: the loss, the outputs' shapes and values, every
``.grad`` (None too).
"""

from __future__ import annotations

import copy
import warnings
from typing import Any

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

import mbcompile

DTYPE = torch.float64
GBS, NUM_CSX, MBS, VOCAB, WIDTH = 4, 2, 1, 20, 8
TOL = 1e-12


class Branches(nn.Module):
    """Mixes tokens only when there is more than one (fx cannot trace the branch)."""

    def __init__(self) -> None:
        super().__init__()
        self.emb, self.mix = nn.Embedding(VOCAB, WIDTH), nn.Linear(WIDTH, WIDTH)
        self.head = nn.Linear(WIDTH, VOCAB)

    def forward(self, ids: torch.Tensor, labels: torch.Tensor) -> tuple[torch.Tensor, ...]:
        h = self.emb(ids)
        if ids.shape[1] > 1:
            h = h + self.mix(h).cumsum(1)
        logits = self.head(h)
        return F.cross_entropy(logits.flatten(0, 1), labels.flatten()), logits


class Squeezed(nn.Module):
    """Per-token scores written with ``squeeze()``, which drops a length of 1 too."""

    def __init__(self) -> None:
        super().__init__()
        self.emb, self.att = nn.Embedding(VOCAB, WIDTH), nn.Linear(WIDTH, 1)
        self.head = nn.Linear(WIDTH, VOCAB)

    def forward(self, ids: torch.Tensor, labels: torch.Tensor) -> tuple[torch.Tensor, ...]:
        h = self.emb(ids)
        scores = self.att(h).squeeze()
        logits = self.head(h * torch.sigmoid(scores).reshape(ids.shape[0], -1, 1))
        return F.cross_entropy(logits.flatten(0, 1), labels.flatten()), scores


def _batch(length: int, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return (torch.randint(0, VOCAB, (GBS, length), generator=g),
            torch.randint(0, VOCAB, (GBS, length), generator=g))


def _compared(make: type, example: int, lengths: tuple[int, ...], **options: Any) -> list[str]:
    """Compile ``make()`` at the ``example`` length, call it at each of ``lengths``, each
    call compared with eager's; the warnings the calls raised."""
    torch.manual_seed(0)
    model = make().to(DTYPE)
    eager = copy.deepcopy(model)
    cm = mbcompile.compile(model, GBS, NUM_CSX, MBS, example_inputs=_batch(example, 0),
                           cost_model=False, **options)
    said = []
    for length in lengths:
        data = _batch(length, length)
        for m in (model, eager):
            m.zero_grad(set_to_none=True)
        with warnings.catch_warnings(record=True) as seen:
            warnings.simplefilter("always")
            got = cm(*data)
        want = eager(*data)
        said += [str(w.message) for w in seen if issubclass(w.category, mbcompile.RecompileWarning)]
        for a, b in zip(got, want):
            assert a.shape == b.shape, (length, a.shape, b.shape)
            assert torch.allclose(a, b, rtol=TOL, atol=TOL), length
        got[0].backward()
        want[0].backward()
        for (name, p), q in zip(model.named_parameters(), eager.parameters()):
            assert (p.grad is None) == (q.grad is None), (length, name)
            if q.grad is not None:
                assert torch.allclose(p.grad, q.grad, rtol=TOL, atol=TOL), (length, name)
    return said


@pytest.mark.parametrize("dynamic", ["auto", True, {"ids": {1: (1, 16)}, "labels": {1: (1, 16)}}],
                         ids=["auto", "true", "bounds-from-1"])
def test_a_branch_that_sets_length_one_apart_is_eagers_at_length_one(dynamic: Any) -> None:
    said = _compared(Branches, 6, (5, 1, 3, 1), dynamic=dynamic)
    assert sum("size 1" in w for w in said) == 1, said  # compiled once for it


@pytest.mark.parametrize("capture", ["fx", "export"])
def test_squeeze_of_a_varying_length_of_one_is_eagers(capture: str) -> None:
    _compared(Squeezed, 6, (5, 1, 7), capture=capture)


@pytest.mark.parametrize("dynamic", ["auto", True])
def test_an_example_of_length_one_compiles_every_other_length(dynamic: Any) -> None:
    _compared(Branches, 1, (1, 6, 3, 1), dynamic=dynamic)


def test_export_refusal_says_what_its_first_line_introduces() -> None:
    from mbcompile.passes.export_errors import export_error

    exc = ValueError("Found the following conflicts between user-specified ranges and "
                     "inferred ranges from model tracing:\n- Received user-specified dim hint "
                     "Dim.DYNAMIC, but export 0/1 specialized due to hint of 1 for dimension "
                     "inputs['ids'].shape[1].")
    assert "0/1 specialized" in str(export_error(Branches(), exc, None))
