"""Probing a repeated block once gives the whole graph's figures.

The cost model probes a graph with repeated blocks cut to one and two blocks and counts
the rest (``planning/block_probe.py``, ``passes/repeated_blocks.py``). Its modelled
figures (the chosen MBS, every candidate's peak memory and step time) must equal those
of probing the whole graph (``Prober.per_block = False``) to 1%, for the plain graph and
the one with activation checkpointing per block.
"""

from __future__ import annotations

from typing import Any

import pytest
import torch
from models import TOL, assert_close_errors, plan_free, step_errors

import mbcompile
from mbcompile.analysis import analyse
from mbcompile.models import TinyGPT, make_tiny_gpt, token_batch
from mbcompile.passes import shape_prop
from mbcompile.passes.block_capture import capture_by_blocks
from mbcompile.passes.export_capture import export_capture
from mbcompile.passes.facts import SHAPES
from mbcompile.passes.recompute import block_of, checkpoint_blocks
from mbcompile.passes.repeated_blocks import find_blocks, truncate
from mbcompile.passes.shape_prop import propagate_shapes
from mbcompile.planning import probe
from mbcompile.planning.block_probe import MIN_BLOCKS, BlockProber, first_block
from mbcompile.planning.cost import CostModel
from mbcompile.planning.cost_analysis import analyse_cost
from mbcompile.request import make_request

SEQ, VOCAB = 16, 64


def _gpt(depth: int) -> tuple[torch.nn.Module, tuple[torch.Tensor, torch.Tensor]]:
    torch.manual_seed(0)
    return (TinyGPT(vocab=VOCAB, width=32, depth=depth, heads=2, seq=SEQ),
            token_batch(4, SEQ, VOCAB, seed=1))


def _figures(model: torch.nn.Module, batch: Any, **options: Any) -> dict[str, Any]:
    cm = mbcompile.compile(model, 24, 2, "explore", example_inputs=batch, compile_only=True,
                           system="host", **options)
    x = cm.exploration
    return {"mbs": cm.plan.mbs, "recompute": cm.plan.recompute,
            "peak": [c.peak_bytes for c in x.candidates],
            "step": [c.step_s for c in x.candidates],
            "probes": cm.selection.cost.probes_run}


def _assert_within_1_percent(got: dict[str, Any], want: dict[str, Any]) -> None:
    assert (got["mbs"], got["recompute"]) == (want["mbs"], want["recompute"])
    for key in ("peak", "step"):
        assert got[key] == pytest.approx(want[key], rel=0.01), key


@pytest.mark.parametrize("depth", [MIN_BLOCKS, 8])  # fewer blocks are probed whole
@pytest.mark.parametrize("recompute", [False, True])
def test_per_block_figures_equal_the_whole_graphs(monkeypatch: pytest.MonkeyPatch,
                                                   depth: int, recompute: bool) -> None:
    model, batch = _gpt(depth)
    per_block = _figures(model, batch, recompute=recompute)
    monkeypatch.setattr(probe.Prober, "per_block", False)
    whole = _figures(model, batch, recompute=recompute)
    _assert_within_1_percent(per_block, whole)


