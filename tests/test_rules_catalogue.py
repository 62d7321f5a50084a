"""A catalogue of small models and op patterns, each with its expected verdict.

Every entry is one forward written the way users write it. ``ACCEPT`` entries
must compile as an ordinary split (with ``coupling="reject"``: no op found mixing)
and equal eager PyTorch on the full batch, outputs and every gradient, in float64
(the plan: gbs 6 over 2 systems, mbs 2, so each system runs a microbatch of 2 and
one of 1). ``REJECT`` entries mix samples: with
``coupling="reject"`` they must raise a ``MixingError`` whose op names the
offending op and whose source line is the entry's own line marked
``# offending``; with the default (``coupling="two_phase"``) those that a
two-phase step can run (all but ``STILL_REJECTED``) must compile to one and equal
eager on the same uneven plan: outputs, every gradient and every buffer, in
float64. Entries marked ``EXPORT`` are also compiled through ``torch.export`` (the
ATen spellings of the same rules).

The shared inputs: ``x`` (B, T, F) features, ``mask`` (B, T) right padding
(1 = real token), ``y`` (B,) class ids, ``tok`` (B, T) token labels with -100 on
padding, ``img`` (B, C, H, W) images. The entries are tests/catalogue.py's.
"""

from __future__ import annotations

import warnings

import pytest
import torch
import torch.nn as nn
from catalogue import (
    ACCEPT,
    CALL_LINE,
    FEAT,
    GBS,
    GRAD_FLOOR,
    HID,
    MBS,
    NUM_CSX,
    REJECT,
    REJECT_EXPORT,
    Entry,
    _r_batchnorm_train,
    batch,
    check_exact,
    check_split,
    compile_pattern,
    offending_line,
    plan_free,
)
from models import TOL, assert_close_errors, rel_err, step_errors

import mbcompile
from mbcompile import MixingError, UnsupportedOpError


@pytest.mark.parametrize("name", ACCEPT)
def test_accepted_and_exact(name: str) -> None:
    check_split(ACCEPT[name], "fx")


@pytest.mark.parametrize("name", [n for n, e in ACCEPT.items() if e.export])
def test_accepted_and_exact_through_export(name: str) -> None:
    check_split(ACCEPT[name], "export")


@pytest.mark.parametrize("name", REJECT)
def test_rejected_naming_the_op(name: str) -> None:
    entry = REJECT[name]
    with pytest.raises(MixingError) as info:
        compile_pattern(entry.build(), batch(), "fx", "reject")
    err = info.value
    assert isinstance(err, UnsupportedOpError) == entry.unsupported, str(err)
    assert entry.op in err.op, (err.op, str(err))
    assert f"catalogue.py:{offending_line(entry)}" in str(err), str(err)


@pytest.mark.parametrize("name", REJECT_EXPORT)
def test_rejected_through_export(name: str) -> None:
    entry = REJECT[name]
    with pytest.raises(MixingError) as info:
        compile_pattern(entry.build(), batch(), "export", "reject")
    assert REJECT_EXPORT[name] in info.value.op, (info.value.op, str(info.value))
    # torch.export records the frames of module forwards only: the line in a layer's
    # forward, or, for these plain functions, the line of Pattern.forward that calls them.
    lines = (offending_line(entry), CALL_LINE)
    assert any(f"catalogue.py:{n}:" in str(info.value) for n in lines), str(
        info.value)


# A two-phase step cannot help these: a batch size baked into a shape, a data-dependent
# number of rows, an op without a rule, an output whose rows interleave the samples.
STILL_REJECTED = {"baked-batch-size", "bool-mask-index", "fft-without-rule",
                  "repeat-batch-returned"}


@pytest.mark.parametrize("name", sorted(STILL_REJECTED))  # one order for every xdist worker
def test_what_a_two_phase_step_cannot_run_is_rejected_by_default(name: str) -> None:
    entry = REJECT[name]
    with pytest.raises(MixingError) as info:
        compile_pattern(entry.build(), batch(), "fx")
    assert isinstance(info.value, UnsupportedOpError) == entry.unsupported, str(info.value)
    assert entry.op in info.value.op, (info.value.op, str(info.value))


