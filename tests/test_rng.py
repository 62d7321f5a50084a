"""Random draws in forward happen once per step, as eager makes them (passes/draws.py).

A draw that reads no sample's data (``torch.rand(B, 1)``, ``torch.randn(h.shape,
generator=self.g)``, ``torch.randperm(B)``, a batch-free ``torch.randn(4)``) is drawn
once, at the full batch, before the microbatch loop, and handed to the body (its rows)
and to the coupled part (the same tensor): the returned ``r`` is the one that made
``pred``, and a generator advances as in eager. Seeding in forward is refused before
anything changes.

Each case: three steps of the compiled module against three eager full-batch steps of a
copy, float64, gbs 7 over 2 systems, MBS 2 (microbatches 2, 2 | 2, 1), an SGD step
between them: the loss, every output (``r`` itself), every ``.grad``, the model's
generator state and the global RNG state after each step.
"""

from __future__ import annotations

import copy
import warnings
from typing import Any

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F
from models import plan_free
from test_forward_semantics import NoisyBlock  # tanh(lin(h)) * (1 + 0.1 * randn(h.shape, g))

import mbcompile
from mbcompile import CaptureError

GBS, SYSTEMS, MBS = 7, 2, 2
DTYPE = torch.float64
LR = 0.1


class Scaled(nn.Module):
    """``pred = net(x) * r`` with ``r`` drawn per sample, returned; ``coupled`` adds a loss
    term over in-batch similarities (a two-phase step)."""

    def __init__(self, draw: str, coupled: bool) -> None:
        super().__init__()
        self.a, self.b = nn.Linear(4, 4), nn.Linear(4, 4)
        self.draw, self.coupled = draw, coupled
        self.g = torch.Generator().manual_seed(3)

    def noise(self, h: torch.Tensor) -> torch.Tensor:
        if self.draw == "global":
            return torch.rand(h.size(0), 1, dtype=h.dtype)
        if self.draw == "randn":  # 28 values: CPU randn fills 16 at a time
            return torch.randn(h.shape, generator=self.g, dtype=h.dtype)
        if self.draw == "randperm":  # each sample's place in a permutation of the batch
            perm = torch.randperm(h.size(0), generator=self.g)
            return 1 + perm.unsqueeze(1).to(h.dtype) / 8
        if self.draw == "shared":  # batch-free: one row for every sample
            return torch.randn(4, generator=self.g, dtype=h.dtype)
        if self.draw == "in_place":
            return h.new_empty(h.shape).normal_(generator=self.g)
        raise ValueError(self.draw)

    def forward(self, x: torch.Tensor, y: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        h = torch.tanh(self.a(x))
        r = self.noise(h)
        pred = self.b(h * r)
        loss = F.mse_loss(pred, y)
        if self.coupled:
            z = F.normalize(pred, dim=1)
            loss = loss + 0.1 * (z @ z.T).logsumexp(1).mean() + 0.01 * (r * r).sum()
        return loss, r


class Blocks(nn.Module):
    """Repeated blocks (what ``recompute=True`` checkpoints), each drawing from the model's
    generator, and a permutation of the batch mixing samples (mixup: coupled)."""

    def __init__(self, mix: bool) -> None:
        super().__init__()
        self.g = torch.Generator().manual_seed(3)
        self.blocks = nn.ModuleList([NoisyBlock(self.g) for _ in range(3)])
        self.mix = mix

    def forward(self, x: torch.Tensor, y: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        h = x
        for block in self.blocks:
            h = block(h)
        loss = F.mse_loss(h, y)
        if self.mix:
            perm = torch.randperm(h.size(0), generator=self.g)
            loss = loss + 0.1 * F.mse_loss(h, h[perm].detach())
            return loss, perm
        return loss, h


def _batch() -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(1)
    return torch.randn(GBS, 4, generator=g, dtype=DTYPE), torch.randn(GBS, 4, generator=g,
                                                                      dtype=DTYPE)


def _compile(model: nn.Module, **kw: Any) -> Any:
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", mbcompile.MbcompileWarning)  # two-phase memory notes
        return mbcompile.compile(model, GBS, SYSTEMS, MBS, example_inputs=_batch(),
                                 **plan_free(MBS, **kw))


def _step(call: Any, module: nn.Module, seed: int) -> tuple[Any, dict[str, Any], torch.Tensor]:
    module.zero_grad(set_to_none=True)
    torch.manual_seed(seed)
    out = call(*_batch())
    out[0].backward()
    grads = {n: None if p.grad is None else p.grad.clone() for n, p in module.named_parameters()}
    return out, grads, torch.get_rng_state()


def assert_three_steps_exact(model: nn.Module, exact_out: bool = True, **kw: Any) -> Any:
    ref = copy.deepcopy(model)
    cm = _compile(model, **kw)
    for step in range(3):
        (loss, out), grads, rng = _step(cm, model, step)
        (want_loss, want_out), want_grads, want_rng = _step(ref, ref, step)
        torch.testing.assert_close(loss, want_loss, rtol=1e-10, atol=0)
        assert out.dtype == want_out.dtype and out.requires_grad == want_out.requires_grad
        if exact_out:  # the very draw
            assert torch.equal(out, want_out), f"the returned draw, step {step}"
        else:
            torch.testing.assert_close(out, want_out, rtol=1e-10, atol=1e-13)
        for name, want in want_grads.items():
            got = grads[name]
            assert (got is None) == (want is None), name
            if want is not None:
                torch.testing.assert_close(got, want, rtol=1e-10, atol=1e-13, msg=name)
        assert torch.equal(model.g.get_state(), ref.g.get_state()), f"generator, step {step}"
        assert torch.equal(rng, want_rng), f"global RNG state, step {step}"
        with torch.no_grad():
            for m in (model, ref):
                for p in m.parameters():
                    p -= LR * p.grad
    return cm


@pytest.mark.parametrize("coupled", [False, True], ids=["split", "two_phase"])
@pytest.mark.parametrize("draw", ["global", "randn", "randperm", "shared", "in_place"])
def test_a_draw_is_made_once_and_carried(draw, coupled):
    torch.manual_seed(0)
    cm = assert_three_steps_exact(Scaled(draw, coupled).to(DTYPE))
    assert cm.analysis.two_phase == coupled
    top = cm.graph_module.code  # drawn in the top graph, before the split: once per step
    drawn = [top.index(op) for op in ("rand", "normal_") if op in top]
    assert drawn and min(drawn) < top.index("split")


@pytest.mark.parametrize("draw", ["shared", "in_place"])  # (randn(h.shape): export fails)
def test_a_draw_from_the_models_generator_is_exact_under_export(draw):
    """torch.export lifts a copy of ``self.g``: the graph drew from the copy, so the capture
    refused it as a generator forward made ("Fix: make it in __init__", as it was). The
    copy is the model's own again, the one whose state it has."""
    torch.manual_seed(0)
    assert_three_steps_exact(Scaled(draw, False).to(DTYPE), capture="export")


@pytest.mark.parametrize("mix", [False, True], ids=["per_sample", "mixup"])
def test_draws_in_recomputed_blocks_are_exact(mix):
    torch.manual_seed(0)
    cm = assert_three_steps_exact(Blocks(mix).to(DTYPE), exact_out=mix, recompute=True)
    assert cm.analysis.two_phase == mix
    if not mix:  # (a two-phase step runs its body twice instead)
        assert cm.plan.recompute and "checkpoint" in cm.graph_module.body.code


class _LayerAndGenerator(nn.Module):
    """A linear layer ``a`` and a model-owned generator ``g``; forward is the test's."""

    def __init__(self) -> None:
        super().__init__()
        self.a = nn.Linear(4, 4)
        self.g = torch.Generator().manual_seed(3)


def test_a_draw_that_reads_the_samples_is_carried_to_the_coupled_part():
    """``torch.bernoulli(p)`` of per-sample ``p`` is drawn per microbatch (the one documented
    difference from eager's stream), and the coupled part reads those very draws, returned."""

    class Masked(_LayerAndGenerator):
        def forward(self, x, y):
            h = self.a(x)
            mask = torch.bernoulli(torch.sigmoid(h).detach(), generator=self.g)
            z = F.normalize(h * mask, dim=1)
            return (z @ z.T).logsumexp(1).mean() + F.mse_loss(h, y), mask, h * mask

    torch.manual_seed(0)
    model = Masked().to(DTYPE)
    cm = _compile(model)
    assert cm.analysis.two_phase
    loss, mask, masked = cm(*_batch())
    loss.backward()
    h = model.a(_batch()[0])
    torch.testing.assert_close(masked, h * mask)  # the mask that made the loss
    assert set(mask.unique().tolist()) <= {0.0, 1.0}


def test_a_fill_of_a_tensor_like_a_batched_one_from_the_models_generator_is_refused():
    """``torch.empty_like(h).normal_(generator=g)``: its numbers depend on the strides h has
    at the full batch, which the graph does not keep, so it cannot be drawn once before the
    loop (as ``h.new_empty(h.shape).normal_(generator=g)`` is): refused, nothing changed."""

    class Like(_LayerAndGenerator):
        def forward(self, x, y):
            h = self.a(x)
            return F.mse_loss(h + 0.1 * torch.empty_like(h).normal_(generator=self.g), y)

    torch.manual_seed(0)
    model = Like().to(DTYPE)
    rng, g = torch.get_rng_state(), model.g.get_state()
    params = [p.detach().clone() for p in model.parameters()]
    with pytest.raises(CaptureError, match=r"empty_like.*test_rng.py.*h.new_empty\(h.shape\)"):
        _compile(model)
    assert torch.equal(torch.get_rng_state(), rng) and torch.equal(model.g.get_state(), g)
    assert all(torch.equal(p, q) for p, q in zip(model.parameters(), params))
    assert all(p.grad is None for p in model.parameters())


class Seeding(nn.Module):
    def __init__(self, how: str) -> None:
        super().__init__()
        self.a, self.how = nn.Linear(4, 4), how
        self.g = torch.Generator().manual_seed(3)

    def forward(self, x, y):
        if self.how == "manual_seed":
            torch.manual_seed(0)
        elif self.how == "generator":
            self.g.manual_seed(0)
        if self.how == "fork_rng":
            with torch.random.fork_rng(devices=[]):
                r = torch.rand(x.size(0), 1, dtype=x.dtype)
        else:
            r = torch.rand(x[:, :1].shape, generator=self.g, dtype=x.dtype)
        return F.mse_loss(self.a(x) * r, y), r


@pytest.mark.parametrize("how", ["manual_seed", "generator", "fork_rng"])
def test_seeding_in_forward_is_refused_with_nothing_changed(how):
    torch.manual_seed(0)
    model = Seeding(how).to(DTYPE)
    rng, g = torch.get_rng_state(), model.g.get_state()
    params = [p.detach().clone() for p in model.parameters()]
    with pytest.raises(CaptureError, match="seeds a random generator") as info:
        _compile(model)
    if how != "generator":  # a torch.Generator's method cannot be watched: found by its state
        assert "test_rng.py" in str(info.value)  # the line that seeds
    assert torch.equal(torch.get_rng_state(), rng) and torch.equal(model.g.get_state(), g)
    assert all(torch.equal(p, q) for p, q in zip(model.parameters(), params))


class Dropped(nn.Module):
    """Dropout (p = 0.5) in the body: the draws each microbatch makes there."""

    def __init__(self) -> None:
        super().__init__()
        self.a, self.b = nn.Linear(4, 4), nn.Linear(4, 4)

    def forward(self, x: torch.Tensor, y: torch.Tensor) -> tuple[torch.Tensor, ...]:
        return (F.mse_loss(self.b(F.dropout(torch.tanh(self.a(x)), 0.5, self.training)), y),)


@pytest.mark.slow
def test_a_failed_joint_graph_leaves_the_draws_to_the_step_that_reruns():
    """With ``torch_compile``, the joint graph fails at the second microbatch and the step
    reruns the autograd way: the first microbatch's draws are made again from the same
    state, so the step draws what a step run the autograd way from the start draws (the
    same gradients, bitwise, and the same global RNG state after it), not twice."""
    torch.manual_seed(0)
    model = Dropped().to(DTYPE)
    cm = _compile(model, torch_compile={"backend": "aot_eager"})
    joint = cm._compiled().channels.config.joint
    runs = []
    for broken in (True, False):  # the autograd way from the start; after a failed attempt
        tries: list[int] = []
        real = joint._step

        def failing(*args: Any, tries: list[int] = tries, real: Any = real) -> Any:
            tries.append(1)
            if len(tries) == 2:
                raise RuntimeError("no joint graph for this op")
            return real(*args)

        joint.broken, joint._step = ("forced" if broken else None), failing
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            out, grads, rng = _step(cm, model, seed=5)
        joint._step = real
        assert len(tries) == (0 if broken else 2)
        runs.append((out, grads, rng))
    (out_a, grads_a, rng_a), (out_b, grads_b, rng_b) = runs
    assert torch.equal(rng_a, rng_b)
    assert torch.equal(out_a[0].detach(), out_b[0].detach())
    assert all(torch.equal(grads_a[n], grads_b[n]) for n in grads_a)
