"""Functional writes: what functionalization makes of ``x[...] = y`` (issue 12, item 1).

torch.export's functionalization turns ``x[:, 1:] = y`` into ``slice_scatter(x,
copy(x[:, 1:], y), 1, 1)``, ``x[:, 0] = v`` into ``select_scatter``, ``x.diagonal()
.copy_(y)`` into ``diagonal_scatter`` and ``x[mask] = v`` into ``index_put``; the
capture spells ``copy`` as ``clone(expand_as(_to_copy(y), x))``, which autograd can
differentiate. Each pattern compiles with coupling="reject" (so nothing runs as a
two-phase step: the rules alone prove it per-sample) and equals eager in float64, on
tests/catalogue.py's inputs and plan.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import pytest
import torch
from catalogue import GBS, HID, Entry, T, batch, check_exact, compile_pattern

from mbcompile import MixingError
from mbcompile.passes.batch_analysis import analyse_batch
from mbcompile.passes.facts import FACT, Batched, Free
from mbcompile.passes.shape_prop import propagate_shapes


def _w_shift_tokens_right(s, x, mask, y, tok, img):
    """transformers' shift_tokens_right (BART, T5): a new_zeros of the batch's shape."""
    ids = tok.masked_fill(tok == -100, 0)
    shifted = ids.new_zeros(ids.shape)
    shifted[:, 1:] = ids[:, :-1].clone()  # slice_scatter along dim 1
    shifted[:, 0] = 2  # select_scatter along dim 1
    shifted.masked_fill_(shifted == -100, 0)
    return torch.tanh(s.lin(x)) * (shifted.unsqueeze(-1) + 1)


def _w_copy_broadcast(s, x, mask, y, tok, img):
    """copy_ of a (B, 1, H) value that needs grad into a (B, T, H) buffer: a broadcast."""
    h = s.lin(x).mean(1, keepdim=True)
    out = h.new_zeros(h.size(0), T, HID)
    out.copy_(h)
    return out * mask.unsqueeze(-1)


def _w_whole_batch_slice(s, x, mask, y, tok, img):
    """out[:] = h: a slice_scatter along the batch dim that keeps every sample."""
    h = s.lin(x)
    out = torch.zeros_like(h)
    out[:] = torch.tanh(h)
    return out


def _w_diagonal(s, x, mask, y, tok, img):
    """A per-sample diagonal matrix written through x.diagonal(): diagonal_scatter."""
    h = s.lin(x).mean(1)
    m = h.new_zeros(h.size(0), HID, HID)
    m.diagonal(dim1=1, dim2=2).copy_(torch.tanh(h))
    return m @ s.lin.weight


def _w_mask_write(s, x, mask, y, tok, img):
    """h[mask == 0] = 0.5 with a per-sample (B, T) mask: index_put."""
    h = torch.tanh(s.lin(x)).clone()  # tanh's backward reads its own output
    h[mask == 0] = 0.5
    return h


def _w_int_into_float(s, x, mask, y, tok, img):
    """An int mask written into a float column: the copy converts the dtype."""
    out = torch.tanh(s.lin(x)).clone()
    out[..., 0] = mask
    return out


WRITES: dict[str, tuple[Callable[..., Any], tuple[str, ...]]] = {
    "shift-tokens-right": (_w_shift_tokens_right, ("slice_scatter", "select_scatter")),
    "copy-broadcast": (_w_copy_broadcast, ("expand_as",)),
    "whole-batch-slice": (_w_whole_batch_slice, ("slice_scatter",)),
    "diagonal": (_w_diagonal, ("diagonal_scatter",)),
    "mask-write": (_w_mask_write, ("index_put",)),
    "int-into-float": (_w_int_into_float, ("select_scatter", "_to_copy")),
}


def _aten_ops(gm: torch.fx.GraphModule) -> list[str]:
    return [str(n.target).split(".")[1] for n in gm.graph.nodes
            if n.op == "call_function" and str(n.target).startswith("aten.")]


@pytest.mark.parametrize("name", WRITES)
def test_functional_write_is_per_sample_and_exact(name: str) -> None:
    fn, ops = WRITES[name]
    cm = check_exact(Entry(fn), "export", coupling="reject")
    assert cm.plan.per_system_batch_sizes == (3, 3) and cm.plan.mbs == 2  # 2 + 1 each
    found = _aten_ops(cm.original_graph_module)
    assert set(ops) <= set(found), found
    assert "copy" not in found  # ATen's copy has no derivative: the capture respells it


def test_whole_batch_slice_write_is_along_the_batch_dim() -> None:
    """The accepted out[:] = h really scatters along dim 0, the batch dim, whole."""
    cm = compile_pattern(Entry(_w_whole_batch_slice).build(), batch(), "export", "reject")
    (node,) = [n for n in cm.original_graph_module.graph.nodes
               if n.target is torch.ops.aten.slice_scatter.default]
    assert node.args[2:3] in ((), (0,)) and node.meta[FACT] == Batched(0)


def _r_masked_scatter(s, x, mask, y, tok, img):
    h = s.lin(x)
    return h.masked_scatter(mask.bool().unsqueeze(-1), h * 2)  # offending


def _r_interleaved_rows_written(s, x, mask, y, tok, img):
    h = s.lin(x)
    out = h.flatten(0, 1).clone()  # (B*T, H) sample-major
    out[:, :2] = h.transpose(0, 1).flatten(0, 1)[:, :2]  # (T*B, 2) time-major rows
    return out.view(x.size(0), T, HID)


WRITE_REJECTS: dict[str, tuple[Callable[..., Any], str, str]] = {
    "masked-scatter": (_r_masked_scatter, "masked_scatter", "in order over the whole batch"),
    "interleaved-rows-written": (_r_interleaved_rows_written, "slice_scatter",
                                 "into another sample's rows"),
}


@pytest.mark.parametrize("name", WRITE_REJECTS)
def test_functional_write_that_mixes_is_rejected_with_its_reason(name: str) -> None:
    fn, op, reason = WRITE_REJECTS[name]
    with pytest.raises(MixingError) as info:
        compile_pattern(Entry(fn).build(), batch(), "export", "reject")
    assert op in info.value.op and reason in str(info.value), str(info.value)


# The writes into rows of the batch dim that a model cannot reach (the slice or select of
# the batch dim that export puts before them is rejected first), on graphs written in ATen.
_ATEN_WRITES: dict[str, tuple[Callable[..., Any], str | None]] = {
    "slice-of-batch": (lambda x, v: torch.ops.aten.slice_scatter.default(x, v[:2], 0, 0, 2),
                       "writes into a slice of the batch dim"),
    "whole-batch-to-maxsize": (
        lambda x, v: torch.ops.aten.slice_scatter.default(x, x * 2, 0, 0, 2 ** 62), None),
    "slice-of-features": (
        lambda x, v: torch.ops.aten.slice_scatter.default(x, x[:, 1:3] * 2, 1, 1, 3), None),
    "row-of-batch": (lambda x, v: torch.ops.aten.select_scatter.default(x, v[0], 0, 0),
                     "writes into row 0 of the batch dim"),
    "column": (lambda x, v: torch.ops.aten.select_scatter.default(x, x[:, 0] * 2, 1, 0), None),
    "diagonal-with-batch": (
        lambda x, v: torch.ops.aten.diagonal_scatter.default(
            x[:, :3, None].expand(-1, 3, 3), v[:3, :3], 0, 0, 1),
        "writes the diagonal of a pair of dims that includes the batch dim"),
    "copy-free-into-batch": (lambda x, v: torch.ops.aten.copy.default(x, v[0]), None),
}


@pytest.mark.parametrize("name", _ATEN_WRITES)
def test_write_rule_on_aten_graph(name: str) -> None:
    """x (B, HID) is batched, v (4, HID) batch-free; None: accepted as per-sample dim 0."""
    fn, reason = _ATEN_WRITES[name]
    gm = torch.fx.symbolic_trace(fn)
    inputs = (torch.randn(GBS, HID, dtype=torch.float64), torch.randn(4, HID,
                                                                      dtype=torch.float64))
    propagate_shapes(gm, inputs, (0, None), GBS)
    x, v = [n for n in gm.graph.nodes if n.op == "placeholder"]
    result = analyse_batch(gm, {x.target: Batched(0), v.target: Free()}, GBS)
    if reason is None:
        assert result.rejected is None, str(result.rejected)
        out = next(n for n in gm.graph.nodes if n.op == "output").args[0]
        assert out.meta[FACT] == Batched(0)
    else:
        assert result.rejected is not None and reason in str(result.rejected), result.rejected