def check_two_phase(name: str, capture: str) -> None:
    """The default compile runs the mixing entry as a two-phase step on the uneven plan
    (2 + 1 per system), equal to one eager full-batch step of a copy of the model."""
    model, inputs = REJECT[name].build(), batch()
    cm = compile_pattern(model, inputs, capture)
    assert cm.analysis.rejected is not None and "two-phase step" in cm.plan.reason
    assert cm.plan.microbatch_sizes == ((2, 1), (2, 1))
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # TwoPhaseWarning: C holds most of the memory
        errors = step_errors(model, cm, inputs, floor=GRAD_FLOOR)
    assert_close_errors(errors, TOL)


@pytest.mark.parametrize("name", [n for n in REJECT if n not in STILL_REJECTED])
def test_mixing_runs_as_an_exact_two_phase_step(name: str) -> None:
    check_two_phase(name, "fx")


@pytest.mark.parametrize("name", REJECT_EXPORT)
def test_mixing_runs_as_an_exact_two_phase_step_through_export(name: str) -> None:
    check_two_phase(name, "export")


def test_baked_batch_size_through_export_names_the_constant() -> None:
    """export itself refuses the specialised batch dim; the error says what that means."""
    with pytest.raises(mbcompile.CaptureError) as info:
        compile_pattern(REJECT["baked-batch-size"].build(), batch(), "export")
    assert "baked in" in str(info.value) and "x.view(6, -1)" in str(info.value)


def test_catalogue_is_large_enough() -> None:
    assert len(ACCEPT) + len(REJECT) >= 40


# --------------------------------------------------------------------------- #
# Linear statistics, trusted layers and user rules
# --------------------------------------------------------------------------- #


def test_statistics_next_to_the_loss_keep_one_microbatch_of_memory() -> None:
    """Accuracy and token counts carry no gradient: the loss alone is trained, so the step
    still runs backward per microbatch (no RetainedActivationsWarning)."""
    model, inputs = ACCEPT["accuracy-and-token-counts"].build(), batch()
    with warnings.catch_warnings():
        warnings.simplefilter("error", mbcompile.RetainedActivationsWarning)
        cm = mbcompile.compile(model, GBS, NUM_CSX, MBS, example_inputs=inputs)
        loss, correct, tokens, accuracy = cm(*inputs)
    loss.backward()
    assert tokens.item() == (inputs[3] != -100).sum().item() == 20
    assert correct.dtype == torch.int64 and 0 <= correct.item() <= 20


def test_masked_mean_uses_the_global_mask_count() -> None:
    """Microbatches hold 7, 4, 6 and 3 real tokens: a mean of per-microbatch means is wrong,
    the exact masked mean divides the global sum by the global count."""
    model, inputs = ACCEPT["masked-mean-statistic"].build(), batch()
    x, mask = inputs[0], inputs[1]
    cm = compile_pattern(model, inputs)
    with torch.no_grad():
        _, masked_mean = cm(*inputs)
        h = torch.tanh(model.lin(x)) * mask.unsqueeze(-1)
        per_mb = [h[a:b].sum() / (mask[a:b].sum() * HID) for a, b in ((0, 2), (2, 3), (3, 5),
                                                                      (5, 6))]
    want = h.sum() / (mask.sum() * HID)
    assert rel_err(masked_mean, want) <= TOL
    assert rel_err(torch.stack(per_mb).mean(), want) > 1e-3  # the naive combination differs


class NoisyGate(nn.Module):
    """A layer fx cannot trace (a Python branch on values) that treats samples independently."""

    def __init__(self) -> None:
        super().__init__()
        self.scale = nn.Parameter(torch.tensor(0.5))

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        if bool((h.abs() > 1e6).any()):
            h = h.clamp(-1e6, 1e6)
        return h * torch.sigmoid(self.scale * h)


def _trusted(s, x, mask, y, tok, img):
    return s.layers.gate(s.lin(x))


