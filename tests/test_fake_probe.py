"""The fake probe: the one fake-tensor interpreter behind the shape pass and the cost model.

Oracles: a real-tensor run of the same graph (shapes at gbs and gbs + 1), textbook
FLOP counts (a matmul of (m, k) by (k, n) is 2*m*k*n), and the figures the cost
model's own interpreter produced before the probe replaced it (recorded below).
"""

from __future__ import annotations

from typing import Any

import pytest
import torch
import torch.fx as fx
import torch.nn as nn
from torch._subclasses.fake_tensor import FakeTensor

from mbcompile.models import make_cnn, make_mlp, make_tiny_gpt
from mbcompile.passes.capture import capture
from mbcompile.passes.facts import SHAPES, ValueInfo
from mbcompile.passes.fake_probe import FakeProbe, resize_batch
from mbcompile.passes.shape_prop import propagate_shapes
from mbcompile.planning.cost_analysis import analyse_cost

MAKERS = {"mlp": make_mlp, "cnn": make_cnn, "tiny_gpt": make_tiny_gpt}
GBS = 8


def graph_of(name: str) -> tuple[fx.GraphModule, tuple[Any, ...]]:
    model, batch = MAKERS[name](GBS)
    return capture(model).graph_module, batch


# --------------------------------------------------------------------------- #
# Shapes: the probe at gbs and gbs + 1 sees what a real run sees
# --------------------------------------------------------------------------- #


def _real_values(gm: fx.GraphModule, batch: tuple[Any, ...]) -> dict[str, Any]:
    """Every node's value on real tensors, by node name."""
    values: dict[str, Any] = {}

    class Keep(fx.Interpreter):
        def run_node(self, n: fx.Node) -> Any:
            values[n.name] = out = super().run_node(n)
            return out

    Keep(gm, garbage_collect_values=False).run(*batch)
    return values


def _expected(a: Any, b: Any) -> Any:
    """The ValueInfo the shape pass should write for real values ``a`` (gbs), ``b`` (gbs+1)."""
    if isinstance(a, torch.Tensor):
        return ValueInfo(True, tuple(a.shape), tuple(b.shape), a.dtype)
    if isinstance(a, bool):
        return None
    if isinstance(a, (int, float)):
        return ValueInfo(False, int_a=a, int_b=b)
    if isinstance(a, (tuple, list)):
        return tuple(_expected(x, y) for x, y in zip(a, b))
    return None


@pytest.mark.parametrize("name", list(MAKERS))
def test_the_shape_pass_records_the_shapes_of_a_real_run(name: str) -> None:
    gm, batch = graph_of(name)
    propagate_shapes(gm, batch, (0, 0), GBS)
    real_a = _real_values(gm, batch)
    real_b = _real_values(gm, MAKERS[name](GBS + 1)[1])
    for node in gm.graph.nodes:
        want = _expected(real_a[node.name], real_b[node.name])
        got = node.meta[SHAPES]
        assert got == want, (node.format_node(), got, want)


def test_the_mlp_shapes_at_gbs_and_gbs_plus_one() -> None:
    gm, batch = graph_of("mlp")
    propagate_shapes(gm, batch, (0, 0), GBS)
    table = [(n.name, n.meta[SHAPES].shape_a, n.meta[SHAPES].shape_b)
             for n in gm.graph.nodes if n.op != "output"]
    assert table == [
        ("x", (8, 8), (9, 8)), ("y", (8, 3), (9, 3)),
        ("net_0", (8, 32), (9, 32)), ("net_1", (8, 32), (9, 32)),
        ("net_2", (8, 32), (9, 32)), ("net_3", (8, 32), (9, 32)),
        ("net_4", (8, 3), (9, 3)), ("mse_loss", (), ()),
    ]
    loss, pred = next(n for n in gm.graph.nodes if n.op == "output").meta[SHAPES]
    assert (loss.shape_a, pred.shape_a, pred.shape_b, pred.batch_dims) == ((), (8, 3), (9, 3), (0,))


def test_the_shape_pass_is_idempotent() -> None:
    gm, batch = graph_of("tiny_gpt")
    propagate_shapes(gm, batch, (0, 0), GBS)
    first = {n.name: n.meta[SHAPES] for n in gm.graph.nodes}
    propagate_shapes(gm, batch, (0, 0), GBS)
    assert {n.name: n.meta[SHAPES] for n in gm.graph.nodes} == first


# --------------------------------------------------------------------------- #
# Cost: the probe under the FLOP counter and the saved-tensor hooks
# --------------------------------------------------------------------------- #

