"""compile() called inside ``torch.inference_mode()``, and a gradient of a summing loss.

Inside inference_mode, ``capture="export"`` failed with torch.export's "AssertionError:
False != True" and a fix about data-dependent Python; compile now runs out of inference
mode whatever the caller's, and refuses a model built inside it (inference tensors), by
name. ``torch.autograd.grad(F.kl_div(q, p, reduction="sum"), d)`` in forward was refused as
"a reduction other than a plain sum"; it is one, and the refusal now gives the spelling
that compiles (``reduction="none"`` then ``.sum()``), which is exact.
"""

from __future__ import annotations

import copy

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

import mbcompile
from mbcompile.check import relative_error

GBS, NUM_CSX, MBS = 7, 2, 2


class Net(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.a, self.bn, self.unused = nn.Linear(5, 3), nn.BatchNorm1d(3), nn.Linear(2, 2)

    def forward(self, x: torch.Tensor, y: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        out = self.a(x)
        return F.mse_loss(out, y), self.bn(out).to(torch.float32)


def _batch(step: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(step)
    return (torch.randn(GBS, 5, generator=g, dtype=torch.float64),
            torch.randn(GBS, 3, generator=g, dtype=torch.float64))


@pytest.mark.parametrize("capture", ["fx", "export", "auto"])
def test_compile_inside_inference_mode_then_calls_equal_eager(capture):
    torch.manual_seed(0)
    model = Net().double()
    eager = copy.deepcopy(model)
    with torch.inference_mode():
        inputs = _batch(0)  # inference tensors as the example, too
        cm = mbcompile.compile(model, GBS, NUM_CSX, MBS, example_inputs=inputs, capture=capture,
                               cost_model=False)
        # a call under inference_mode: outputs and BatchNorm's statistics as eager's
        (loss, out), (want_loss, want_out) = cm(*_batch(1)), eager(*_batch(1))
        assert loss.is_inference() and want_loss.is_inference() and out.dtype == torch.float32
        assert relative_error(loss, want_loss) <= 1e-12
        assert relative_error(out, want_out) <= 1e-6
    assert relative_error(model.bn.running_mean, eager.bn.running_mean) <= 1e-12
    # then training outside: two steps equal eager's, every .grad (None kept) and parameter
    opts = [torch.optim.SGD(m.parameters(), lr=0.1, momentum=0.9) for m in (model, eager)]
    for step in range(2):
        for call, opt in ((cm, opts[0]), (eager, opts[1])):
            opt.zero_grad()
            call(*_batch(step))[0].backward()
        for p, q in zip(model.parameters(), eager.parameters()):
            assert (p.grad is None) == (q.grad is None)
            assert q.grad is None or relative_error(p.grad, q.grad) <= 1e-12
        for opt in opts:
            opt.step()
    for p, q in zip(model.parameters(), eager.parameters()):
        assert relative_error(p, q) <= 1e-12
    for b, c in zip(model.buffers(), eager.buffers()):
        assert relative_error(b, c) <= 1e-12


@pytest.mark.parametrize("capture", ["fx", "export"])
def test_the_first_eval_call_inside_inference_mode_recaptures_out_of_it(capture):
    """Compiled in training mode, the first eval call (Lightning's validation, under
    inference_mode) captures the eval graph: under export it failed with 'AssertionError:
    False != True' and advice about data-dependent Python (the recapture ran inside the
    mode, where compile() does not)."""
    torch.manual_seed(0)
    model = Net().double()
    eager = copy.deepcopy(model)
    cm = mbcompile.compile(model, GBS, NUM_CSX, MBS, example_inputs=_batch(0), capture=capture,
                           cost_model=False)
    cm.eval()
    eager.eval()
    with torch.inference_mode():
        (loss, out), (want_loss, want_out) = cm(*_batch(1)), eager(*_batch(1))
    assert loss.is_inference() and relative_error(loss, want_loss) <= 1e-12
    assert relative_error(out, want_out) <= 1e-6


@pytest.mark.parametrize("capture", ["fx", "export"])
def test_a_model_built_inside_inference_mode_is_refused(capture):
    with torch.inference_mode():
        model = Net().double()
        before = copy.deepcopy(model.state_dict())
        with pytest.raises(mbcompile.InputError,
                           match=r"Net's parameter 'a.weight' is an inference tensor.*"
                                 r"Build it outside inference_mode.*Nothing was compiled"):
            mbcompile.compile(model, GBS, NUM_CSX, MBS, example_inputs=_batch(0),
                              capture=capture, cost_model=False)
    for k, v in model.state_dict().items():
        assert torch.equal(v, before[k])
    assert all(p.grad is None for p in model.parameters())


@pytest.mark.parametrize("capture", ["fx", "export"])
def test_a_lazy_layer_not_made_yet_is_refused_naming_the_dry_run(capture):
    """A lazy layer's weights are made by its first call: compile met them unmade and
    failed with torch's ValueError from its own check (found by a hunt)."""
    model = nn.Sequential(nn.LazyLinear(3)).double()
    with pytest.raises(mbcompile.InputError, match=r"'0.weight' is not made yet.*model\(\*"):
        mbcompile.compile(model, GBS, NUM_CSX, MBS, example_inputs=_batch(0)[:1],
                          capture=capture, cost_model=False)
    assert isinstance(model[0], nn.LazyLinear)
    model(_batch(0)[0])  # made: compiled as any layer
    cm = mbcompile.compile(model, GBS, NUM_CSX, MBS, example_inputs=_batch(0)[:1],
                           capture=capture, cost_model=False)
    assert relative_error(cm(_batch(1)[0]), model(_batch(1)[0])) <= 1e-12


class VAT(nn.Module):
    """Virtual adversarial training: the adversarial direction is the gradient of a KL
    divergence, summed over the batch, with respect to a per-sample perturbation."""

    def __init__(self, spelling: str) -> None:
        super().__init__()
        self.net = nn.Sequential(nn.Linear(5, 6), nn.Tanh(), nn.Linear(6, 3))
        self.spelling = spelling

    def forward(self, x: torch.Tensor, y: torch.Tensor, xu: torch.Tensor,
                d: torch.Tensor) -> torch.Tensor:
        with torch.no_grad():
            p = F.softmax(self.net(xu), -1)
        d = d.detach().requires_grad_(True)
        q = F.log_softmax(self.net(xu + 1e-2 * d), -1)
        if self.spelling == "sum":
            adv = F.kl_div(q, p, reduction="sum")
        else:
            adv = F.kl_div(q, p, reduction="none").sum()
        g, = torch.autograd.grad(adv, d, create_graph=True)
        r = 0.5 * F.normalize(g, dim=1)
        lds = F.kl_div(F.log_softmax(self.net(xu + r), -1), p, reduction="batchmean")
        return F.cross_entropy(self.net(x), y) + lds


def _vat_batch(step: int) -> tuple[torch.Tensor, ...]:
    g = torch.Generator().manual_seed(step)
    return (torch.randn(GBS, 5, generator=g, dtype=torch.float64),
            torch.randint(0, 3, (GBS,), generator=g),
            torch.randn(GBS, 5, generator=g, dtype=torch.float64),
            torch.randn(GBS, 5, generator=g, dtype=torch.float64))


def test_grad_of_a_loss_with_reduction_sum_names_the_spelling_that_compiles():
    torch.manual_seed(0)
    model = VAT("sum").double()
    before = copy.deepcopy(model.state_dict())
    with pytest.raises(mbcompile.MixingError) as refused:
        mbcompile.compile(model, GBS, NUM_CSX, MBS, example_inputs=_vat_batch(0), capture="fx",
                          cost_model=False)
    text = str(refused.value)
    assert "F.kl_div(..., reduction='sum'), a plain sum over the batch" in text
    assert "spell it F.kl_div(..., reduction='none').sum()" in text
    assert "other than a plain sum" not in text
    assert all(torch.equal(v, before[k]) for k, v in model.state_dict().items())
    assert all(p.grad is None for p in model.parameters())


def test_the_spelling_the_refusal_gives_is_exact():
    torch.manual_seed(0)
    model = VAT("none").double()
    eager = copy.deepcopy(model)
    cm = mbcompile.compile(model, GBS, NUM_CSX, MBS, example_inputs=_vat_batch(0), capture="fx",
                           cost_model=False)
    opts = [torch.optim.SGD(m.parameters(), lr=0.1, momentum=0.9) for m in (model, eager)]
    for step in range(2):
        losses = []
        for call, opt in ((cm, opts[0]), (eager, opts[1])):
            opt.zero_grad()
            losses.append(call(*_vat_batch(step)))
            losses[-1].backward()
        assert relative_error(*losses) <= 1e-12
        for p, q in zip(model.parameters(), eager.parameters()):
            assert (p.grad is None) == (q.grad is None)
            assert relative_error(p.grad, q.grad) <= 1e-10
        for opt in opts:
            opt.step()
    for p, q in zip(model.parameters(), eager.parameters()):
        assert relative_error(p, q) <= 1e-10
