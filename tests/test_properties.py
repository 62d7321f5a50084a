"""Property tests at the compile level (hypothesis, bounded so CI stays fast).

``tests/test_plan.py`` covers the plan arithmetic alone; here the properties are
about what ``compile`` builds and runs:

1. for random (gbs 1..256, num_csx 1..16, mbs any value or mode), ``compile``
   fails exactly when ``make_plan`` does (same error type), and otherwise its plan
   is ``make_plan``'s, the rewritten graph splits the batch into exactly the plan's
   non-empty microbatches, in order, and each microbatch reaches the model once;
2. random small models composed from per-sample blocks (Linear, LayerNorm, GELU,
   GroupNorm on a conv, Embedding, residual adds, reshapes with ``x.size(0)``; mean,
   sum, cross-entropy and MSE losses, or no loss) under random plans equal eager in
   float64 to 1e-10 relative, outputs and gradients;
3. the same compositions with one mixing op inserted (softmax over dim 0, BatchNorm
   in training, ``x - x.mean(0)``, max over dim 0, ``z @ z.T``) are rejected with
   ``MixingError`` under ``coupling="reject"``; ops that reorder or select samples are
   rejected too. By default (``coupling="two_phase"``) the same models run as two-phase
   steps and equal eager in float64 to 1e-10 (outputs, gradients, running statistics).
"""

from __future__ import annotations

import copy
import dataclasses
import math
import os
import warnings

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from models import assert_close_errors, step_errors

import mbcompile
from mbcompile import MbcompileError, MixingError
from mbcompile.planning.plan import make_plan, parse_mbs

DTYPE = torch.float64
REL = 1e-10
# BatchNorm and centring cancel the bias before them: its gradient is zero up to rounding,
# measured against this fraction of the largest gradient (models.grad_errors); values
# that cancel altogether (the sum of a BatchNorm's outputs) against _rel_err's 1e-3.
GRAD_FLOOR, SCALE_FLOOR = 1e-4, 1e-3

# 25 examples keep CI fast; MBCOMPILE_PROPERTY_EXAMPLES=500 runs a longer, random search.
_EXAMPLES = int(os.environ.get("MBCOMPILE_PROPERTY_EXAMPLES", "25"))
BOUNDED = settings(max_examples=_EXAMPLES, deadline=None, derandomize=_EXAMPLES <= 25,
                   database=None,
                   suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])


def _rel_err(got: torch.Tensor, want: torch.Tensor) -> float:
    """max |got - want| / max |want|, the scale floored at 1e-3 (``SCALE_FLOOR``): values
    that cancel to almost nothing (a gradient of 1e-10 through two LayerNorms) carry
    absolute rounding of about 1e-17 whatever the plan, which is no sign of a wrong
    split."""
    got, want = got.detach(), want.detach()
    if got.shape != want.shape:
        return float("inf")
    if want.numel() == 0:
        return 0.0
    scale = max(want.abs().max().item(), SCALE_FLOOR)
    return (got - want).abs().max().item() / scale


# --------------------------------------------------------------------------- #
# 1. plans at the compile level
# --------------------------------------------------------------------------- #

MBS_VALUES = st.one_of(
    st.integers(1, 8),  # mostly valid, often adjusted to the closest supported value
    st.integers(-3, 300),
    st.sampled_from(["auto", "none", "explore", "Auto", "fast", ""]),
    st.builds(lambda lo, hi: {"explore": {"min": lo, "max": hi}},
              st.integers(-1, 40), st.integers(-1, 40)),
    st.sampled_from([2.0, True, None, [4], {"explore": 3}]),
)