def test_trusted_layer_is_a_per_sample_leaf() -> None:
    from mbcompile.passes.rules import BATCH_RULES, TRUSTED_MODULES

    entry = Entry(_trusted, {"gate": NoisyGate})
    with pytest.raises(mbcompile.MbcompileError):  # fx cannot trace it, nor export
        compile_pattern(entry.build(), batch(), "fx")
    try:
        assert mbcompile.trust_module(NoisyGate) is NoisyGate
        check_exact(entry, "fx")
        cm = compile_pattern(entry.build(), batch(), "fx")
        assert "layers.gate" in [n.target for n in cm.original_graph_module.graph.nodes
                                 if n.op == "call_module"]
    finally:
        TRUSTED_MODULES.discard(NoisyGate)
        BATCH_RULES.pop(NoisyGate, None)


def scaled_rows(h: torch.Tensor) -> torch.Tensor:
    """A function fx keeps as one call (torch.fx.wrap): mbcompile has no rule for it."""
    return h * torch.arange(1, h.shape[-1] + 1, dtype=h.dtype)


torch.fx.wrap("scaled_rows")


def _wrapped(s, x, mask, y, tok, img):
    return scaled_rows(s.lin(x))


def test_user_rule_for_a_wrapped_function() -> None:
    from mbcompile.passes.rules import BATCH_RULES

    entry = Entry(_wrapped)
    with pytest.raises(UnsupportedOpError, match="register_batch_rule"):
        compile_pattern(entry.build(), batch(), "fx")
    try:
        mbcompile.register_batch_rule(scaled_rows, "per_sample")
        check_exact(entry, "fx")
        # A rule is a function of the RuleContext too: this one finds the batch dim itself.
        mbcompile.register_batch_rule(scaled_rows, lambda ctx: ctx.batched_out())
        check_exact(entry, "fx")
    finally:
        BATCH_RULES.pop(scaled_rows, None)




def test_cumulative_batch_norm_runs_as_an_exact_two_phase_step():
    """``BatchNorm(momentum=None)`` reads ``1 / num_batches_tracked`` as a Python number: the
    fake runs that plan the split use any momentum (the same shapes), the coupled part reads
    the real counter (tests/test_user_losses.py checks three steps and the buffers)."""
    entry = Entry(_r_batchnorm_train, {"bn": lambda: nn.BatchNorm1d(HID, momentum=None)})
    model = entry.build()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        cm = mbcompile.compile(model, GBS, NUM_CSX, MBS, example_inputs=batch(),
                               **plan_free(MBS))
    assert cm.analysis.two_phase
    assert_close_errors(step_errors(model, cm, batch(), floor=GRAD_FLOOR), TOL)


class _GradientPenalty(nn.Module):
    """WGAN-GP's penalty: ``torch.autograd.grad(..., create_graph=True)`` inside forward."""

    def __init__(self) -> None:
        super().__init__()
        self.critic = nn.Sequential(nn.Linear(FEAT, HID), nn.Tanh(), nn.Linear(HID, 1))

    def forward(self, x, mask, y, tok, img):
        x = x.detach().requires_grad_(True)
        out = self.critic(x)
        (g,) = torch.autograd.grad(out.sum(), x, create_graph=True)  # offending
        return out.mean() + 10 * ((g.flatten(1).norm(2, dim=1) - 1) ** 2).mean()


def test_a_gradient_penalty_in_forward_is_refused_at_its_line_under_export():
    """torch.export cannot keep a differentiation nested in forward (the fx capture keeps
    it: tests/test_user_losses.py): refused at capture, naming the line, with the model
    unchanged."""
    torch.manual_seed(0)
    model = _GradientPenalty().double()
    before = [p.detach().clone() for p in model.parameters()]
    with pytest.raises(mbcompile.CaptureError, match="differentiates inside forward") as info:
        mbcompile.compile(model, GBS, NUM_CSX, MBS, example_inputs=batch(), capture="export",
                          **plan_free(MBS))
    assert "# offending" in str(info.value) and "capture='fx'" in str(info.value)
    assert all(torch.equal(p, q) and p.grad is None for p, q in zip(model.parameters(), before))