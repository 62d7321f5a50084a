"""Mixture-of-experts token dispatch: sort the batch's tokens, work per row, unsort.

An MoE layer sorts the flattened tokens of the whole batch by expert id, runs each
expert on its rows and puts the rows back in token order. ``passes/rules/tokens``
proves such a region per-sample (each token's output depends on its own hidden
state and the shared weights); a region that really mixes tokens of different
samples in a similar-looking way is still rejected, at the user's line, with
``coupling="reject"``; by default it runs as a two-phase step equal to eager, as do
the HuggingFace MoE models with their router aux loss (which couples the batch).

The models here are written the way users write MoE layers in plain PyTorch (top-k
routing, ``sort``/``argsort``, gather, per-row experts, several ways back) and
captured by ``torch.fx`` and by ``torch.export``; the HuggingFace MoE language models
(Mixtral, Qwen2-MoE, Qwen3-MoE, OLMoE, GraniteMoE) are the acceptance test.

Precision. Experts written with per-row ops, or with a grouped matmul declared to the
pass (``grouped_mm`` below, the shape of transformers' fallback kernel), run in float64
and match eager to 1e-10. torch's own ``grouped_mm`` has no float64 kernel (float32,
bfloat16, float16) and its shape function, which the fake-tensor probe runs, accepts
only bfloat16: that test runs its experts in bfloat16 (bound 2e-2). The HuggingFace
models run in float32 and are compared at 1e-5 relative error: the microbatches'
matmuls see fewer rows per expert than the full batch's (other blocking, other
summation order) and eager calls ``torch.nn.functional.grouped_mm`` while the exported
graph calls transformers' ``grouped_mm_fallback`` (a loop of ``torch.mm``, what
transformers picks under tracing), so sums round differently at float32 precision
(2^-24 ~ 6e-8 per operation; the observed errors are 1e-7 to 2e-6). Tokens of other
samples leaking in would give errors of order 1.
"""

from __future__ import annotations

import inspect
import warnings
from typing import Any

import pytest
import torch
import torch.fx
import torch.nn as nn
import torch.nn.functional as F
from models import (
    TOL,
    assert_close_errors,
    grad_errors,
    grads_of,
    keyword_steps,
    rel_err,
    step_errors,
)

import mbcompile
from mbcompile import MixingError
from mbcompile.passes.batch_analysis import analyse_batch
from mbcompile.passes.facts import FACT, Batched, Container, input_fact
from mbcompile.passes.rules import (
    GROUPED_MATMULS,
    GroupCounts,
    Permuted,
    TokenIndex,
    Unsort,
)
from mbcompile.passes.shape_prop import propagate_shapes

FLOAT32_TOL = 1e-5
BFLOAT16_TOL = 2e-2  # torch's grouped_mm in bfloat16 (8 bits of mantissa: 2^-8 ~ 4e-3)
GRAD_FLOOR = 1e-4  # see test_hf_models: gradients that are zero up to rounding
GBS, NUM_CSX, MBS = 7, 2, 2  # systems of 4 and 3 samples, microbatches of 2, 2 and 2, 1
T, FEAT, H, FFN, E, K, CLASSES = 4, 5, 16, 16, 4, 2, 3


# --------------------------------------------------------------------------- #
# A grouped matmul in any dtype (torch's has no float64 kernel, and its shape
# function wants bfloat16), declared to the pass the way a user declares a kernel
# --------------------------------------------------------------------------- #


@torch.library.custom_op("mbcompile_tests::grouped_mm", mutates_args=())
def grouped_mm(x: torch.Tensor, w: torch.Tensor, offs: torch.Tensor) -> torch.Tensor:
    """Rows ``offs[g-1]:offs[g]`` of ``x`` times ``w[g]`` (transformers' fallback, in short)."""
    out = x.new_zeros(x.size(0), w.size(-1))
    start = 0
    for g, end in enumerate(offs.tolist()):
        out[start:end] = x[start:end] @ w[g]
        start = end
    return out


@grouped_mm.register_fake
def _(x: torch.Tensor, w: torch.Tensor, offs: torch.Tensor) -> torch.Tensor:
    return x.new_empty(x.size(0), w.size(-1))


def _grouped_mm_setup(ctx: Any, inputs: tuple[Any, ...], output: Any) -> None:
    ctx.save_for_backward(*inputs)