class Tiny(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.inp = nn.Linear(3, 4)
        self.out = nn.Linear(4, 2)

    def forward(self, x, y):
        pred = self.out(torch.tanh(self.inp(x)))
        return F.mse_loss(pred, y), pred


def _tiny_batch(n: int, seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    return (torch.randn(n, 3, generator=g, dtype=DTYPE),
            torch.randn(n, 2, generator=g, dtype=DTYPE))


def _plan_or_error(gbs: int, num_csx: int, mbs: object, **choosers):
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        try:
            return make_plan(gbs, num_csx, mbs, **choosers)
        except MbcompileError as err:
            return err


def _searches(mbs: object) -> bool:
    """'auto' and 'explore' modes: compile may pick the MBS with its cost model."""
    try:
        return parse_mbs(mbs).mode in ("auto", "explore")
    except MbcompileError:
        return False


@BOUNDED
@given(gbs=st.integers(1, 256), num_csx=st.integers(1, 16), mbs=MBS_VALUES)
def test_compile_plans_like_make_plan_and_runs_every_microbatch_once(gbs, num_csx, mbs):
    want = _plan_or_error(gbs, num_csx, mbs)
    torch.manual_seed(0)
    model = Tiny().to(DTYPE)
    reference = copy.deepcopy(model)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        try:
            cm = mbcompile.compile(model, gbs, num_csx, mbs, example_inputs=_tiny_batch(3))
        except MbcompileError as err:
            # compile fails exactly when the arithmetic does, with the same error type
            # (a searching mode may also fail for want of a cost model, as make_plan does)
            assert isinstance(want, Exception), f"compile raised {err!r}; make_plan gives {want}"
            assert type(err) is type(want), (err, want)
            return
    plan = cm.plan
    if _searches(mbs):
        # the chooser is compile's own (a cost model may pick the MBS); the arithmetic
        # around the chosen value must be make_plan's
        fixed = lambda pbs, candidates: (plan.mbs, "fixed")  # noqa: E731
        want = _plan_or_error(gbs, num_csx, mbs, chooser=fixed, explorer=fixed)
        assert not isinstance(want, Exception), want
        assert dataclasses.replace(plan, reason="", warnings=(), precision=None) == \
            dataclasses.replace(want, reason="", warnings=())
    else:  # compile names the precision its cost model probed in; make_plan probes nothing
        assert dataclasses.replace(plan, precision=None) == want
    nonempty = [(a, b) for system in plan.microbatch_slices for a, b in system if b > a]
    split = next(n for n in cm.graph_module.graph.nodes
                 if n.op == "call_function" and n.target.__name__ == "split")
    assert list(split.kwargs["slices"]) == nonempty
    rows: list[int] = []
    handle = model.inp.register_forward_pre_hook(
        mbcompile.per_microbatch(lambda mod, args: rows.append(args[0].shape[0])))
    x, y = _tiny_batch(gbs, seed=1)
    try:
        loss, pred = cm(x, y)
    finally:
        handle.remove()
    assert rows == [b - a for a, b in nonempty]  # each microbatch once, in order
    assert max(rows) <= plan.mbs
    loss.backward()
    ref_loss, ref_pred = reference(x, y)
    ref_loss.backward()
    assert _rel_err(loss, ref_loss) <= REL
    assert _rel_err(pred, ref_pred) <= REL
    for p, q in zip(model.parameters(), reference.parameters()):
        assert _rel_err(p.grad, q.grad) <= REL


# --------------------------------------------------------------------------- #
# 2 and 3. random compositions of blocks
# --------------------------------------------------------------------------- #

D, T, V, C, HW = 6, 3, 11, 2, 4

PER_SAMPLE = ["linear", "layernorm", "gelu", "residual", "reshape", "scale", "merge_rows"]
MIXING = ["softmax0", "batchnorm", "center", "max0", "gram"]
INPUTS = ["features", "tokens", "image"]
LOSSES = ["mean", "sum", "cross_entropy", "mse", "none"]


class Composed(nn.Module):
    """input stage -> blocks -> loss, each picked by name."""

    def __init__(self, kind: str, blocks: list[str], loss: str) -> None:
        super().__init__()
        self.kind, self.names, self.loss = kind, list(blocks), loss
        if kind == "tokens":
            self.embed = nn.Embedding(V, D)
        elif kind == "image":
            self.conv = nn.Conv2d(C, 4, 3, padding=1)
            self.norm = nn.GroupNorm(2, 4)
            self.proj = nn.Linear(4 * HW * HW, D)
        else:
            self.embed = nn.Linear(5, D)
        self.layers = nn.ModuleList(self._layer(b) for b in blocks)

    @staticmethod
    def _layer(name: str) -> nn.Module:
        if name in ("linear", "residual", "merge_rows"):
            return nn.Linear(D, D)
        if name == "layernorm":
            return nn.LayerNorm(D)
        if name == "batchnorm":
            return nn.BatchNorm1d(D)
        return nn.Identity()

    def stem(self, x):
        if self.kind == "image":
            h = F.gelu(self.norm(self.conv(x)))
            return self.proj(h.view(h.size(0), -1))
        return self.embed(x)

    def block(self, name: str, layer: nn.Module, h):
        if name == "linear":
            return layer(h)
        if name == "layernorm":
            return layer(h)
        if name == "gelu":
            return F.gelu(h)
        if name == "residual":
            return h + torch.tanh(layer(h))
        if name == "reshape":
            return h.reshape(h.size(0), -1).view(h.shape) * 1.5
        if name == "scale":
            return h * 0.5 + 0.25
        if name == "merge_rows":  # (B, ..., D) -> (B * ..., D) -> back: batch-major rows
            rows = layer(h.reshape(-1, h.size(-1)))
            return rows.view(h.shape)
        # mixing ops
        if name == "softmax0":
            return torch.softmax(h, dim=0)
        if name == "batchnorm":  # over (B, D), or (B, D, T) for token sequences
            return layer(h.transpose(1, 2)).transpose(1, 2) if self.kind == "tokens" else layer(h)
        if name == "center":
            return h - h.mean(0)
        if name == "max0":
            return h - h.max(0).values
        if name == "gram":
            z = h.reshape(h.size(0), -1)
            return ((z @ z.T) @ z).view(h.shape) * 0.1
        raise KeyError(name)

    def forward(self, x, target):
        h = self.stem(x)
        for name, layer in zip(self.names, self.layers):
            h = self.block(name, layer, h)
        if self.loss == "none":
            return h
        if self.loss == "mean":
            loss = (h ** 2).mean()
        elif self.loss == "sum":
            loss = torch.tanh(h).sum() * 0.1
        elif self.loss == "cross_entropy":
            loss = F.cross_entropy(h.reshape(-1, D), target.reshape(-1), ignore_index=-100)
        else:
            loss = F.mse_loss(h, target)
        return loss, h


def _inputs(kind: str, loss: str, n: int, seed: int):
    g = torch.Generator().manual_seed(seed)
    if kind == "tokens":
        x = torch.randint(0, V, (n, T), generator=g)
        shape = (n, T)
    elif kind == "image":
        x = torch.randn(n, C, HW, HW, generator=g, dtype=DTYPE)
        shape = (n,)
    else:
        x = torch.randn(n, 5, generator=g, dtype=DTYPE)
        shape = (n,)
    if loss == "cross_entropy":
        target = torch.randint(0, D, shape, generator=g)
        target[torch.rand(shape, generator=g) < 0.25] = -100  # padding, uneven per microbatch
        target.view(-1)[0] = 1  # at least one counted target
    else:
        target = torch.randn(*shape, D, generator=g, dtype=DTYPE)
    return x, target


@st.composite
def plans(draw):
    gbs = draw(st.integers(1, 12))
    num_csx = draw(st.integers(1, min(16, gbs)))
    pbs = math.ceil(gbs / num_csx)
    mbs = draw(st.one_of(st.integers(1, pbs), st.sampled_from(["auto", "none"])))
    return gbs, num_csx, mbs


@st.composite
def compositions(draw, mixing: bool = False):
    kind = draw(st.sampled_from(INPUTS))
    blocks = draw(st.lists(st.sampled_from(PER_SAMPLE), min_size=0, max_size=4))
    if mixing:
        at = draw(st.integers(0, len(blocks)))
        blocks.insert(at, draw(st.sampled_from(MIXING)))
    loss = draw(st.sampled_from(LOSSES))
    return kind, blocks, loss


@BOUNDED
@given(composition=compositions(), plan=plans(), seed=st.integers(0, 3))
def test_random_per_sample_models_equal_eager(composition, plan, seed):
    kind, blocks, loss = composition
    gbs, num_csx, mbs = plan
    torch.manual_seed(seed)
    model = Composed(kind, blocks, loss).to(DTYPE)
    reference = copy.deepcopy(model)
    x, target = _inputs(kind, loss, gbs, seed)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", mbcompile.MbcompileWarning)
        cm = mbcompile.compile(model, gbs, num_csx, mbs,
                               example_inputs=_inputs(kind, loss, 4, seed + 1))
        got = cm(x, target)
    want = reference(x, target)
    if loss == "none":  # a per-sample output; the loss is taken outside the model
        assert _rel_err(got, want) <= REL
        (got ** 2).sum().backward()
        (want ** 2).sum().backward()
    else:
        assert _rel_err(got[0], want[0]) <= REL, (got[0].item(), want[0].item())
        assert _rel_err(got[1], want[1]) <= REL
        got[0].backward()
        want[0].backward()
    for (name, p), q in zip(model.named_parameters(), reference.parameters()):
        assert (p.grad is None) == (q.grad is None), name
        if q.grad is not None:
            assert _rel_err(p.grad, q.grad) <= REL, name


def _splitting(plan):
    """The plan, or one that splits the batch (gbs 1 cannot: use gbs 2)."""
    gbs, num_csx, mbs = plan
    if make_plan(gbs, num_csx, mbs).num_nonempty_microbatches == 1:
        return max(gbs, 2), 1, 1
    return gbs, num_csx, mbs


@BOUNDED
@given(composition=compositions(mixing=True), plan=plans())
def test_random_models_with_a_mixing_op_are_rejected(composition, plan):
    kind, blocks, loss = composition
    gbs, num_csx, mbs = _splitting(plan)
    torch.manual_seed(0)
    model = Composed(kind, blocks, loss).to(DTYPE)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", mbcompile.MbcompileWarning)
        with pytest.raises(MixingError) as info:
            mbcompile.compile(model, gbs, num_csx, mbs, example_inputs=_inputs(kind, loss, 4, 0),
                              coupling="reject")
    message = str(info.value)
    assert "why:" in message and "fix:" in message
    assert "test_properties.py" in message  # the user's line


def _squares(out):
    """The loss of a model that returns per-sample outputs, taken outside it."""
    return (out ** 2).sum()


@pytest.mark.slow
@BOUNDED
@given(composition=compositions(mixing=True), plan=plans(), seed=st.integers(0, 3))
def test_random_models_with_a_mixing_op_run_as_exact_two_phase_steps(composition, plan, seed):
    """By default the mixing compositions compile (a two-phase step) and equal eager."""
    kind, blocks, loss = composition
    gbs, num_csx, mbs = _splitting(plan)
    torch.manual_seed(seed)
    model = Composed(kind, blocks, loss).to(DTYPE)
    x, target = _inputs(kind, loss, gbs, seed)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", mbcompile.MbcompileWarning)
        cm = mbcompile.compile(model, gbs, num_csx, mbs,
                               example_inputs=_inputs(kind, loss, 4, seed + 1))
        assert cm.analysis.rejected is not None and "two-phase step" in cm.plan.reason
        errors = step_errors(model, cm, (x, target), floor=GRAD_FLOOR, scale=SCALE_FLOOR,
                             loss=_squares if loss == "none" else None)
    assert_close_errors(errors, REL)


class Reorder(nn.Module):
    """One op between two Linear layers; its output is returned per sample."""

    def __init__(self, op) -> None:
        super().__init__()
        self.op = op
        self.inp = nn.Linear(5, D)
        self.out = nn.Linear(D, D)

    def forward(self, x):
        return self.out(self.op(self.inp(x)))


# Each of these couples samples (sample i's output depends on another sample), so
# splitting the batch changes the answer: with coupling="reject" they must be rejected,
# never run; by default they run as two-phase steps, equal to eager (but repeat_batch,
# whose output interleaves the samples' rows, which is rejected either way).
REORDERING = {
    "flip_batch": lambda h: torch.flip(h, [0]),
    "flip_batch_method": lambda h: h.flip(0),
    "roll_batch": lambda h: torch.roll(h, 1, 0),
    "roll_flat": lambda h: torch.roll(h, 1),
    "tril": lambda h: torch.tril(h),
    "triu_method": lambda h: h.triu(1),
    "repeat_batch": lambda h: h.repeat(2, 1),
    "cumsum_batch": lambda h: torch.cumsum(h, 0),
    "sort_batch": lambda h: torch.sort(h, 0).values,
    "slice_batch": lambda h: torch.cat([h[1:], h[:1]]),
}


@pytest.mark.parametrize("name", sorted(REORDERING))
def test_ops_that_reorder_samples_are_rejected(name):
    torch.manual_seed(0)
    model = Reorder(REORDERING[name]).to(DTYPE)
    x = torch.randn(8, 5, dtype=DTYPE)
    try:
        cm = mbcompile.compile(model, 8, 2, 2, example_inputs=(x,), coupling="reject")
    except MixingError:
        return
    with torch.no_grad():
        got, want = cm(x), model(x)
    exact = got.shape == want.shape and _rel_err(got, want) <= REL
    pytest.fail(f"{name} was accepted; compiled output {'equals' if exact else 'DIFFERS FROM'} "
                "eager on this plan, but the op couples samples and must be rejected")


@pytest.mark.parametrize("name", sorted(set(REORDERING) - {"repeat_batch"}))
def test_ops_that_reorder_samples_run_as_exact_two_phase_steps(name):
    """gbs 8 over 3 systems, mbs 2: microbatches 2+1, 2+1, 1+1."""
    torch.manual_seed(0)
    model = Reorder(REORDERING[name]).to(DTYPE)
    x = torch.randn(8, 5, dtype=DTYPE)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", mbcompile.MbcompileWarning)  # no loss inside: retained
        cm = mbcompile.compile(model, 8, 3, 2, example_inputs=(x,))
        assert "two-phase step" in cm.plan.reason
        errors = step_errors(model, cm, (x,), floor=GRAD_FLOOR, scale=SCALE_FLOOR, loss=_squares)
    assert_close_errors(errors, REL)


def test_repeat_over_the_batch_is_rejected_by_default():
    torch.manual_seed(0)
    x = torch.randn(8, 5, dtype=DTYPE)
    with pytest.raises(MixingError):
        mbcompile.compile(Reorder(REORDERING["repeat_batch"]).to(DTYPE), 8, 3, 2,
                          example_inputs=(x,))


class Squeezed(nn.Module):
    """A binary classifier whose (B, 1) logits are squeezed: the usual way to get (B,)."""

    def __init__(self, squeeze) -> None:
        super().__init__()
        self.squeeze = squeeze
        self.lin = nn.Linear(5, 1)

    def forward(self, x, y):
        logits = self.squeeze(self.lin(x))
        return F.binary_cross_entropy_with_logits(logits, y.view(logits.shape)), logits


SQUEEZES = {
    "squeeze_all": lambda h: h.squeeze(),
    "squeeze_batch_dim": lambda h: h.squeeze(0),
    "torch_squeeze_all": lambda h: torch.squeeze(h),
}


@pytest.mark.parametrize("name", sorted(SQUEEZES))
def test_squeeze_that_can_drop_the_batch_dim_is_rejected_or_exact(name):
    """gbs 5, mbs 2: the last microbatch holds one sample, and squeeze() drops its batch dim."""
    torch.manual_seed(0)
    model = Squeezed(SQUEEZES[name]).to(DTYPE)
    g = torch.Generator().manual_seed(1)
    x, y = torch.randn(5, 5, generator=g, dtype=DTYPE), torch.rand(5, generator=g, dtype=DTYPE)
    try:
        cm = mbcompile.compile(model, 5, 1, 2, example_inputs=(x, y))
    except MixingError as err:
        assert "squeeze" in str(err)
        return
    try:
        got = cm(x, y)
    except Exception as err:
        pytest.fail(f"compiled, then the call failed on the one-sample microbatch: "
                    f"{type(err).__name__}: {err}")
    want = model(x, y)
    assert _rel_err(got[0], want[0]) <= REL and _rel_err(got[1], want[1]) <= REL


def test_squeeze_of_a_non_batch_dim_is_accepted_and_exact():
    torch.manual_seed(0)
    model = Squeezed(lambda h: h.squeeze(-1)).to(DTYPE)
    g = torch.Generator().manual_seed(1)
    x, y = torch.randn(5, 5, generator=g, dtype=DTYPE), torch.rand(5, generator=g, dtype=DTYPE)
    reference = copy.deepcopy(model)
    cm = mbcompile.compile(model, 5, 1, 2, example_inputs=(x, y))
    got, want = cm(x, y), reference(x, y)
    assert _rel_err(got[0], want[0]) <= REL and _rel_err(got[1], want[1]) <= REL
    got[0].backward()
    want[0].backward()
    for p, q in zip(model.parameters(), reference.parameters()):
        assert _rel_err(p.grad, q.grad) <= REL


@pytest.mark.parametrize("name", ["flip_features", "roll_features", "tril_per_sample"])
def test_the_same_ops_on_non_batch_dims_are_accepted_and_exact(name):
    ops = {
        "flip_features": lambda h: torch.flip(h, [1]),
        "roll_features": lambda h: torch.roll(h, 1, 1),
        "tril_per_sample": lambda h: torch.tril(h.view(h.size(0), 2, 3)).flatten(1),
    }
    torch.manual_seed(0)
    model = Reorder(ops[name]).to(DTYPE)
    x = torch.randn(8, 5, dtype=DTYPE)
    cm = mbcompile.compile(model, 8, 2, 2, example_inputs=(x,))
    with torch.no_grad():
        assert _rel_err(cm(x), model(x)) <= REL
