"""``len(x)`` of a batched tensor reads the batch size as ``x.size(0)`` does (issue 25, item 9).

Python's ``len()`` must return an int, so torch.export's Python-level trace turns
``len(x)`` into the example's batch size and refuses the specialised batch dim.
transformers' contrastive losses build their targets that way
(``cross_entropy(logits, torch.arange(len(logits)))``: CLIP, ALIGN, OWL-ViT, ...).
The capture then traces with TorchDynamo, which keeps ``len(x)`` symbolic, and the
batch analysis decides as for ``x.size(0)``: a shape is kept, a coupled loss runs at
the full batch in a two-phase step, a value in per-sample work runs there too (or is
refused with ``coupling="reject"``); a literal batch size stays refused.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F
from models import grads_of, rel_err

import mbcompile
from mbcompile import CaptureError, MixingError


class _Net(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.lin = nn.Linear(4, 3)

    # **kwargs: captured by torch.export, as transformers models are
    def forward(self, x: torch.Tensor, y: torch.Tensor, **kwargs):
        return self.loss(self.lin(x), y)


class Contrastive(_Net):
    def loss(self, h, y):
        e = F.normalize(h, dim=-1)
        logits = e @ e.T
        return F.cross_entropy(logits, torch.arange(len(logits)))


class LenShape(_Net):
    def loss(self, h, y):
        return F.cross_entropy(h.reshape(len(h), -1), y)


class LenDivides(_Net):
    def loss(self, h, y):
        return F.cross_entropy(h, y, reduction="sum") / len(h)


class LenValue(_Net):
    def loss(self, h, y):
        return F.cross_entropy(h * len(h), y)


class LiteralView(_Net):
    def loss(self, h, y):
        return F.cross_entropy(h.view(7, -1), y)


class LenLoop(_Net):
    def loss(self, h, y):
        return sum(F.cross_entropy(h[i:i + 1], y[i:i + 1]) for i in range(len(h)))


def _batch():
    g = torch.Generator().manual_seed(0)
    return (torch.randn(7, 4, generator=g, dtype=torch.float64),
            torch.randint(0, 3, (7,), generator=g))


def _matches(model: nn.Module, cm, inputs, **call) -> None:
    model.zero_grad()
    want_loss = model(*inputs, **call)
    want_loss.backward()
    want = grads_of(model)
    model.zero_grad()
    got_loss = cm(*inputs, **call)
    got_loss.backward()
    got = grads_of(model)
    assert rel_err(got_loss.detach(), want_loss.detach()) <= 1e-14
    assert set(got) == set(want)
    for name in want:
        assert rel_err(got[name], want[name]) <= 1e-13, name


@pytest.mark.parametrize("cls,two_phase", [(Contrastive, True), (LenShape, False),
                                           (LenDivides, False), (LenValue, True)])
def test_len_reads_the_batch_size_as_size(cls, two_phase):
    model, inputs = cls().double(), _batch()
    cm = mbcompile.compile(model, 7, 2, 2, example_inputs=inputs)
    assert ("two-phase step" in cm.plan.reason) == two_phase
    _matches(model, cm, inputs)


def test_len_as_a_per_sample_value_is_refused_without_two_phase():
    with pytest.raises(MixingError, match=r"uses the batch size \(x.size\(0\), len\(x\)\)"):
        mbcompile.compile(LenValue().double(), 7, 2, 2, example_inputs=_batch(),
                          coupling="reject")


@pytest.mark.parametrize("cls", [LiteralView, LenLoop])
def test_a_batch_size_baked_into_the_code_is_still_refused(cls):
    with pytest.raises(CaptureError, match="only works for a batch of 7"):
        mbcompile.compile(cls().double(), 7, 2, 2, example_inputs=_batch())
    with pytest.raises(CaptureError, match=r"only works for a batch of 7.*loop over the "
                       r"samples.*capture='fx' names the line"):  # (export names no line)
        mbcompile.compile(cls().double(), 7, 2, 2, example_inputs=_batch(), capture="export")


@pytest.mark.slow
def test_transformers_clip_model_with_its_loss_matches_eager():
    transformers = pytest.importorskip("transformers")
    text = dict(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                num_attention_heads=4, max_position_embeddings=16, projection_dim=16,
                pad_token_id=0, bos_token_id=1, eos_token_id=2)
    vision = dict(hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                  num_attention_heads=4, image_size=8, patch_size=4, projection_dim=16)
    config = transformers.CLIPConfig(text_config=text, vision_config=vision, projection_dim=16)
    torch.manual_seed(0)
    model = transformers.CLIPModel(config).double().train()
    g = torch.Generator().manual_seed(1)
    lengths = torch.tensor([6, 4, 2, 6, 1, 5, 3])
    mask = (torch.arange(6)[None] < lengths[:, None]).long()
    ids = torch.randint(3, 64, (7, 6), generator=g).masked_fill(mask == 0, 0)
    batch = dict(input_ids=ids, attention_mask=mask, return_loss=True,
                 pixel_values=torch.randn(7, 3, 8, 8, generator=g, dtype=torch.float64))
    cm = mbcompile.compile(model, 7, 2, 2, example_kwargs=batch)
    assert "two-phase step" in cm.plan.reason
    model.zero_grad()
    want_out = model(**batch)
    want_out.loss.backward()
    want = grads_of(model)
    model.zero_grad()
    got_out = cm(**batch)
    got_out.loss.backward()
    got = grads_of(model)
    assert rel_err(got_out.loss.detach(), want_out.loss.detach()) <= 1e-14
    for key in ("logits_per_image", "logits_per_text", "text_embeds", "image_embeds"):
        assert rel_err(got_out[key].detach(), want_out[key].detach()) <= 1e-13, key
    assert set(got) == set(want)
    scale = max(g.abs().max().item() for g in want.values())
    for name in want:
        assert rel_err(got[name], want[name], floor=scale) <= 1e-13, name


class ChunkedPair(nn.Module):
    """A reward model scoring a concatenated pair in one call, then cutting it in two."""

    def __init__(self) -> None:
        super().__init__()
        self.score = nn.Linear(5, 1)

    def forward(self, chosen: torch.Tensor, rejected: torch.Tensor) -> torch.Tensor:
        good, bad = self.score(torch.cat([chosen, rejected])).chunk(2)
        return -F.logsigmoid(good - bad).mean()


def test_a_batch_cut_by_chunk_is_refused_with_exports_guard_and_the_fix():
    """torch.export's own reason (a guard only some batch sizes meet) was dropped for a
    generic 'remove data-dependent Python' (found by a hunt)."""
    x = torch.randn(7, 5, dtype=torch.float64)
    with pytest.raises(CaptureError, match=r"(?s)guard on them:.*== 2.*x\.chunk\(2\).*r\[:B\]"):
        mbcompile.compile(ChunkedPair().double(), 7, 2, 2, example_inputs=(x, x + 1),
                          capture="export")


class PerSampleVmap(nn.Module):
    """A per-sample layer written with torch.func.vmap inside forward."""

    def __init__(self) -> None:
        super().__init__()
        self.out = nn.Linear(5, 3)

    def forward(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        return F.cross_entropy(torch.func.vmap(self.out)(x), y)


@pytest.mark.parametrize("capture", ["auto", "export"])
def test_vmap_in_forward_is_refused_naming_it_and_the_batched_form(capture):
    """It was blamed on shapes that depend on tensor values (found by a hunt)."""
    x, y = torch.randn(7, 5, dtype=torch.float64), torch.randint(0, 3, (7,))
    with pytest.raises(mbcompile.MbcompileError, match=r"(?s)torch\.func\.vmap inside forward"
                       r".*the batched form"):
        mbcompile.compile(PerSampleVmap().double(), 7, 2, 2, example_inputs=(x, y),
                          capture=capture)