def _grouped_mm_backward(ctx: Any, grad: torch.Tensor) -> tuple[Any, ...]:
    x, w, offs = ctx.saved_tensors
    gx, gw = torch.zeros_like(x), torch.zeros_like(w)
    start = 0
    for g, end in enumerate(offs.tolist()):
        gx[start:end] = grad[start:end] @ w[g].T
        gw[g] = x[start:end].T @ grad[start:end]
        start = end
    return gx, gw, None


grouped_mm.register_autograd(_grouped_mm_backward, setup_context=_grouped_mm_setup)


@pytest.fixture(autouse=True)
def _declared_grouped_mm(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setitem(GROUPED_MATMULS, "mbcompile_tests::grouped_mm",
                        ((0, "x"), (1, "w"), (2, "offs")))


# --------------------------------------------------------------------------- #
# A token-choice top-k MoE layer, with the ways users run experts and undo the sort
# --------------------------------------------------------------------------- #


class MoE(nn.Module):
    """Input projection -> top-k routed experts over the batch's tokens -> classifier.

    ``experts``: "gathered" (each row meets its expert's weights, gathered per row),
    "masked" (a loop over experts, every row through each, kept by a mask of its id),
    "grouped" (a grouped matmul over the runs counted by ``histc``) or "torch-grouped"
    (``F.grouped_mm``, in bfloat16). ``back``: how the sorted rows return to token order.
    """

    def __init__(self, experts: str = "gathered", back: str = "inverse") -> None:
        super().__init__()
        self.experts, self.back = experts, back
        self.inp = nn.Linear(FEAT, H)
        self.gate = nn.Linear(H, E, bias=False)
        self.w_in = nn.Parameter(torch.randn(E, H, FFN) / H ** 0.5)
        self.w_out = nn.Parameter(torch.randn(E, FFN, H) / FFN ** 0.5)
        self.head = nn.Linear(H, CLASSES)

    def forward(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        h = torch.tanh(self.inp(x))  # (B, T, H)
        flat = h.reshape(-1, H)  # the batch's tokens, batch-major
        weights, ids = torch.topk(torch.softmax(self.gate(flat), dim=-1), K, dim=-1)
        weights = weights / weights.sum(-1, keepdim=True)
        ids = ids.reshape(-1)  # one expert id per (token, choice) slot
        ids_sorted, perm = self.sort(ids)  # the slots of the whole batch, grouped by expert
        rows = flat[perm // K]  # each slot's token, in sorted order
        out = self.run(rows, ids_sorted) * weights.reshape(-1)[perm][:, None]
        moe = self.put_back(out, perm, flat)
        logits = self.head((h + moe.view(-1, T, H)).mean(1))
        return self.loss(logits, y, out)

    def sort(self, ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return torch.sort(ids)

    def run(self, rows: torch.Tensor, ids_sorted: torch.Tensor) -> torch.Tensor:
        if self.experts == "gathered":
            a = torch.bmm(rows.unsqueeze(1), self.w_in[ids_sorted])
            return torch.bmm(F.gelu(a), self.w_out[ids_sorted]).squeeze(1)
        if self.experts == "masked":
            out = torch.zeros_like(rows)
            for e in range(E):
                keep = (ids_sorted == e).unsqueeze(-1).to(rows.dtype)
                out = out + keep * (F.gelu(rows @ self.w_in[e]) @ self.w_out[e])
            return out
        offsets = self.offsets(ids_sorted)
        if self.experts == "grouped":
            return grouped_mm(F.gelu(grouped_mm(rows, self.w_in, offsets)), self.w_out, offsets)
        a = F.grouped_mm(rows.bfloat16(), self.w_in.bfloat16(), offs=offsets)
        return F.grouped_mm(F.gelu(a), self.w_out.bfloat16(), offs=offsets).to(rows.dtype)

    def offsets(self, ids_sorted: torch.Tensor) -> torch.Tensor:
        counts = torch.histc(ids_sorted.float(), bins=E, min=0, max=E - 1)
        return torch.cumsum(counts, 0).to(torch.int32)

    def put_back(self, out: torch.Tensor, perm: torch.Tensor, flat: torch.Tensor) -> torch.Tensor:
        if self.back == "inverse":  # inv[perm] = arange(N), transformers' grouped_mm way
            inv = torch.empty_like(perm).index_put((perm,), torch.arange(perm.size(0)))
            return out[inv].view(-1, K, H).sum(1)
        if self.back == "inverse-in-place":
            inv = torch.empty_like(perm).index_put_((perm,), torch.arange(perm.size(0)))
            return out[inv].view(-1, K, H).sum(1)
        if self.back == "argsort":
            return out[perm.argsort()].view(-1, K, H).sum(1)
        if self.back == "scatter-inverse":
            inv = torch.empty_like(perm).scatter(0, perm, torch.arange(perm.size(0)))
            return out.index_select(0, inv).view(-1, K, H).sum(1)
        if self.back == "gather-inverse":
            inv = perm.argsort()[:, None].expand(-1, H)
            return out.gather(0, inv).view(-1, K, H).sum(1)
        if self.back == "index_add":  # Mixtral's per-expert loop writes back this way
            return torch.zeros_like(flat).index_add(0, perm // K, out)
        if self.back == "scatter_add":
            index = (perm // K)[:, None].expand(-1, H)
            return torch.zeros_like(flat).scatter_add(0, index, out)
        raise ValueError(self.back)

    def loss(self, logits: torch.Tensor, y: torch.Tensor, out: torch.Tensor) -> torch.Tensor:
        return F.cross_entropy(logits, y)


class SortedRowPenalty(MoE):
    """A mean over the sorted rows is a mean over the batch's slots, whatever their order."""

    def loss(self, logits: torch.Tensor, y: torch.Tensor, out: torch.Tensor) -> torch.Tensor:
        return F.cross_entropy(logits, y) + 0.1 * out.pow(2).mean()


def batch(dtype: torch.dtype, seed: int = 1) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return (torch.randn(GBS, T, FEAT, generator=g, dtype=dtype),
            torch.randint(0, CLASSES, (GBS,), generator=g))


def build(cls: type[nn.Module], dtype: torch.dtype = torch.float64, **kw: Any) -> nn.Module:
    torch.manual_seed(0)
    return cls(**kw).to(dtype)


def step(model: nn.Module, cm: Any, *args: Any) -> tuple[float, dict[str, float]]:
    """Loss and gradient errors of one compiled step against the eager full batch."""
    model.zero_grad(set_to_none=True)
    got = cm(*args)
    got.backward()
    grads = grads_of(model)
    model.zero_grad(set_to_none=True)
    want = model(*args)
    want.backward()
    return rel_err(got, want), grad_errors(grads, grads_of(model), GRAD_FLOOR)


EXACT = [
    pytest.param("gathered", "inverse", id="gathered-inverse"),
    pytest.param("gathered", "inverse-in-place", id="gathered-inverse-in-place"),
    pytest.param("gathered", "argsort", id="gathered-argsort"),
    pytest.param("gathered", "scatter-inverse", id="gathered-scatter-inverse"),
    pytest.param("gathered", "gather-inverse", id="gathered-gather-inverse"),
    pytest.param("masked", "index_add", id="masked-index_add"),
    pytest.param("masked", "scatter_add", id="masked-scatter_add"),
]


@pytest.mark.parametrize("capture", ["fx", "export"])
@pytest.mark.parametrize(("experts", "back"), [
    *EXACT, pytest.param("grouped", "inverse", id="grouped-inverse"),
    pytest.param("grouped", "index_add", id="grouped-index_add")])
def test_dispatch_matches_eager_in_float64(experts: str, back: str, capture: str) -> None:
    model = build(MoE, experts=experts, back=back)
    x, y = batch(torch.float64)
    cm = mbcompile.compile(model, GBS, NUM_CSX, MBS, example_inputs=(x, y), capture=capture)
    assert cm.plan.per_system_batch_sizes == (4, 3)
    loss_err, errors = step(model, cm, x, y)
    assert loss_err <= TOL
    assert len(errors) == len(list(model.parameters()))
    assert_close_errors(errors, TOL)


@pytest.mark.parametrize("capture", ["fx", "export"])
def test_torch_grouped_mm_in_bfloat16(capture: str) -> None:
    """torch's own grouped_mm (the experts in bfloat16, the rest in float32)."""
    model = build(MoE, torch.float32, experts="torch-grouped", back="inverse")
    x, y = batch(torch.float32)
    cm = mbcompile.compile(model, GBS, NUM_CSX, MBS, example_inputs=(x, y), capture=capture)
    loss_err, errors = step(model, cm, x, y)
    assert loss_err <= BFLOAT16_TOL
    assert_close_errors(errors, BFLOAT16_TOL)


def test_a_mean_over_sorted_rows_is_a_batch_reduction() -> None:
    model = build(SortedRowPenalty)
    x, y = batch(torch.float64)
    cm = mbcompile.compile(model, GBS, NUM_CSX, MBS, example_inputs=(x, y))
    loss_err, errors = step(model, cm, x, y)
    assert loss_err <= TOL
    assert_close_errors(errors, TOL)


def test_facts_of_the_dispatch_region() -> None:
    """The pass alone: what each step of the region is (validate_only stops after analysis)."""
    model = build(MoE, experts="gathered", back="inverse")
    v = mbcompile.compile(model, GBS, NUM_CSX, MBS, example_inputs=batch(torch.float64),
                          validate_only=True)
    facts = {n.name: n.meta[FACT] for n in v.graph_module.graph.nodes}
    sort = facts["sort"]
    assert isinstance(sort, Container)
    values, perm = sort.get(0), sort.get(1)
    assert isinstance(values, Permuted) and values.key and values.dim == 0
    assert isinstance(perm, TokenIndex) and perm.bijective and perm.factor == T * K
    assert facts["floordiv"] == TokenIndex(perm.sort, T)  # perm // K: a token of T per sample
    assert facts["getitem_4"] == Permuted(perm.sort)  # flat[perm // K]
    assert facts["getitem_5"] == Permuted(perm.sort)  # self.w_in[ids_sorted]: per-row weights
    assert isinstance(facts["index_put"], Unsort)
    assert facts["getitem_9"] == Batched(0, T * K)  # out[inv]: token order again
    assert str(perm) == "permutation(by sort 'sort', into x8)"
    assert str(facts["index_put"]) == "unsort(of sort 'sort')"


def test_group_offsets_are_tracked_to_the_sorted_key() -> None:
    model = build(MoE, experts="grouped", back="inverse")
    v = mbcompile.compile(model, GBS, NUM_CSX, MBS, example_inputs=batch(torch.float64),
                          validate_only=True)
    offsets = [n.meta[FACT] for n in v.graph_module.graph.nodes
               if isinstance(n.meta[FACT], GroupCounts) and n.meta[FACT].offsets]
    assert offsets and all(f.key.name == "getitem_1" for f in offsets)  # topk's indices
    assert str(offsets[0]) == "group offsets(of 'getitem_1')"


# --------------------------------------------------------------------------- #
# Look-alikes that do mix tokens of different samples
# --------------------------------------------------------------------------- #


class ScanOverSortedRows(MoE):
    def run(self, rows: torch.Tensor, ids_sorted: torch.Tensor) -> torch.Tensor:
        return rows.cumsum(0)  # offending


class NeighbourDifference(MoE):
    def run(self, rows: torch.Tensor, ids_sorted: torch.Tensor) -> torch.Tensor:
        return F.pad(rows[1:] - rows[:-1], (0, 0, 1, 0))  # offending


class PairsOfSortedRows(MoE):
    def run(self, rows: torch.Tensor, ids_sorted: torch.Tensor) -> torch.Tensor:
        pairs = rows.view(-1, 2 * H)  # offending
        return (pairs @ torch.ones(2 * H, 2 * H, dtype=rows.dtype)).view(-1, H)


class ExpertChoice(MoE):
    """Each expert picks its top tokens of the whole batch: a top-k over the batch."""

    def forward(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        h = torch.tanh(self.inp(x))
        flat = h.reshape(-1, H)
        scores = torch.softmax(self.gate(flat), dim=-1).T  # (E, tokens of the batch)
        top, idx = torch.topk(scores, 3, dim=-1)  # offending
        return top.sum() + self.head(flat[idx[0]]).sum()


class CountsAsValues(MoE):
    def run(self, rows: torch.Tensor, ids_sorted: torch.Tensor) -> torch.Tensor:
        counts = torch.histc(ids_sorted.float(), bins=E, min=0, max=E - 1)
        return rows / counts[ids_sorted][:, None]  # offending


class DescendingGroups(MoE):
    def sort(self, ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return torch.sort(ids, descending=True)

    def run(self, rows: torch.Tensor, ids_sorted: torch.Tensor) -> torch.Tensor:
        return grouped_mm(rows, self.w_in, self.offsets(ids_sorted))  # offending


class CountsFromOne(MoE):
    def offsets(self, ids_sorted: torch.Tensor) -> torch.Tensor:
        counts = torch.histc(ids_sorted.float(), bins=E - 1, min=1, max=E - 1)  # offending
        return torch.cumsum(counts, 0).to(torch.int32)


class SortedMeetsTokenOrder(MoE):
    def put_back(self, out: torch.Tensor, perm: torch.Tensor, flat: torch.Tensor) -> torch.Tensor:
        slots = flat.repeat_interleave(K, dim=0)  # the slots in token order
        return (out * slots).view(-1, K, H).sum(1)  # offending


class CopyDuplicates(MoE):
    def put_back(self, out: torch.Tensor, perm: torch.Tensor, flat: torch.Tensor) -> torch.Tensor:
        return torch.zeros_like(flat).index_copy(0, perm // K, out)  # offending


class PermutationAsValue(MoE):
    def put_back(self, out: torch.Tensor, perm: torch.Tensor, flat: torch.Tensor) -> torch.Tensor:
        scaled = out * perm[:, None]  # offending
        return scaled[perm.argsort()].view(-1, K, H).sum(1)


class TwoSorts(MoE):
    def put_back(self, out: torch.Tensor, perm: torch.Tensor, flat: torch.Tensor) -> torch.Tensor:
        slots = flat.repeat_interleave(K, dim=0)  # the slots in token order
        other = torch.argsort(slots[:, 0])  # another sort of the batch's slots
        mixed = out + slots[other]  # offending
        return mixed[perm.argsort()].view(-1, K, H).sum(1)


class ReadAfterInPlace(MoE):
    def put_back(self, out: torch.Tensor, perm: torch.Tensor, flat: torch.Tensor) -> torch.Tensor:
        slots = torch.zeros_like(perm)
        inv = slots.index_put_((perm,), torch.arange(perm.size(0)))  # offending
        return (out[inv] * slots[:, None]).view(-1, K, H).sum(1)  # slots: positions now


class ReturnsSortedRows(MoE):
    def forward(self, x: torch.Tensor, y: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        h = torch.tanh(self.inp(x))
        flat = h.reshape(-1, H)
        ids = torch.argmax(self.gate(flat), dim=-1)
        perm = torch.argsort(ids)
        rows = flat[perm] @ self.w_in[0]  # offending
        return F.cross_entropy(self.head(h.mean(1)), y), rows


REJECTED = [
    pytest.param(ScanOverSortedRows, "cumsum", "accumulates along dim 0", id="scan-sorted-rows"),
    pytest.param(NeighbourDifference, "getitem", "not a whole number of rows", id="neighbours"),
    pytest.param(PairsOfSortedRows, "view", "regroups the rows", id="pairs-of-rows"),
    pytest.param(ExpertChoice, "topk", "ranks along dim 1", id="topk-over-batch"),
    pytest.param(CountsAsValues, "getitem", "number of tokens per group", id="counts-as-values"),
    pytest.param(DescendingGroups, "grouped_mm", "sorts descending", id="descending-groups"),
    pytest.param(CountsFromOne, "histc", "bins start at 1", id="histc-from-one"),
    pytest.param(SortedMeetsTokenOrder, "mul", "token order", id="sorted-times-token-order"),
    pytest.param(CopyDuplicates, "index_copy", "without adding", id="index_copy-duplicates"),
    pytest.param(PermutationAsValue, "mul", "as a value", id="permutation-as-value"),
    pytest.param(TwoSorts, "add", "two different sorts", id="two-sorts"),
    pytest.param(ReturnsSortedRows, "matmul", "returns values in the order", id="returns-sorted"),
]


def offending_line(cls: type[nn.Module]) -> tuple[int, str]:
    """(line number, code) of the line marked ``# offending`` in ``cls``'s own methods."""
    for fn in vars(cls).values():
        if not inspect.isfunction(fn):
            continue
        lines, start = inspect.getsourcelines(fn)
        for i, line in enumerate(lines):
            if line.rstrip().endswith("# offending"):
                return start + i, line.split("#")[0].strip()
    raise AssertionError(f"no offending line in {cls.__name__}")


@pytest.mark.parametrize(("cls", "op", "why"), REJECTED)
def test_mixing_look_alikes_are_rejected(cls: type[nn.Module], op: str, why: str) -> None:
    grouped = cls in (DescendingGroups, CountsFromOne)
    model = build(cls, experts="grouped" if grouped else "gathered")
    with pytest.raises(MixingError) as info:
        mbcompile.compile(model, GBS, NUM_CSX, MBS, example_inputs=batch(torch.float64),
                          coupling="reject")
    err = info.value
    line, code = offending_line(cls)
    assert f"test_moe.py:{line}" in err.source_line, (err.source_line, str(err))
    assert code in str(err)
    assert op in err.op, (err.op, str(err))
    assert why in err.reason, err.reason


def assert_two_phase_matches_eager(model: nn.Module, inputs: tuple[Any, ...] = (),
                                   kwargs: dict[str, Any] | None = None, tol: float = TOL
                                   ) -> None:
    """The default compile runs ``model`` as a two-phase step (the plan splits each system
    unevenly) and one step equals one eager full-batch step of a copy: every output, every
    gradient."""
    cm = mbcompile.compile(model, GBS, NUM_CSX, MBS, example_inputs=inputs,
                           example_kwargs=kwargs)
    assert cm.analysis.rejected is not None and cm.analysis.two_phase
    assert cm.plan.microbatch_sizes == ((2, 2), (2, 1))
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # TwoPhaseWarning: C holds most of the memory
        errors = step_errors(model, cm, inputs, kwargs, floor=GRAD_FLOOR)
    assert_close_errors(errors, tol)


@pytest.mark.parametrize(("cls", "op", "why"), [p for p in REJECTED if p.id != "returns-sorted"])
def test_mixing_look_alikes_run_as_exact_two_phase_steps(cls: type[nn.Module], op: str,
                                                         why: str) -> None:
    grouped = cls in (DescendingGroups, CountsFromOne)
    assert_two_phase_matches_eager(build(cls, experts="grouped" if grouped else "gathered"),
                                   batch(torch.float64))


def test_sorted_rows_returned_are_rejected_by_default() -> None:
    """The rows come back in expert order: no two-phase step can return them per sample."""
    with pytest.raises(MixingError, match="returns values in the order"):
        mbcompile.compile(build(ReturnsSortedRows), GBS, NUM_CSX, MBS,
                          example_inputs=batch(torch.float64))


def test_in_place_write_read_again_is_rejected_by_the_pass() -> None:
    """The pass alone, on an fx graph that still writes in place (compile() would capture it
    functionalized): the tensor written is read afterwards, so its fact cannot change."""
    model = build(ReadAfterInPlace)
    gm = torch.fx.symbolic_trace(model)
    x, y = batch(torch.float64)
    propagate_shapes(gm, (x, y), (0, 0), GBS)
    result = analyse_batch(gm, {"x": input_fact(x, 0), "y": input_fact(y, 0)}, GBS)
    assert isinstance(result.rejected, MixingError)
    assert result.rejected.node == "index_put_"  # slots.index_put_(...), the marked line
    assert "read again afterwards" in result.rejected.reason


def test_a_sort_over_batch_samples_still_mixes() -> None:
    """Sorting (B, F) features along the batch is no token dispatch: nothing undoes it."""

    class SortSamples(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.lin = nn.Linear(FEAT, 4)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            h = self.lin(x)
            return torch.sort(h[:, 0]).values[:2].pow(2).mean()

    torch.manual_seed(0)
    model, x = SortSamples().double(), torch.randn(GBS, FEAT, dtype=torch.float64)
    with pytest.raises(MixingError, match="no longer has a batch dim"):
        mbcompile.compile(model, GBS, NUM_CSX, MBS, example_inputs=(x,), coupling="reject")
    assert_two_phase_matches_eager(model, (x,))


# --------------------------------------------------------------------------- #
# HuggingFace MoE language models (transformers 5): the acceptance test
# --------------------------------------------------------------------------- #

VOCAB, WIDTH, SEQ = 64, 32, 8


@pytest.fixture(scope="module")
def transformers() -> Any:
    tf = pytest.importorskip("transformers")
    tf.logging.set_verbosity_error()
    return tf


def hf_moe(tf: Any, name: str, aux_loss: bool = False) -> nn.Module:
    """2 layers, width 32, 4 experts, top-2; the router aux loss (it couples the batch) with
    coefficient 1, so that its gradient shows next to the cross-entropy's, if ``aux_loss``."""
    common = dict(vocab_size=VOCAB, hidden_size=WIDTH, intermediate_size=2 * WIDTH,
                  num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                  max_position_embeddings=16, use_cache=False, bos_token_id=0,
                  eos_token_id=0, pad_token_id=0, attn_implementation="sdpa",
                  output_router_logits=aux_loss, router_aux_loss_coef=1.0,
                  num_experts_per_tok=2)
    if name == "mixtral":
        return tf.MixtralForCausalLM(tf.MixtralConfig(**common, num_local_experts=4))
    if name == "qwen2_moe":
        return tf.Qwen2MoeForCausalLM(tf.Qwen2MoeConfig(
            **common, num_experts=4, moe_intermediate_size=2 * WIDTH,
            shared_expert_intermediate_size=2 * WIDTH))
    if name == "qwen3_moe":
        return tf.Qwen3MoeForCausalLM(tf.Qwen3MoeConfig(
            **common, num_experts=4, moe_intermediate_size=2 * WIDTH, head_dim=8))
    if name == "olmoe":
        return tf.OlmoeForCausalLM(tf.OlmoeConfig(**common, num_experts=4))
    if name == "granitemoe":
        return tf.GraniteMoeForCausalLM(tf.GraniteMoeConfig(**common, num_local_experts=4))
    raise ValueError(name)


def padded_batch(seed: int = 1) -> dict[str, torch.Tensor]:
    """Right-padded ids, mask and labels (-100 on padding); one sample has a single token."""
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(1, VOCAB, (GBS, SEQ), generator=g)
    lengths = torch.tensor([SEQ, 5, 3, SEQ, 1, 6, 2][:GBS])
    mask = (torch.arange(SEQ)[None, :] < lengths[:, None]).long()
    return {"input_ids": ids.masked_fill(mask == 0, 0), "attention_mask": mask,
            "labels": ids.masked_fill(mask == 0, -100)}


#: Mixtral in CI; the other four are the same dispatch in other models (``-m zoo``, as the
#: model zoo's extra entries: tests/test_zoo.py)
def _more(names: list[str]) -> list[Any]:
    return [pytest.param(n, marks=pytest.mark.zoo) for n in names]


@pytest.mark.slow
@pytest.mark.parametrize("name", ["mixtral", *_more(["qwen2_moe", "qwen3_moe", "olmoe",
                                                     "granitemoe"])])
def test_hf_moe_matches_eager_full_batch(transformers: Any, name: str) -> None:
    torch.manual_seed(0)
    model = hf_moe(transformers, name)  # float32: the grouped_mm experts have no float64
    assert model.config._experts_implementation == "grouped_mm"  # the sort-based dispatch
    batch = padded_batch()
    cm = mbcompile.compile(model, GBS, NUM_CSX, MBS, example_kwargs=batch)
    sorts = [n for n in cm.original_graph_module.graph.nodes if "sort" in str(n.target)]
    assert len(sorts) == 2  # one dispatch per layer, each proven per-sample
    assert all(isinstance(n.meta[FACT].get(1), TokenIndex) for n in sorts)

    out, got, ref, want = keyword_steps(model, cm, batch)
    assert rel_err(out.loss, ref.loss) <= FLOAT32_TOL
    assert rel_err(out.logits, ref.logits) <= FLOAT32_TOL
    errors = grad_errors(got, want, GRAD_FLOOR)
    assert len(errors) == len(list(model.parameters()))  # the experts' weights among them
    assert_close_errors(errors, FLOAT32_TOL)


# Mixtral's aux loss: test_two_phase.py (RNG, no retained activations), in CI; these in -m zoo.
@pytest.mark.slow
@pytest.mark.parametrize("name", _more(["qwen2_moe", "qwen3_moe", "olmoe", "granitemoe"]))
def test_hf_moe_with_router_aux_loss_runs_as_an_exact_two_phase_step(transformers: Any,
                                                                     name: str) -> None:
    """The load-balancing loss averages the router's probabilities over the whole batch:
    compared in float32 (loss, aux_loss, logits, router logits, every gradient)."""
    torch.manual_seed(0)
    assert_two_phase_matches_eager(hf_moe(transformers, name, aux_loss=True),
                                   kwargs=padded_batch(), tol=FLOAT32_TOL)