def test_pinned_mbs_runs_one_probe_and_equals_the_whole(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """An int MBS runs one probe, the graph cut to two blocks (the one-block figures are
    derived from it: ``first_block``), without the fit or the three-block check (it
    chooses nothing), also with activation checkpointing; its estimate is the whole
    graph's."""
    model, batch = _gpt(MIN_BLOCKS + 1)
    probed: list[int | str] = []  # per probe: the blocks its cut keeps, or what it is
    real = probe.Prober.probe

    def counted(self: probe.Prober, m: int) -> Any:
        tags = getattr(self.fake_probe, "tags", None)  # a cut's prober tags its blocks
        probed.append("whole" if tags is None else max(tags.values()) + 1 if tags
                      else "check")
        return real(self, m)

    monkeypatch.setattr(probe.Prober, "probe", counted)

    def estimate(recompute: bool) -> Any:
        return mbcompile.compile(model, 8, 2, 2, example_inputs=batch, compile_only=True,
                                 system="host", recompute=recompute).estimate

    estimate(False)
    got = estimate(True)
    assert probed == [2, 2]  # one size, cut to two blocks: no one-block probe, no check, no fit
    # (unchecked, the stacked figures are those the check passes in the test above; here
    # the checkpointed graph's, which the selection costs apart)
    monkeypatch.setattr(probe.Prober, "per_block", False)
    want = estimate(True)
    assert got.memory.peak == pytest.approx(want.memory.peak, rel=0.01)
    assert got.time.step == pytest.approx(want.time.step, rel=0.01)


def test_first_block_derived_from_two_equals_the_one_block_probe() -> None:
    """P1 taken out of P2's run (its ops without the second block's, its storages without
    what the second block's forward made) is the probe of the graph cut to one block: every
    per-op figure, the saved bytes, the gradients' timeline; with checkpointed blocks too."""
    model, batch = _gpt(MIN_BLOCKS)
    cm = mbcompile.compile(model, 8, 2, 2, example_inputs=batch, cost_model=False)
    gm = cm.analysis.graph_module
    for graph in (gm, checkpoint_blocks(gm)):
        blocks = probe.Prober(graph, list(batch), [0, 0], cm.analysis.loss_outputs).blocks
        for m in (1, 3):  # m = 1: size-1 dims broadcast
            want, got = blocks.one.probe(m), first_block(blocks.two.probe(m))
            assert got.ops == want.ops and got.tags.tolist() == want.tags.tolist()
            for key, value in want.arrays().items():
                assert got.arrays()[key].tolist() == value.tolist(), key
            assert (got.saved, got.outputs, got.casts) == (want.saved, want.outputs, want.casts)


def _llama(transformers: Any) -> tuple[torch.nn.Module, Any]:
    config = transformers.LlamaConfig(
        vocab_size=128, hidden_size=32, intermediate_size=64, num_hidden_layers=MIN_BLOCKS,
        num_attention_heads=4, num_key_value_heads=2, tie_word_embeddings=True)
    with torch.device("meta"):
        model = transformers.LlamaForCausalLM(config)
    ids = torch.zeros(4, SEQ, dtype=torch.long, device="meta")
    return model, make_request(model, 24, 2, "auto", example_inputs=(ids,), outputs="loss",
                               example_kwargs={"labels": ids}, compile_only=True,
                               system="host")


def test_transformers_llama_captured_by_two_layers_is_the_whole_graph() -> None:
    """An export graph grown from two layers: parameters read up front, rotary tables and
    the mask shared by every layer, the hidden state chained through them."""
    model, request = _llama(pytest.importorskip("transformers"))
    dims = dict(zip(request.inputs.names, request.inputs.in_dims))

    def exported(module: torch.nn.Module) -> Any:
        return export_capture(module, dict(request.example), dims)

    grown = capture_by_blocks(model, exported)  # exported with two layers, grown to four
    assert grown is not None
    assert _structure(grown.graph_module) == _structure(exported(model).graph_module)


@pytest.mark.slow
def test_transformers_llama_per_block_equals_whole(monkeypatch: pytest.MonkeyPatch) -> None:
    """The figures of an export graph, probed by blocks and whole."""
    model, request = _llama(pytest.importorskip("transformers"))
    analysed = analyse(request)  # captured by blocks, costed twice

    def cost() -> CostModel:
        return analyse_cost(analysed.analysis, request.values, request.inputs.in_dims,
                            pbs=request.pbs, kept_outputs=analysed.kept, fused=analysed.fused)

    per_block = cost()
    monkeypatch.setattr(probe.Prober, "per_block", False)
    whole = cost()
    assert whole.fit_note == per_block.fit_note  # the same fit, from the same sizes
    for mbs in range(1, request.pbs + 1):
        got, want = (c.estimate(24, 2, mbs, request.system) for c in (per_block, whole))
        assert got.memory.peak == pytest.approx(want.memory.peak, rel=0.01)
        assert got.time.step == pytest.approx(want.time.step, rel=0.01)


def _structure(gm: torch.fx.GraphModule) -> list[str]:
    """Each node's op, target (a parameter's name) and block, with those of the nodes it
    reads: what must not change when layers are copied instead of traced (export lists
    the parameters first, the grown graph each copied layer's before it)."""
    def key(n: torch.fx.Node) -> tuple[str, str, str]:
        return n.op, str(n.target), block_of(n) or ""

    return sorted(repr((key(n), [key(a) for a in n.all_input_nodes])) for n in gm.graph.nodes)


def test_blocks_stack_or_the_graph_is_probed_whole() -> None:
    """A deep enough graph is probed by blocks, its stacked probe checked against three
    blocks probed exactly; a shallow one is probed whole."""
    model, batch = _gpt(MIN_BLOCKS + 1)
    cm = mbcompile.compile(model, 8, 2, 2, example_inputs=batch, cost_model=False)
    gm = cm.analysis.graph_module
    for graph in (gm, checkpoint_blocks(gm)):
        blocks = find_blocks(graph)
        assert blocks is not None and blocks.count == MIN_BLOCKS + 1
        values, in_dims = list(batch), [0, 0]
        prober = probe.Prober(graph, values, in_dims, cm.analysis.loss_outputs or None)
        assert isinstance(prober.blocks, BlockProber)
        stacked = prober(3)
        assert prober.blocks is not None and prober.blocks.checked
        whole = probe.Prober(graph, values, in_dims, cm.analysis.loss_outputs or None,
                             tags={}).probe(3)
        assert sorted(stacked.ops) == sorted(whole.ops)
        assert stacked.flops.sum() == pytest.approx(whole.flops.sum(), rel=1e-9)
        assert stacked.live.max() == pytest.approx(whole.live.max(), rel=1e-9)
        assert stacked.saved == pytest.approx(whole.saved, rel=1e-9)
    cut = truncate(gm, find_blocks(gm), 2)
    assert find_blocks(cut) is not None and find_blocks(cut).count == 2
    assert sum(p.numel() for p in cut.parameters()) < sum(p.numel() for p in gm.parameters())
    shallow = probe.Prober(cut, list(batch), [0, 0], cm.analysis.loss_outputs or None)
    assert shallow.blocks is None  # two blocks: probed whole


def test_shape_pass_runs_two_blocks_and_copies_the_rest(monkeypatch: pytest.MonkeyPatch
                                                        ) -> None:
    """Every node's shapes at gbs and gbs + 1 as a run of the whole graph finds them."""
    model, batch = _gpt(6)
    cm = mbcompile.compile(model, 8, 2, 2, example_inputs=batch, cost_model=False)
    gm = cm.analysis.graph_module
    cuts: list[int] = []
    monkeypatch.setattr(shape_prop, "truncate",
                        lambda g, b, keep, **k: cuts.append(keep) or truncate(g, b, keep, **k))
    per_block = {n.name: n.meta[SHAPES] for n in propagate_shapes(gm, batch, [0, 0], 8)
                 .graph.nodes}
    assert cuts == [2]  # run cut to two blocks
    monkeypatch.setattr(shape_prop, "MIN_BLOCKS", 7)  # six blocks: run whole
    whole = {n.name: n.meta[SHAPES] for n in propagate_shapes(gm, batch, [0, 0], 8)
             .graph.nodes}
    assert per_block == whole
    assert sum(v is not None for v in whole.values()) > 6 * len(find_blocks(gm).nodes[0])


def test_the_probe_takes_the_shape_pass_cut_while_it_holds() -> None:
    """The cost model probes the shape pass's cut to two blocks in its fake mode, with its
    fake parameters (no second search, cut or copy): its blocks are those ``find_blocks``
    finds once the shapes are written, its probe is a fresh cut's, op for op; a graph
    changed after the cut (a node's arguments set again) is cut afresh."""
    model, batch = _gpt(6)
    analysed = analyse(make_request(model, 8, 2, 2, example_inputs=batch))
    gm, run = analysed.analysis.graph_module, analysed.block_run
    assert run is not None and run.holds(gm)
    assert run.blocks.nodes == find_blocks(gm, MIN_BLOCKS).nodes
    values, loss = list(batch), analysed.analysis.loss_outputs or None
    shared = probe.Prober(gm, values, [0, 0], loss, block_run=run).blocks.two
    assert shared.gm is run.cut and shared.fake_probe.mode is run.probe.mode
    assert all(any(p is f for _, f in run.probe._fakes.values()) for p in shared.params.values())
    fresh = probe.Prober(gm, values, [0, 0], loss).blocks.two
    assert fresh.gm is not run.cut
    a, b = shared.probe(2), fresh.probe(2)
    assert a.ops == b.ops and (a.saved, a.outputs) == (b.saved, b.outputs)
    for key, value in a.arrays().items():
        assert (value == b.arrays()[key]).all(), key
    node = next(n for n in gm.graph.nodes if n.op == "call_function")
    node.args = node.args  # set again (fx makes a new tuple): the cut no longer holds
    assert not run.holds(gm)
    assert probe.Prober(gm, values, [0, 0], loss, block_run=run).blocks.two.gm is not run.cut


def test_deep_model_compiled_with_block_shapes_equals_eager() -> None:
    """The shapes copied from the second block drive the batch analysis and the rewrite of
    a model that trains: one step equals eager's in float64."""
    model, batch = make_tiny_gpt(8, dtype=torch.float64, vocab=32, width=16,
                                 depth=MIN_BLOCKS + 1, heads=2, seq=8)
    cm = mbcompile.compile(model, 8, 2, 2, example_inputs=batch, **plan_free(2))
    assert find_blocks(cm.original_graph_module) is not None
    assert_close_errors(step_errors(model, cm, batch), TOL)


class _FlagBlock(torch.nn.Module):
    """The same class and parameters in every layer; a plain flag set by index changes
    what a layer computes (as ``self.is_sliding`` does in some transformers models)."""

    def __init__(self, index: int) -> None:
        super().__init__()
        self.lin = torch.nn.Linear(8, 8)
        self.square = index >= 2

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        h = torch.tanh(self.lin(h))
        return h * h if self.square else h


class _FlagNet(torch.nn.Module):
    def __init__(self, block: type[torch.nn.Module] = _FlagBlock) -> None:
        super().__init__()
        self.layers = torch.nn.ModuleList(block(i) for i in range(4))

    def forward(self, x: torch.Tensor, **kwargs: Any) -> torch.Tensor:  # export captures it
        for layer in self.layers:
            x = layer(x)
        return x.pow(2).mean()


class _ActivationBlock(torch.nn.Module):
    """Layers with the same parameters and different submodules (GELU, then ReLU)."""

    def __init__(self, index: int) -> None:
        super().__init__()
        self.lin = torch.nn.Linear(8, 8)
        self.act = torch.nn.GELU() if index < 2 else torch.nn.ReLU()

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        return self.act(self.lin(h))


@pytest.mark.parametrize("block", [_FlagBlock, _ActivationBlock])
def test_layers_that_differ_by_index_are_captured_whole(block: type) -> None:
    """Copying the second layer for the later ones would silently drop what they do
    differently: a flag the trace read (its guard holds another value there), or another
    submodule class; such a model is captured whole, and its plan's graph is the whole one."""
    torch.manual_seed(0)
    model = _FlagNet(block)
    x = torch.randn(4, 8)

    def exported(module: torch.nn.Module) -> Any:
        return export_capture(module, {"x": x}, {"x": 0})

    assert capture_by_blocks(model, exported) is None
    cm = mbcompile.compile(model, 8, 2, 2, example_inputs=(x,), compile_only=True,
                           system="host")
    assert _structure(cm.original_graph_module) == _structure(exported(model).graph_module)
