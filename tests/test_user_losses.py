"""What users reasonably expect to run: gradient penalties, Gaussian NLL, CTC, diffusion
schedules, splits with sizes; exact, or refused for the right reason with nothing changed.

Each exact case: three steps of the compiled module against three eager full-batch steps of
a copy, float64, on an uneven plan (gbs 7 over 2 systems, MBS 2: microbatches 2, 2 | 2, 1;
and gbs 7 on one system, MBS 3: 3, 3, 1), an optimizer step (SGD or Adam) between them: the
loss, every output, every ``.grad`` (None too), every buffer and every parameter after
the step. A refusal leaves parameters, gradients and buffers as they were.
"""

from __future__ import annotations

import copy
import warnings
from collections.abc import Callable
from typing import Any

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F
from models import plan_free

import mbcompile
from mbcompile import CaptureError, MicrobatchError, MixingError

GBS, DTYPE = 7, torch.float64
PLANS = {"two_systems": (2, 2), "one_system": (1, 3)}  # (num_csx, mbs): 2,2|2,1 and 3,3,1
Batch = Callable[[int], tuple[Any, ...]]


def _optimizer(kind: str, model: nn.Module) -> torch.optim.Optimizer:
    if kind == "adam":
        return torch.optim.Adam(model.parameters(), lr=0.01)
    return torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)


def _step(call: Callable[..., Any], model: nn.Module, opt: torch.optim.Optimizer,
          batch: tuple[Any, ...], seed: int) -> dict[str, Any]:
    """One training step from no gradients: what it returned, the gradients it left, then
    the parameters and buffers after the optimizer's step."""
    opt.zero_grad(set_to_none=True)
    torch.manual_seed(seed)
    out = call(*batch)
    outs = out if isinstance(out, tuple) else (out,)
    outs[0].backward()
    seen = {f"out[{i}]": o.detach().clone() for i, o in enumerate(outs)}
    seen.update({f"grad {n}": None if p.grad is None else p.grad.clone()
                 for n, p in model.named_parameters()})
    opt.step()
    seen.update({f"param {n}": p.detach().clone() for n, p in model.named_parameters()})
    seen.update({f"buffer {n}": b.clone() for n, b in model.named_buffers()})
    return seen


def _compile(model: nn.Module, batch: tuple[Any, ...], plan: str, **kw: Any) -> Any:
    systems, mbs = PLANS[plan]
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", mbcompile.MbcompileWarning)  # retained activations
        return mbcompile.compile(model, GBS, systems, mbs, example_inputs=batch,
                                 **plan_free(mbs, **kw))


def assert_three_steps_exact(make: Callable[[], nn.Module], batch: Batch, plan: str,
                             optimizer: str = "sgd", **kw: Any) -> Any:
    torch.manual_seed(0)
    model = make().to(DTYPE)
    ref = copy.deepcopy(model)
    opts = _optimizer(optimizer, model), _optimizer(optimizer, ref)
    cm = _compile(model, batch(0), plan, **kw)
    for step in range(3):
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", mbcompile.MbcompileWarning)
            got = _step(cm, model, opts[0], batch(step), step)
        want = _step(ref, ref, opts[1], batch(step), step)
        assert got.keys() == want.keys()
        for name, w in want.items():
            g = got[name]
            assert (g is None) == (w is None), f"{name}, step {step}"
            if w is not None:
                torch.testing.assert_close(g, w, rtol=1e-10, atol=1e-12,
                                           msg=f"{name}, step {step}")
    return cm


def assert_refused_unchanged(make: Callable[[], nn.Module], batch: tuple[Any, ...],
                             error: type[Exception], match: str, **kw: Any) -> Exception:
    torch.manual_seed(0)
    model = make().to(DTYPE)
    state = {k: v.clone() for k, v in model.state_dict().items()}
    with pytest.raises(error, match=match) as info:
        _compile(model, batch, "two_systems", **kw)
    assert all(torch.equal(v, state[k]) for k, v in model.state_dict().items())
    assert all(p.grad is None for p in model.parameters())
    return info.value