# (flops_forward, flops_backward, saved_bytes, activation_peak_bytes, kernels) per
# microbatch size, as the cost model measured them with its own interpreter before
# the fake probe replaced it (m = 1, 2, 8 exact probes; m = 5 from the affine fit).
# The peak is the probe's since issue 34: it runs as a later microbatch of the step,
# whose new gradients are temporaries until autograd adds them in.
BEFORE = {
    "mlp": {1: (2752, 4992, 396, 4756, 18), 2: (5504, 9984, 792, 5280, 18),
            5: (13760, 24960, 1980, 6852, 18), 8: (22016, 39936, 3168, 8424, 18)},
    "cnn": {1: (64672, 101696, 7825, 11884, 42), 2: (129344, 203392, 15638, 19600, 42),
            5: (323360, 508480, 39077, 48988, 42), 8: (517376, 813568, 62516, 78376, 42)},
    "tiny_gpt": {1: (884736, 1785856, 75012, 97544, 75),
                 2: (1769472, 3571712, 149892, 178440, 75),
                 5: (4423680, 8929280, 374532, 435976, 75),
                 8: (7077888, 14286848, 599172, 697480, 75)},
}


def _linear(m: int, k: int, n: int) -> int:
    return 2 * m * k * n


def textbook_flops(name: str, m: int) -> tuple[int, int]:
    """(forward, backward) FLOPs of the matmuls and convolutions at ``m`` samples.

    Backward costs each layer twice its forward (the input's and the weight's
    gradient), except the first layer, whose input needs no gradient.
    """
    if name == "mlp":  # 8 -> 32 -> 32 -> 3
        first, rest = _linear(m, 8, 32), _linear(m, 32, 32) + _linear(m, 32, 3)
        return first + rest, first + 2 * rest
    if name == "cnn":  # 3x3 convs 3 -> 8 on 8x8, 8 -> 16 on 4x4, then a 16 -> 5 linear
        first = _linear(m * 8 * 8, 3 * 9, 8)
        rest = _linear(m * 4 * 4, 8 * 9, 16) + _linear(m, 16, 5)
        return first + rest, first + 2 * rest
    # tiny_gpt: 2 blocks of width 32 (qkv, proj, up, down), 4 heads, 16 tokens, vocab 64;
    # the embeddings feed the first linear, so every linear's input needs a gradient.
    t = m * 16
    linears = 2 * (_linear(t, 32, 96) + _linear(t, 32, 32) + 2 * _linear(t, 32, 128)) \
        + _linear(t, 32, 64)
    scores = _linear(m * 4 * 16, 8, 16)  # one of q @ k.T, p @ v per block, all heads
    causal = 2  # the flash kernel skips the blocks above the diagonal
    forward = linears + 2 * (2 * scores) // causal
    backward = 2 * linears + 2 * (5 * scores) // causal  # torch's formula recomputes q @ k.T
    return forward, backward


@pytest.fixture(scope="module")
def costs() -> dict[str, Any]:
    out = {}
    for name in MAKERS:
        gm, batch = graph_of(name)
        out[name] = analyse_cost(gm, batch, (0, 0), pbs=GBS)
    return out


@pytest.mark.parametrize("name", list(MAKERS))
def test_cost_figures_are_those_of_the_old_interpreter(costs, name: str) -> None:
    cost = costs[name]
    assert cost.fitted and cost.probes_run == 3
    for m, (fwd, bwd, saved, peak, kernels) in BEFORE[name].items():
        f = cost.figures(m)
        assert (f.flops_forward, f.flops_backward, f.saved_bytes, f.activation_peak_bytes,
                f.kernels) == (fwd, bwd, saved, peak, kernels), m
        assert f.transient_bytes == peak - saved
        assert f.exact == (m != 5)


@pytest.mark.parametrize("name", list(MAKERS))
def test_flops_are_the_textbook_count_and_linear_in_m(costs, name: str) -> None:
    cost = costs[name]
    one = cost.figures(1).flops
    for m in (1, 2, 5, 8):
        f = cost.figures(m)
        assert (f.flops_forward, f.flops_backward) == textbook_flops(name, m)
        assert f.flops == m * one


def test_the_mlp_saves_its_hidden_activations_for_backward(costs) -> None:
    # GELU saves its input, the second linear the GELU's output, tanh its output (which
    # the last linear reads too), the loss the prediction: 3 x 32 + 3 floats per sample
    for m in (1, 2, 5, 8):
        assert costs["mlp"].figures(m).saved_bytes == 4 * m * (3 * 32 + 3)


