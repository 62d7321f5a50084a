"""BatchNorm in training: a two-phase step by default, per-microbatch statistics on request.

The default keeps the product's promise (a split never changes the result): a
BatchNorm in training mode runs as a two-phase step, normalised by the whole batch's
statistics, exactly as eager; ``coupling="reject"`` makes it a ``MixingError``.
``batch_norm="per_microbatch"``
is the explicit opt-in to what a hand-written loop computes: each microbatch
normalised by its own statistics, running statistics updated once per microbatch,
in order. It warns, and says so in ``plan.warnings``.
"""

from __future__ import annotations

import copy
import warnings

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F
from models import assert_close_errors, step_errors

import mbcompile

DTYPE = torch.float64


class ConvBN(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.conv = nn.Conv2d(3, 4, 3, padding=1)
        self.bn = nn.BatchNorm2d(4)
        self.fc = nn.Linear(4, 5)

    def forward(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        h = F.relu(self.bn(self.conv(x))).mean((2, 3))
        return F.cross_entropy(self.fc(h), y, reduction="sum")


def _case(n: int) -> tuple[nn.Module, tuple[torch.Tensor, torch.Tensor]]:
    torch.manual_seed(0)
    g = torch.Generator().manual_seed(1)
    return ConvBN().to(DTYPE), (torch.randn(n, 3, 6, 6, generator=g, dtype=DTYPE),
                                torch.randint(0, 5, (n,), generator=g))


def _hand_loop(model: nn.Module, batch: tuple[torch.Tensor, ...],
               plan: mbcompile.MicrobatchPlan) -> nn.Module:
    """What users write: one forward and backward per microbatch, in the plan's order."""
    ref = copy.deepcopy(model)
    x, y = batch
    start = 0
    for size in (s for system in plan.microbatch_sizes for s in system):
        if size:
            ref(x[start:start + size], y[start:start + size]).backward()
        start += size
    return ref


def test_strict_coupling_rejects_batch_norm_in_training():
    model, batch = _case(7)
    with pytest.raises(mbcompile.MixingError, match="BatchNorm2d"):
        mbcompile.compile(model, 7, 2, 2, example_inputs=batch, coupling="reject")


def test_the_default_runs_batch_norm_in_training_as_a_two_phase_step():
    """Microbatches 2, 2 | 2, 1: the loss, every gradient and the running statistics (one
    update, from the whole batch: num_batches_tracked 1) equal one eager full-batch step."""
    model, batch = _case(7)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", mbcompile.MbcompileWarning)  # C's share of memory
        warnings.simplefilter("error", mbcompile.PerMicrobatchStatisticsWarning)
        cm = mbcompile.compile(model, 7, 2, 2, example_inputs=batch)
        assert "two-phase step" in cm.plan.reason
        errors = step_errors(model, cm, batch, floor=1e-4)  # conv.bias: zero up to rounding
    assert_close_errors(errors, 1e-10)
    assert int(model.bn.num_batches_tracked) == 1


@pytest.mark.parametrize("plan_args", [(7, 2, 2), (9, 3, 2), (6, 1, 4)])
def test_per_microbatch_equals_a_hand_written_loop(plan_args):
    model, batch = _case(plan_args[0])
    with pytest.warns(mbcompile.PerMicrobatchStatisticsWarning):
        cm = mbcompile.compile(model, *plan_args, example_inputs=batch,
                               batch_norm="per_microbatch")
    assert any("per_microbatch" in w for w in cm.plan.warnings)
    ref = _hand_loop(model, batch, cm.plan)
    cm(*batch).backward()
    for (name, p), q in zip(model.named_parameters(), ref.parameters()):
        assert torch.allclose(p.grad, q.grad, rtol=1e-12, atol=1e-14), name
    for (name, b), c in zip(model.named_buffers(), ref.buffers()):
        assert torch.allclose(b.double(), c.double(), rtol=1e-12, atol=1e-14), name
    assert int(model.bn.num_batches_tracked) == cm.plan.num_nonempty_microbatches


def test_per_microbatch_leaves_the_rule_table_and_eval_mode_alone():
    model, batch = _case(7)
    model.eval()  # running statistics: per-sample anyway, nothing to warn about
    with warnings.catch_warnings():
        warnings.simplefilter("error", mbcompile.PerMicrobatchStatisticsWarning)
        cm = mbcompile.compile(model, 7, 2, 2, example_inputs=batch,
                               batch_norm="per_microbatch")
    assert not any("per_microbatch" in w for w in cm.plan.warnings)
    model.train()  # the opt-in holds when the module recompiles for training...
    ref = _hand_loop(model, batch, cm.plan)
    cm(*batch).backward()
    for (name, p), q in zip(model.named_parameters(), ref.parameters()):
        assert torch.allclose(p.grad, q.grad, rtol=1e-12, atol=1e-14), name
    with pytest.raises(mbcompile.MixingError):  # ...and only for modules compiled with it
        mbcompile.compile(model, 7, 2, 2, example_inputs=batch, coupling="reject")


def test_bad_batch_norm_value_is_an_input_error():
    model, batch = _case(7)
    with pytest.raises(mbcompile.InputError, match="per_microbatch"):
        mbcompile.compile(model, 7, 2, 2, example_inputs=batch, batch_norm="micro")


@pytest.mark.parametrize("plan_args, calls", [((4, 1, 4), 4), ((7, 2, 2), 1)],
                         ids=["one_microbatch", "a_batch_of_one"])
def test_export_runs_a_batch_norm_in_one_microbatch_as_eager(plan_args, calls):
    """A plan of one microbatch runs the captured graph as it is, and the user's backward
    then runs through it: the write-back of the running statistics bumped their version,
    which the graph saved for that backward ("modified by an inplace operation", found by
    a hunt: HF ResNet on one system under ``mbs="auto"``). Eager's kernel writes them
    without a bump, and so does the write-back now. A batch of 1 sample of a conv
    feature map (36 values per channel) runs there too: a variant, one microbatch."""
    model, batch = _case(plan_args[0])
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        cm = mbcompile.compile(model, *plan_args, example_inputs=batch, capture="export")
        call = tuple(t[:calls] for t in batch)
        errors = step_errors(model, cm, call, floor=1e-4)
    assert_close_errors(errors, 1e-10)
    assert int(model.bn.num_batches_tracked) == 1


class FeaturesBN(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.a, self.bn, self.b = nn.Linear(4, 8), nn.BatchNorm1d(8), nn.Linear(8, 3)

    def forward(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        return F.cross_entropy(self.b(torch.relu(self.bn(self.a(x)))), y)


class TokensBN(nn.Module):
    """A batch norm over flattened tokens: a sample of 5 tokens gives 5 values a channel."""

    def __init__(self) -> None:
        super().__init__()
        self.a, self.bn, self.b = nn.Linear(4, 8), nn.BatchNorm1d(8), nn.Linear(8, 3)

    def forward(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        return F.cross_entropy(self.b(self.bn(self.a(x).flatten(0, 1))), y.flatten())


def test_export_refuses_one_value_a_channel_in_every_path_and_no_more():
    """The refusal below, in the paths it missed (found by a hunt): a train-mode call of one
    sample under ``no_grad`` (a BYOL target network) and a module compiled at gbs=1 gave NaN
    running variances; and a batch norm over a sample's 5 tokens was refused for a batch
    of one, which eager trains."""
    torch.manual_seed(0)
    x, y = torch.randn(7, 4, dtype=DTYPE), torch.randint(0, 3, (7,))
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        model = FeaturesBN().to(DTYPE)
        cm = mbcompile.compile(model, 7, 2, 2, example_inputs=(x, y), capture="export")
        with torch.no_grad(), pytest.raises(ValueError, match="more than 1 value per channel"):
            cm(x[:1], y[:1])
        with pytest.raises(ValueError, match="more than 1 value per channel"):
            mbcompile.compile(model, 1, 1, 1, example_inputs=(x[:1], y[:1]), capture="export")
        assert int(model.bn.num_batches_tracked) == 0
        tokens = TokensBN().to(DTYPE)
        xt, yt = torch.randn(7, 5, 4, dtype=DTYPE), torch.randint(0, 3, (7, 5))
        cm = mbcompile.compile(tokens, 7, 2, 2, example_inputs=(xt, yt), capture="export")
        errors = step_errors(tokens, cm, (xt[:1], yt[:1]), floor=1e-4)
    assert_close_errors(errors, 1e-10)


@pytest.mark.parametrize("capture", ["fx", "export"])
def test_a_training_batch_of_one_sample_of_features_is_refused_as_eager_refuses_it(capture):
    """Eager's BatchNorm1d raises ValueError for one value per channel in training;
    torch.export traces that check away, so the variant for the epoch's short last batch of
    1 normalised the lone sample and wrote running statistics eager never writes. Now a
    ValueError (InputError) too, with nothing changed; eval mode runs it."""
    torch.manual_seed(0)
    model = FeaturesBN().to(DTYPE)
    x, y = torch.randn(7, 4, dtype=DTYPE), torch.randint(0, 3, (7,))
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        cm = mbcompile.compile(model, 7, 2, 2, example_inputs=(x, y), capture=capture)
        before = copy.deepcopy(model.state_dict())
        with pytest.raises(ValueError, match="Expected more than 1 value per channel"):
            cm(x[:1], y[:1])
        after = model.state_dict()
        if capture == "export":  # (fx runs the layer's own check, after its count's add_)
            assert all(torch.equal(after[k], v) for k, v in before.items())
        assert all(p.grad is None for p in model.parameters())
        cm.eval()
        eager = copy.deepcopy(model).eval()
        assert torch.equal(cm(x[:1], y[:1]), eager(x[:1], y[:1]))


def test_quantization_aware_conv_bn_trains_as_eager():
    """torch.ao's QAT recipe (``fuse_modules_qat`` + ``prepare_qat``, per-channel weight
    fake-quant): its scale and zero point are buffers of one value until the first forward
    resizes them to one per channel. The write-back copied the graph's per-channel values
    into the one-value buffers (torch's broadcast error, after the running statistics were
    already written; found by a hunt); it now resizes them first, as the kernel does."""
    import torch.ao.quantization as quant

    class Block(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.c, self.bn, self.r = nn.Conv2d(2, 4, 3), nn.BatchNorm2d(4), nn.ReLU()
            self.o = nn.Linear(4, 3)

        def forward(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
            return F.cross_entropy(self.o(self.r(self.bn(self.c(x))).mean((2, 3))), y)

    torch.manual_seed(0)
    model = quant.fuse_modules_qat(Block().train(), [["c", "bn", "r"]])
    model.qconfig = quant.get_default_qat_qconfig("x86")
    quant.prepare_qat(model, inplace=True)
    eager = copy.deepcopy(model)
    x, y = torch.randn(7, 2, 6, 6), torch.randint(0, 3, (7,))
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        cm = mbcompile.compile(model, 7, 2, 2, example_inputs=(x, y), cost_model=False)
        for _ in range(2):
            got, want = cm(x, y), eager(x, y)
            got.backward()
            want.backward()
            assert torch.equal(got, want)
            for (name, p), q in zip(model.named_parameters(), eager.parameters()):
                if name != "c.bias":  # zero but for rounding: the batch norm removes it
                    assert torch.allclose(p.grad, q.grad, rtol=1e-5, atol=1e-7), name
            for (name, b), c in zip(model.named_buffers(), eager.buffers()):
                assert b.shape == c.shape and torch.allclose(b.double(), c.double()), name
            model.zero_grad()
            eager.zero_grad()


class ReturnsBufferScaled(nn.Module):
    """A two-phase step (a BatchNorm in training) that also returns the input scaled by a
    buffer, and a mask made from constants: no parameter reaches either."""

    def __init__(self) -> None:
        super().__init__()
        self.a, self.bn = nn.Linear(4, 3), nn.BatchNorm1d(3)
        self.register_buffer("scale", torch.tensor([1.0, 2.0, 3.0, 4.0], dtype=DTYPE))

    def forward(self, x: torch.Tensor, y: torch.Tensor):
        mask = torch.ones_like(x)
        mask[:, :2] = 0  # (an item write of a constant: export lifts the 0 as a constant)
        return F.cross_entropy(self.bn(self.a(x)), y), x * self.scale, mask


@pytest.mark.parametrize("capture", ["auto", "export"])  # (fx cannot trace the item write)
def test_an_output_no_parameter_reaches_needs_no_gradient_in_a_two_phase_step(capture):
    """Buffers and constants counted as parameters: such an output came back requiring grad
    with a grad_fn (MAE's visualisation code, mask.numpy(), raised; found by a hunt)."""
    torch.manual_seed(0)
    model = ReturnsBufferScaled().to(DTYPE)
    x, y = torch.randn(7, 4, dtype=DTYPE), torch.randint(0, 3, (7,))
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        cm = mbcompile.compile(model, 7, 2, 2, example_inputs=(x, y), capture=capture)
        errors = step_errors(model, cm, (x, y), floor=1e-4)
        loss, scaled, mask = cm(x, y)
    assert_close_errors(errors, 1e-10)
    assert loss.requires_grad and not scaled.requires_grad and not mask.requires_grad
    assert mask.numpy().tolist() == [[0, 0, 1, 1]] * 7