# --------------------------------------------------------------------------- #
# 1. Gradient penalties: torch.autograd.grad(..., create_graph=True) in forward
# --------------------------------------------------------------------------- #

def _critic(norm: str = "none") -> nn.Module:
    layers = {"none": nn.Tanh(), "bn": nn.BatchNorm1d(8), "ln": nn.LayerNorm(8)}
    return nn.Sequential(nn.Linear(4, 8), layers[norm], nn.Tanh(), nn.Linear(8, 1))


class R1(nn.Module):
    """R1 on real inputs (StyleGAN): ``grad(d(x).sum(), x)``, its squared norm per sample."""

    def __init__(self, norm: str = "none", of: str = "sum", fused: bool = False) -> None:
        super().__init__()
        self.d, self.of, self.fused = _critic(norm), of, fused

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        x = x.detach().requires_grad_(True)
        out = self.d(x)
        target = out.mean() if self.of == "mean" else out.sum()
        (grad,) = torch.autograd.grad(target, x, create_graph=True)  # the penalty's line
        if self.fused:  # one mean: its backward runs inside the call, per microbatch
            return (F.softplus(-out[:, 0]) + 5 * grad.pow(2).flatten(1).sum(1)).mean(), out
        penalty = grad.pow(2).flatten(1).sum(1).mean()
        return F.softplus(-out).mean() + 5 * penalty, out


class ConvR1(nn.Module):
    """R1 on images through a convolution: the gradient is (B, C, H, W)."""

    def __init__(self) -> None:
        super().__init__()
        self.conv, self.head = nn.Conv2d(2, 3, 3, padding=1), nn.Linear(3 * 16, 1)

    def forward(self, img: torch.Tensor) -> torch.Tensor:
        img = img.detach().requires_grad_(True)
        out = self.head(torch.tanh(self.conv(img)).flatten(1))
        grad = torch.autograd.grad(out.sum(), img, create_graph=True)[0]
        return F.softplus(-out).mean() + 5 * grad.pow(2).flatten(1).sum(1).mean()


class WGANGP(nn.Module):
    """WGAN-GP: the critic's gradient on interpolates of real and fake samples, seeded with
    ``grad_outputs=ones_like``; the interpolation weights are drawn in forward."""

    def __init__(self) -> None:
        super().__init__()
        self.d = _critic("ln")

    def forward(self, real: torch.Tensor, fake: torch.Tensor
                ) -> tuple[torch.Tensor, torch.Tensor]:
        alpha = torch.rand_like(real[:, :1])
        mixed = (alpha * real + (1 - alpha) * fake).requires_grad_(True)
        d_mixed = self.d(mixed)
        grad = torch.autograd.grad(d_mixed, mixed, grad_outputs=torch.ones_like(d_mixed),
                                   create_graph=True)[0]
        gp = ((grad.norm(2, dim=1) - 1) ** 2).mean()
        return self.d(fake).mean() - self.d(real).mean() + 10 * gp, d_mixed


def _features(step: int) -> tuple[torch.Tensor]:
    return (torch.randn(GBS, 4, generator=torch.Generator().manual_seed(step), dtype=DTYPE),)


def _images(step: int) -> tuple[torch.Tensor]:
    g = torch.Generator().manual_seed(step)
    return (torch.randn(GBS, 2, 4, 4, generator=g, dtype=DTYPE),)