# --------------------------------------------------------------------------- #
# The probe itself
# --------------------------------------------------------------------------- #


def test_nested_inputs_are_resized_along_their_batch_dim() -> None:
    probe = FakeProbe(nn.Linear(2, 2))
    x = torch.randn(6, 4)
    pair = (torch.randn(6, 2), torch.ones(6, dtype=torch.long))
    seq_major = {"h": torch.randn(5, 6, 3), "steps": 5}
    shared = torch.randn(4)
    real = [x, pair, seq_major, shared, 7]
    before = [tuple(t.shape) for t in (x, *pair, seq_major["h"], shared)]
    args = probe.inputs(real, [0, 0, 1, None, None], 3)

    assert isinstance(args[0], FakeTensor) and args[0].shape == (3, 4)
    assert isinstance(args[1], tuple) and [tuple(t.shape) for t in args[1]] == [(3, 2), (3,)]
    assert args[1][1].dtype == torch.long
    assert set(args[2]) == {"h", "steps"}
    assert args[2]["h"].shape == (5, 3, 3) and args[2]["steps"] == 5
    # unbatched: a fake copy of the same shape; a number stays the number it was
    assert isinstance(args[3], FakeTensor) and args[3].shape == (4,)
    assert args[4] == 7
    # the caller's tensors are not touched
    assert [tuple(t.shape) for t in (x, *pair, seq_major["h"], shared)] == before
    assert not any(isinstance(t, FakeTensor) for t in (x, *pair, seq_major["h"], shared))


def test_resize_batch_without_a_batch_dim_keeps_shapes() -> None:
    probe = FakeProbe(nn.Linear(2, 2))
    value = {"a": torch.randn(6, 2), "b": [torch.randn(2, 6), "tag"]}
    same = resize_batch(value, None, 3, probe.mode)
    assert same["a"].shape == (6, 2) and same["b"][0].shape == (2, 6) and same["b"][1] == "tag"
    negative = resize_batch(value, -1, 3, probe.mode)
    assert negative["a"].shape == (6, 3) and negative["b"][0].shape == (2, 3)


class WithRunningStats(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(4, 4)
        self.bn = nn.BatchNorm1d(4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.bn(self.lin(x))
        torch.relu(h)  # read by no node: dropped right after it runs
        return h.sum()


def test_the_probe_runs_on_fake_copies_of_parameters_and_buffers() -> None:
    model = WithRunningStats()
    gm = fx.symbolic_trace(model)
    stats = {k: v.clone() for k, v in model.bn.named_buffers()}
    probe = FakeProbe(gm)
    out = probe.run(*probe.inputs([torch.randn(6, 4)], [0], 5))
    assert isinstance(out, FakeTensor) and out.shape == ()
    for k, v in model.bn.named_buffers():  # the running statistics did not move
        assert torch.equal(v, stats[k]), k
    weight = model.lin.weight
    assert probe.fake(weight) is probe.fake(weight)  # one fake per real tensor, every run
    assert isinstance(probe.fake(weight), FakeTensor) and probe.fake(weight).requires_grad
    assert type(weight) is nn.Parameter and not isinstance(weight, FakeTensor)
    assert probe.env == {}  # nothing fake outlives the run


def test_a_value_no_node_reads_is_dropped_after_its_node() -> None:
    gm = fx.symbolic_trace(WithRunningStats())
    seen: dict[str, set[str]] = {}

    class Watch(FakeProbe):
        def run_node(self, n: fx.Node) -> Any:
            seen[n.name] = {k.name for k in self.env}
            return super().run_node(n)

    probe = Watch(gm)
    probe.run(*probe.inputs([torch.randn(6, 4)], [0], 2))
    dead = next(n.name for n in gm.graph.nodes if n.op == "call_function" and not n.users)
    after = list(seen)[list(seen).index(dead) + 1]
    assert dead not in seen[after]


def test_a_plain_module_runs_whole() -> None:
    class Branchy(nn.Module):  # a Python branch on the shape: no fx graph, still probed
        def __init__(self) -> None:
            super().__init__()
            self.lin = nn.Linear(4, 2)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return self.lin(x) * 2 if x.shape[0] > 1 else self.lin(x)

    model = Branchy()
    probe = FakeProbe(model)
    out = probe.run(*probe.inputs([torch.randn(6, 4)], [0], 3))
    assert isinstance(out, FakeTensor) and out.shape == (3, 2)
    assert not any(isinstance(p, FakeTensor) for p in model.parameters())