def _pairs(step: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(step)
    return (torch.randn(GBS, 4, generator=g, dtype=DTYPE),
            torch.randn(GBS, 4, generator=g, dtype=DTYPE))


@pytest.mark.parametrize("plan", PLANS)
@pytest.mark.parametrize("case", ["r1", "r1_fused", "conv_r1", "wgan_gp"])
def test_a_gradient_penalty_is_exact(case, plan):
    make, batch = {"r1": (R1, _features), "r1_fused": (lambda: R1(fused=True), _features),
                   "conv_r1": (ConvR1, _images), "wgan_gp": (WGANGP, _pairs)}[case]
    cm = assert_three_steps_exact(make, batch, plan, optimizer="adam" if case == "r1" else "sgd")
    assert cm.analysis.fused == (case == "r1_fused")
    assert "autograd.grad" in cm.graph_module.body.code or "grad_of_sums" in \
        cm.graph_module.body.code  # taken inside the body, per microbatch


@pytest.mark.parametrize("option", ["torch_compile", "recompute"])
def test_a_gradient_penalty_is_exact_with_torch_compile_and_recompute(option):
    """torch.compile has no double backward: a body that takes a gradient is left to
    autograd (not compiled, no joint graph); ``recompute`` checkpoints through it."""
    kw = {"torch_compile": True} if option == "torch_compile" else {"recompute": True}
    assert_three_steps_exact(WGANGP, _pairs, "two_systems", **kw)


@pytest.mark.slow
@pytest.mark.parametrize("case", [pytest.param("gaussian", marks=pytest.mark.zoo), "ctc"])
def test_gaussian_and_ctc_are_exact_with_torch_compile(case):
    make, batch = (GaussianNLL, _pairs) if case == "gaussian" else (CTC, _ctc_batch)
    assert_three_steps_exact(make, batch, "two_systems", torch_compile=True)


class Energy(nn.Module):
    """An energy model's score (denoising score matching): the input gradient taken inside
    ``torch.enable_grad()``, so that eager's forward runs under ``torch.no_grad()`` too."""

    def __init__(self) -> None:
        super().__init__()
        self.d = _critic()

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        with torch.enable_grad():
            xr = x.detach().requires_grad_(True)
            e = self.d(xr)
            (score,) = torch.autograd.grad(e.sum(), xr, create_graph=True)
        return (score.pow(2).sum(1) + e[:, 0]).mean(), score


def test_an_energy_models_score_is_eagers_under_no_grad():
    """Evaluated under ``torch.no_grad()`` it failed ("element 0 of tensors does not require
    grad"): the graph keeps no switch for the ``enable_grad()`` region, so the body now
    runs with grad on for such a call, its outputs detached: eager's loss, made outside the
    region, carries no graph either; its score, made inside, does (docs/limits.md)."""
    cm = assert_three_steps_exact(Energy, _features, "two_systems")
    cm.module.zero_grad(set_to_none=True)
    eager = copy.deepcopy(cm.module)
    for n in (GBS, 4):
        (x,) = _features(n)
        x = x[:n]
        with torch.no_grad():
            got, want = cm(x), eager(x)
        assert [t.requires_grad for t in got] == [False, False]
        assert [t.requires_grad for t in want] == [False, True]
        for g, w in zip(got, want):
            torch.testing.assert_close(g, w.detach(), rtol=1e-12, atol=0)
    assert all(p.grad is None for p in cm.module.parameters())


def test_a_gradient_penalty_is_planned_by_the_cost_model():
    """The cost model's fake-tensor probes run the double backward too (mbs='auto')."""
    torch.manual_seed(0)
    cm = mbcompile.compile(R1().to(DTYPE), GBS, 2, "auto", example_inputs=_features(0),
                           compile_only=True)
    assert cm.plan.mbs >= 1


@pytest.mark.parametrize("case, match", [
    ("bn", "the function it differentiates couples samples .*BatchNorm"),
    ("mean", "a mean divides each sample's gradient by the batch size"),
])
def test_a_penalty_over_coupled_samples_is_refused(case, match):
    """BatchNorm in training inside the critic, or the gradient of a batch mean: each
    microbatch's gradient would differ; the analysis proves it and refuses at the line."""
    make = (lambda: R1(norm="bn")) if case == "bn" else (lambda: R1(of="mean"))
    err = assert_refused_unchanged(make, _features(0), MixingError, match)
    assert "the penalty's line" in str(err)


class PenaltyWithCoupledLoss(nn.Module):
    """A penalty beside a loss over in-batch similarities (a two-phase step)."""

    def __init__(self) -> None:
        super().__init__()
        self.d = _critic()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x.detach().requires_grad_(True)
        out = self.d(x)
        grad = torch.autograd.grad(out.sum(), x, create_graph=True)[0]
        z = F.normalize(torch.cat([out, x[:, :1]], 1), dim=1)
        return (z @ z.T).logsumexp(1).mean() + grad.pow(2).sum(1).mean()


def test_a_refused_penalty_runs_exactly_unsplit_as_its_fix_says():
    """A coupled step's penalty is refused with ``mbs='none'`` on one system among the
    fixes: the whole batch in one microbatch takes eager's very gradient."""
    torch.manual_seed(0)
    model = PenaltyWithCoupledLoss().to(DTYPE)
    ref = copy.deepcopy(model)
    cm = mbcompile.compile(model, GBS, 1, "none", example_inputs=_features(0))
    cm(*_features(0)).backward()
    ref(*_features(0)).backward()
    for p, q in zip(model.parameters(), ref.parameters()):
        torch.testing.assert_close(p.grad, q.grad, rtol=1e-12, atol=0)


class PenaltyOnInput(nn.Module):
    """``x.requires_grad_()`` on the caller's own input: eager then writes ``x.grad``."""

    def __init__(self) -> None:
        super().__init__()
        self.d = _critic()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x.requires_grad_(True)
        grad = torch.autograd.grad(self.d(x).sum(), x, create_graph=True)[0]
        return grad.pow(2).sum(1).mean()


class ParameterPenalty(nn.Module):
    """A penalty on the gradient of a parameter: it sums over the samples."""

    def __init__(self) -> None:
        super().__init__()
        self.d = _critic()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = self.d(x)
        grad = torch.autograd.grad(out.sum(), self.d[0].weight, create_graph=True)[0]
        return out.mean() + grad.pow(2).sum()


class InnerBackward(nn.Module):
    """``loss.backward()`` inside forward: it would write ``.grad`` in the middle of a step."""

    def __init__(self) -> None:
        super().__init__()
        self.d = _critic()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        loss = self.d(x).mean()
        loss.backward(retain_graph=True)
        return loss


@pytest.mark.parametrize("make, error, match", [
    (PenaltyWithCoupledLoss, MixingError, "the step's loss couples samples"),
    (PenaltyOnInput, MixingError, "the caller's own input"),
    (ParameterPenalty, MixingError, "with respect to a value that is not per-sample"),
    (InnerBackward, CaptureError, "runs a backward inside forward"),
], ids=["two_phase", "input_requires_grad", "parameter", "backward"])
def test_a_differentiation_that_cannot_run_per_microbatch_is_refused(make, error, match):
    assert_refused_unchanged(make, _features(0), error, match, capture="fx")


def test_a_penalty_under_export_is_refused_with_the_fx_way():
    err = assert_refused_unchanged(R1, _features(0), CaptureError, "torch.export cannot "
                                   "capture", capture="export")
    assert "capture='fx'" in str(err)


@pytest.mark.parametrize("plan", ["two_systems", "two_phase"])
def test_a_penalty_on_the_steps_gradients_is_refused_and_loses_nothing(plan):
    """``grad(loss, params, create_graph=True)`` outside the model (a penalty on the step's
    gradients): the step's gradients were built in forward, with no graph to
    differentiate, so the backward is refused (it raised torch's "does not require grad"
    at the user's next line before); the ``.grad`` a step left stay, and the same loss then
    backpropagates as eager's."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 8), nn.Tanh(), nn.Linear(8, 1)).to(DTYPE)
    net = (Coupled if plan == "two_phase" else PerSample)(model)
    ref = copy.deepcopy(net)
    cm = _compile(net, _features(0), "two_systems")
    cm(*_features(1)).backward()
    ref(*_features(1)).backward()
    before = [p.grad.clone() for p in net.parameters()]
    loss = cm(*_features(2))
    with pytest.raises(MicrobatchError, match="create_graph=True.*inside the model's forward"):
        torch.autograd.grad(loss, list(cm.parameters()), create_graph=True)
    assert all(torch.equal(p.grad, b) for p, b in zip(net.parameters(), before))
    loss.backward()
    ref(*_features(2)).backward()
    for got, want in zip(net.parameters(), ref.parameters()):
        torch.testing.assert_close(got.grad, want.grad, rtol=1e-10, atol=1e-12)


class PerSample(nn.Module):
    """A per-sample loss (a plain fused step)."""

    def __init__(self, d: nn.Module) -> None:
        super().__init__()
        self.d = d

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.d(x).square().mean()


class Coupled(PerSample):
    """A loss that couples samples (its square root: a two-phase step)."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.d(x).square().mean().sqrt()


# --------------------------------------------------------------------------- #
# 2. Gaussian NLL and CTC
# --------------------------------------------------------------------------- #

class GaussianNLL(nn.Module):
    """A mean and a variance head; ``var`` per element, per row (homoscedastic), or the
    loss module."""

    def __init__(self, reduction: str = "mean", var: str = "element", full: bool = False,
                 eps: float = 1e-6, module: bool = False) -> None:
        super().__init__()
        self.net = nn.Linear(4, 8)
        self.reduction, self.var, self.full, self.eps = reduction, var, full, eps
        self.loss = nn.GaussianNLLLoss(full=full, eps=eps, reduction=reduction) if module \
            else None

    def forward(self, x: torch.Tensor, y: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        h = self.net(x)
        mu, var = h[:, :4], F.softplus(h[:, 4:]) ** 2
        if self.var == "row":
            var = var.mean(1)
        if self.loss is not None:
            return self.loss(mu, y, var), mu
        return F.gaussian_nll_loss(mu, y, var, full=self.full, eps=self.eps,
                                   reduction=self.reduction), mu


GAUSSIANS = {
    "mean": dict(),
    "sum_full_eps": dict(reduction="sum", full=True, eps=0.05),
    "row_var": dict(var="row"),
    "module": dict(module=True, full=True),
}


@pytest.mark.parametrize("plan", PLANS)
@pytest.mark.parametrize("case", GAUSSIANS)
def test_gaussian_nll_loss_is_exact(case, plan):
    assert_three_steps_exact(lambda: GaussianNLL(**GAUSSIANS[case]), _pairs, plan,
                             optimizer="adam" if case == "mean" else "sgd")


def test_gaussian_nll_loss_with_a_negative_variance_raises_as_eager_and_changes_nothing():
    """The check ``var >= 0`` runs on each microbatch (torch's own): a negative variance in
    the last microbatch raises eager's ValueError (the cause of the step's MicrobatchError,
    which names the microbatch), and the step leaves nothing behind."""

    class Raw(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.net = nn.Linear(4, 4)

        def forward(self, x, y, var):
            return F.gaussian_nll_loss(self.net(x), y, var)

    torch.manual_seed(0)
    model = Raw().to(DTYPE)
    x, y = _pairs(0)
    var = torch.ones(GBS, 4, dtype=DTYPE)
    cm = _compile(model, (x, y, var), "two_systems")
    before = [p.detach().clone() for p in model.parameters()]
    var[-1, 0] = -1.0
    with pytest.raises(ValueError, match="var has negative entry"):
        model(x, y, var)
    with pytest.raises(mbcompile.MicrobatchError, match="var has negative entry") as info:
        cm(x, y, var)
    assert isinstance(info.value.__cause__, ValueError)
    assert all(torch.equal(p, q) and p.grad is None for p, q in zip(model.parameters(), before))


T_STEPS, LABELS, TARGET = 6, 5, 3


class CTC(nn.Module):
    """A frame classifier trained with CTC: (N, T, F) features -> (T, N, C) log-probs."""

    def __init__(self, reduction: str = "mean", zero_infinity: bool = False,
                 module: bool | str = False) -> None:
        super().__init__()
        self.net = nn.Linear(4, LABELS)
        self.reduction, self.zero_infinity, self.module = reduction, zero_infinity, module
        self.loss = nn.CTCLoss(reduction=reduction, zero_infinity=zero_infinity) if module \
            is True else None

    def forward(self, x, targets, input_lengths, target_lengths):
        log_probs = self.net(x).log_softmax(-1).transpose(0, 1)
        if self.module == "forward":  # made in forward, as transformers makes its losses
            loss = nn.CTCLoss(reduction=self.reduction, zero_infinity=self.zero_infinity)
            return loss(log_probs, targets, input_lengths, target_lengths), log_probs
        if self.loss is not None:
            return self.loss(log_probs, targets, input_lengths, target_lengths), log_probs
        return F.ctc_loss(log_probs, targets, input_lengths, target_lengths,
                          reduction=self.reduction, zero_infinity=self.zero_infinity), log_probs


def _ctc_batch(step: int, infeasible: bool = False) -> tuple[torch.Tensor, ...]:
    """Targets of lengths 1-3 (padded to 3; one of length 0 too), inputs of 4-6 frames; with
    ``infeasible`` one sample's input is shorter than its target (an infinite loss)."""
    g = torch.Generator().manual_seed(step)
    x = torch.randn(GBS, T_STEPS, 4, generator=g, dtype=DTYPE)
    targets = torch.randint(1, LABELS, (GBS, TARGET), generator=g)
    input_lengths = torch.randint(4, T_STEPS + 1, (GBS,), generator=g)
    target_lengths = torch.randint(1, TARGET + 1, (GBS,), generator=g)
    target_lengths[2] = 0
    if infeasible:
        input_lengths[5], target_lengths[5] = 1, 3
    return x, targets, input_lengths, target_lengths


CTCS = {
    "mean": (dict(), False),
    "sum": (dict(reduction="sum"), False),
    "module_mean": (dict(module=True), False),
    # fx had no name to call it by (NameError), and export refuses CTC: no path at all
    "module_made_in_forward": (dict(module="forward"), False),
    "zero_infinity": (dict(zero_infinity=True), True),
}


@pytest.mark.parametrize("plan", PLANS)
@pytest.mark.parametrize("case", CTCS)
def test_ctc_loss_is_exact(case, plan):
    """A mean CTC divides each sample's loss by its target length (at least 1), then
    averages over the batch: per-sample weights, then a mean the loop keeps global."""
    options, infeasible = CTCS[case]
    assert_three_steps_exact(lambda: CTC(**options), lambda s: _ctc_batch(s, infeasible),
                             plan, optimizer="adam" if case == "mean" else "sgd")


@pytest.mark.parametrize("case, match", [
    ("gaussian", "F.gaussian_nll_loss .*reads the variances' values"),
    ("ctc", "F.ctc_loss .*no shape-only kernel"),
    ("batch_norm", "'bn' has momentum=None in training"),
])
def test_losses_that_read_values_are_refused_under_export_with_the_fx_way(case, match):
    make, batch = {"gaussian": (GaussianNLL, _pairs(0)), "ctc": (CTC, _ctc_batch(0)),
                   "batch_norm": (CumulativeBatchNorm, _pairs(0))}[case]
    err = assert_refused_unchanged(make, batch, CaptureError, match, capture="export")
    assert "capture='fx'" in str(err)


# --------------------------------------------------------------------------- #
# 3. Diffusion schedules, splits with sizes, BatchNorm(momentum=None) in training
# --------------------------------------------------------------------------- #

class Diffusion(nn.Module):
    """DDPM training: ``alphas_cumprod[t]`` at a per-sample timestep, noise given."""

    def __init__(self) -> None:
        super().__init__()
        self.register_buffer("alphas_cumprod", torch.cumprod(1 - torch.linspace(1e-4, 0.2, 10),
                                                             0))
        self.net = nn.Sequential(nn.Linear(5, 16), nn.SiLU(), nn.Linear(16, 4))

    def forward(self, x0, noise, t):
        a = self.alphas_cumprod[t].view(-1, 1)
        noisy = a.sqrt() * x0 + (1 - a).sqrt() * noise
        pred = self.net(torch.cat([noisy, t.unsqueeze(1).to(x0.dtype) / 10], 1))
        return F.mse_loss(pred, noise), pred


def _diffusion_batch(step: int) -> tuple[torch.Tensor, ...]:
    x0, noise = _pairs(step)
    return x0, noise, torch.randint(0, 10, (GBS,), generator=torch.Generator().manual_seed(step))


class SplitHeads(nn.Module):
    """A VAE-style head: ``torch.split(h, [3, 5], dim=1)`` into a mean and a log-variance."""

    def __init__(self, dim: int = 1) -> None:
        super().__init__()
        self.net, self.dim = nn.Linear(4, 8), dim

    def forward(self, x, y):
        if self.dim == 0:  # a split of the batch itself
            a, b = torch.split(self.net(x), [3, GBS - 3], dim=0)
            return a.pow(2).mean() + b.mean()
        mu, logvar = torch.split(self.net(x), [3, 5], dim=1)
        kl = -0.5 * (1 + logvar - logvar.exp()).sum(1).mean()
        return F.mse_loss(mu, y[:, :3]) + 0.1 * kl + 0.01 * mu.pow(2).mean(), mu


@pytest.mark.parametrize("plan", PLANS)
@pytest.mark.parametrize("case", ["alphas_cumprod", "split_sizes"])
def test_schedules_and_splits_are_exact(case, plan):
    make, batch = {"alphas_cumprod": (Diffusion, _diffusion_batch),
                   "split_sizes": (SplitHeads, _pairs)}[case]
    assert_three_steps_exact(make, batch, plan, capture="fx")


def test_a_split_of_the_batch_dim_with_sizes_is_refused():
    """The sizes are a constant that must sum to the batch: a microbatch cannot be split so."""
    err = assert_refused_unchanged(lambda: SplitHeads(dim=0), _pairs(0), MixingError,
                                   "batch size is baked in")
    assert "torch.split" in str(err)


class CumulativeBatchNorm(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.net, self.bn = nn.Linear(4, 4), nn.BatchNorm1d(4, momentum=None)

    def forward(self, x, y):
        return F.mse_loss(self.bn(self.net(x)), y)


@pytest.mark.parametrize("plan", PLANS)
def test_batch_norm_with_a_cumulative_average_is_exact(plan):
    """``momentum=None`` weighs each step's statistics by ``1 / num_batches_tracked``, read
    as a Python number: the coupled part of a two-phase step reads the real counter once per
    step, as eager does (the fake runs that plan the split use any momentum: same shapes)."""
    cm = assert_three_steps_exact(CumulativeBatchNorm, _pairs, plan)  # (Adam would scale the
    # rounding noise of net.bias's gradient, which the BatchNorm after it cancels, to a step)
    assert cm.analysis.two_phase


class MadeInForward(nn.Module):
    """A layer with a weight of its own (no draw: a layer norm's ones), made anew at each
    call."""

    def __init__(self) -> None:
        super().__init__()
        self.net = nn.Linear(4, 3)

    def forward(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        norm = nn.LayerNorm(3, dtype=DTYPE)
        return F.mse_loss(norm(self.net(x)), y)


def test_a_layer_with_weights_made_in_forward_is_refused_under_fx():
    batch = (torch.randn(GBS, 4, dtype=DTYPE), torch.randn(GBS, 3, dtype=DTYPE))
    assert_refused_unchanged(MadeInForward, batch, CaptureError,
                             "makes a LayerNorm with parameters or buffers.*__init__",
                             capture="fx")


class WeightedMadeInForward(nn.Module):
    """A loss made in forward with the model's own class weights (a buffer it holds)."""

    def __init__(self) -> None:
        super().__init__()
        self.net = nn.Linear(4, 3)
        self.register_buffer("class_w", torch.tensor([1.0, 2.0, 0.5], dtype=DTYPE))

    def forward(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        return nn.CrossEntropyLoss(weight=self.class_w)(self.net(x), y)


@pytest.mark.parametrize("plan", PLANS)
def test_a_loss_made_in_forward_with_the_models_weights_is_exact_under_fx(plan):
    """Its buffer is the model's tensor: traced through, not refused as another's (found
    by a hunt)."""
    assert_three_steps_exact(WeightedMadeInForward, lambda s: (
        torch.randn(GBS, 4, generator=torch.Generator().manual_seed(s), dtype=DTYPE),
        torch.randint(0, 3, (GBS,), generator=torch.Generator().manual_seed(s))), plan,
        capture="fx")
