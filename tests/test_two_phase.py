"""Two-phase steps (issue 13): exact training when the loss couples the samples of the batch.

``compile(..., coupling="two_phase")`` cuts the graph at the frontier F into the
per-sample part P (``graph_module.body``) and the coupled part C
(``graph_module.coupled``). One call is one training step:

1. P per microbatch, without grad: F's pieces, and the RNG state each started from;
2. C once, with grad, on F joined over microbatches: the loss, C's own gradients, dL/dF;
3. P again per microbatch, with grad, from the same RNG state: backward of its slice of dL/dF.

The oracle is always eager PyTorch: one full-batch step on a deep copy of the model
(taken before compiling, so a compile that touched the model's state would show),
or, for dropout, a hand-written GradCache loop over the plan's microbatches. Every
family of ``coupled_models`` runs on uneven plans of ``GBS = 7`` samples that all
are uneven or hold microbatches of one, over 1, 2 and 3 systems. ``coupling`` is passed in every
call: the default is still "reject" and will change.

Precision. Float64 everywhere but Mixtral, bound 1e-10 (``models.rel_err``: the
largest difference over the largest eager value, a norm-wise error). A gradient that
is zero in exact arithmetic (the encoder's last bias under centering or BatchNorm)
is measured against ``GRAD_FLOOR`` of the largest gradient, where a relative error
of rounding noise means nothing. Mixtral runs in float32 (grouped_mm has no float64),
to ``zoo.F32_MODEL``: 1e-5.
"""

from __future__ import annotations

import copy
import warnings
from collections.abc import Callable, Iterator
from typing import Any

import pytest
import torch
import torch.nn as nn
import zoo
from coupled_models import COUPLED, FIRST_P, make_dropout_clip
from models import (
    assert_close_errors,
    grad_errors,
    grads_of,
    max_rel_err_outputs,
    one_intra_op_thread,
    rel_err,
)

import mbcompile
from mbcompile import MicrobatchError, MixingError, RetainedActivationsWarning

TOL = 1e-10
RNG_TOL = 1e-12
GRAD_FLOOR = zoo.GRAD_FLOOR  # 1e-4 of the largest gradient: see the module docstring
GBS = 7
#: (num_csx, mbs) -> microbatches per system: 1*7 | 2+2, 2+1 | 1+1+1, 1+1+0, 1+1+0 (empty
#: ones skipped) | 3+2+2 | 1*4, 1*3+0 | 2+1, 1+1, 1+1
PLANS = [(1, 1), (2, 2), (3, 1), (1, 3), (2, 1), (3, 2)]
FAMILIES = sorted(COUPLED)

# Compile notes (the coupled part's share of memory, ...) are not what these tests check.
pytestmark = pytest.mark.filterwarnings("ignore::mbcompile.MbcompileWarning")


@pytest.fixture(autouse=True, scope="module")
def _one_thread() -> Iterator[None]:
    """Tiny models: see models.one_intra_op_thread."""
    with one_intra_op_thread():
        yield


def two_phase(model: nn.Module, inputs: tuple[Any, ...], num_csx: int = 2, mbs: int = 2
              ) -> mbcompile.CompiledModule:
    return mbcompile.compile(model, GBS, num_csx, mbs, example_inputs=inputs,
                             coupling="two_phase")


def loss_of(out: Any) -> torch.Tensor:
    return out[0] if isinstance(out, tuple) else out


def step(call: Callable[..., Any], model: nn.Module, inputs: tuple[Any, ...]
         ) -> tuple[Any, dict[str, torch.Tensor | None]]:
    """One training step from no gradients: the outputs, and the gradients it made."""
    model.zero_grad(set_to_none=True)
    out = call(*inputs)
    loss_of(out).backward()
    return out, grads_of(model)


def buffer_errors(got: nn.Module, want: nn.Module) -> dict[str, float]:
    """Running statistics as a relative error; counters must be equal (error 0 or inf)."""
    errors = {}
    assert [n for n, _ in got.named_buffers()] == [n for n, _ in want.named_buffers()]
    for (name, b), (_, w) in zip(got.named_buffers(), want.named_buffers()):
        exact = not b.is_floating_point()
        errors[name] = (0.0 if torch.equal(b, w) else float("inf")) if exact else rel_err(b, w)
    return errors


def nonempty_slices(cm: mbcompile.CompiledModule) -> list[tuple[int, int]]:
    return [(a, b) for system in cm.plan.microbatch_slices for a, b in system if b > a]


# --------------------------------------------------------------------------- #
# 1. Exact against the eager full batch, every family, uneven plans
# --------------------------------------------------------------------------- #


@pytest.mark.parametrize(("num_csx", "mbs"), PLANS)
@pytest.mark.parametrize("family", FAMILIES)
def test_step_matches_eager_full_batch(family: str, num_csx: int, mbs: int) -> None:
    model, inputs = COUPLED[family](GBS)
    ref = copy.deepcopy(model)
    cm = two_phase(model, inputs, num_csx, mbs)
    sizes = [s for system in cm.plan.microbatch_sizes for s in system]
    assert 1 in sizes or len(set(sizes)) > 1  # uneven, or microbatches of one

    out, got = step(cm, model, inputs)
    want_out, want = step(ref, ref, inputs)

    assert all(g is not None for g in want.values())  # C's own parameters among them
    errors = {**max_rel_err_outputs(out, want_out), **grad_errors(got, want, GRAD_FLOOR),
              **buffer_errors(model, ref)}
    assert len(errors) == (len(want) + len(list(ref.buffers()))
                           + len(out if isinstance(out, tuple) else (out,)))
    assert_close_errors(errors, TOL)


@pytest.mark.parametrize("family", FAMILIES)
def test_p_runs_without_grad_then_again_with_grad(family: str) -> None:
    """The step is really two-phase: every microbatch's P once without grad (phase 1),
    then once with grad (phase 3), never all microbatches' activations kept at once."""
    model, inputs = COUPLED[family](GBS)
    cm = two_phase(model, inputs)
    modes: list[bool] = []
    FIRST_P[family](model).register_forward_hook(
        mbcompile.per_microbatch(lambda *_: modes.append(torch.is_grad_enabled())))
    model(*inputs)
    per_forward = len(modes)  # SimCLR's encoder sees both views
    modes.clear()

    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        loss_of(cm(*inputs)).backward()

    runs = per_forward * len(nonempty_slices(cm))
    assert modes == [False] * runs + [True] * runs, (
        f"P ran with grad modes {modes}; a two-phase step runs it {runs} times without grad, "
        f"then {runs} times with grad")
    assert not [w for w in caught if issubclass(w.category, RetainedActivationsWarning)]


# --------------------------------------------------------------------------- #
# 2. Randomness: phase 3 replays phase 1's dropout masks
# --------------------------------------------------------------------------- #

SEED = 1234


def gradcache_step(model: nn.Module, image: torch.Tensor, text: torch.Tensor,
                   slices: list[tuple[int, int]], replay: bool = True) -> torch.Tensor:
    """GradCache by hand (Gao et al. 2021): the same three phases, the same microbatches."""
    states, pieces = [], []
    with torch.no_grad():
        for a, b in slices:
            states.append(torch.get_rng_state())
            pieces.append(model.embed(image[a:b], text[a:b]))
    zi, zt = (torch.cat(p).requires_grad_() for p in zip(*pieces))
    loss = model.contrastive(zi, zt)
    loss.backward()
    for (a, b), state in zip(slices, states):
        if replay:
            torch.set_rng_state(state)
        torch.autograd.backward(model.embed(image[a:b], text[a:b]),
                                (zi.grad[a:b], zt.grad[a:b]))
    return loss.detach()


def test_dropout_masks_are_replayed_like_gradcache() -> None:
    model, inputs = make_dropout_clip(GBS)
    ref, unreplayed = copy.deepcopy(model), copy.deepcopy(model)
    cm = two_phase(model, inputs)
    slices = nonempty_slices(cm)
    assert len(slices) == 4

    torch.manual_seed(SEED)
    loss = cm(*inputs)
    loss.backward()
    after = torch.get_rng_state()
    torch.manual_seed(SEED)
    want_loss = gradcache_step(ref, *inputs, slices)

    errors = {"loss": rel_err(loss.detach(), want_loss),
              **grad_errors(grads_of(model), grads_of(ref), GRAD_FLOOR)}
    assert_close_errors(errors, RNG_TOL)
    assert torch.equal(after, torch.get_rng_state())  # both drew P's masks once over

    # The comparison can fail: the reference without the replay, or another seed, differs.
    torch.manual_seed(SEED)
    gradcache_step(unreplayed, *inputs, slices, replay=False)
    differ = grad_errors(grads_of(unreplayed), grads_of(ref), GRAD_FLOOR)
    assert max(differ.values()) > 1e-3
    torch.manual_seed(SEED + 1)
    _, other = step(cm, model, inputs)
    differ = grad_errors(other, grads_of(ref), GRAD_FLOOR)
    assert max(differ.values()) > 1e-3


# --------------------------------------------------------------------------- #
# 3. Atomic: a failure in any phase leaves parameters, .grad and optimizer state alone
# --------------------------------------------------------------------------- #


class InjectedError(RuntimeError):
    pass


def _raise(*_: Any) -> None:
    raise InjectedError("injected failure")


def _on_call(number: int, when: Callable[[], bool]) -> Callable[..., None]:
    """A forward pre-hook that raises on the ``number``-th call for which ``when()``."""
    calls = [0]

    def hook(*_: Any) -> None:
        if when():
            calls[0] += 1
            if calls[0] == number:
                _raise()
    return mbcompile.per_microbatch(hook)


def _in_backward(number: int) -> Callable[..., None]:
    """A forward hook whose ``number``-th output that requires grad raises in backward."""
    calls = [0]

    def hook(module: nn.Module, args: Any, out: torch.Tensor) -> None:
        if out.requires_grad:
            calls[0] += 1
            if calls[0] == number:
                out.register_hook(_raise)
    return mbcompile.per_microbatch(hook)


LAST = 4  # the last of the 2+2 | 2+1 microbatches: three have already run their phase
#: phase -> (install the failure on the centering model, what MicrobatchError's message says)
FAILURES: dict[str, tuple[Callable[[nn.Module], Any], str]] = {
    "phase 1: P without grad": (
        lambda m: m.encoder.inp.register_forward_pre_hook(
            _on_call(1, lambda: not torch.is_grad_enabled())),
        r"forward without grad \(phase 1 of 3\)"),
    "phase 2: C forward": (
        lambda m: m.head.register_forward_pre_hook(_raise), "coupled part"),
    "phase 2: C backward": (
        lambda m: m.head.register_forward_hook(_in_backward(1)), "coupled part"),
    "phase 3: P again with grad": (
        lambda m: m.encoder.inp.register_forward_pre_hook(
            _on_call(LAST, torch.is_grad_enabled)),
        r"forward again with grad \(phase 3 of 3\)"),
    "phase 3: P backward": (
        lambda m: m.encoder.inp.register_forward_hook(_in_backward(LAST)),
        r"backward of its slice of dL/dF \(phase 3 of 3\)"),
}


def _snapshot(model: nn.Module, opt: torch.optim.Optimizer) -> dict[str, Any]:
    return {"params": {n: p.detach().clone() for n, p in model.named_parameters()},
            "grad_ids": {n: id(p.grad) for n, p in model.named_parameters()},
            "grads": grads_of(model), "opt": copy.deepcopy(opt.state_dict())}


def _assert_same_state(a: dict[str, Any], b: dict[str, Any]) -> None:
    assert a["grad_ids"] == b["grad_ids"]
    for key in ("params", "grads"):
        bad = [n for n in a[key] if not torch.equal(a[key][n], b[key][n])]
        assert not bad, f"{key} changed: {bad}"
    sa, sb = a["opt"]["state"], b["opt"]["state"]
    assert sa.keys() == sb.keys()
    for i in sa:
        assert sa[i].keys() == sb[i].keys()
        assert all(torch.equal(torch.as_tensor(sa[i][k]), torch.as_tensor(sb[i][k]))
                   for k in sa[i]), f"optimizer state of parameter {i} changed"


@pytest.mark.parametrize("failure", [*FAILURES, "non-finite loss"])
def test_a_failing_phase_rolls_the_step_back(failure: str) -> None:
    model, inputs = COUPLED["centering"](GBS)
    ref = copy.deepcopy(model)
    cm = mbcompile.compile(model, GBS, 2, 2, example_inputs=inputs, nonfinite="raise")
    # SGD with momentum: Adam would turn the zero-up-to-rounding bias gradient into a full step
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    ref_opt = torch.optim.SGD(ref.parameters(), lr=0.1, momentum=0.9)
    for call, m, o in ((cm, model, opt), (ref, ref, ref_opt)):  # optimizer state exists
        step(call, m, inputs)
        o.step()
    for m in (model, ref):
        for p in m.parameters():
            p.grad = torch.full_like(p, 0.5)  # a known gradient the failed step must keep
    before = _snapshot(model, opt)

    if failure == "non-finite loss":
        x, y = inputs
        bad = (x.clone().index_fill_(0, torch.tensor([5]), float("nan")), y)
        with pytest.raises(MicrobatchError, match="not finite"):
            cm(*bad)
    else:
        install, message = FAILURES[failure]
        handle = install(model)
        with pytest.raises(MicrobatchError, match=message) as info:
            loss_of(cm(*inputs)).backward()
        handle.remove()
        assert isinstance(info.value.__cause__, InjectedError)
    _assert_same_state(_snapshot(model, opt), before)

    # the module still works: the next step equals eager's from the same state
    _, got = step(cm, model, inputs)
    _, want = step(ref, ref, inputs)
    assert_close_errors(grad_errors(got, want, GRAD_FLOOR), TOL)


# --------------------------------------------------------------------------- #
# 4. Without grad, and in eval mode
# --------------------------------------------------------------------------- #


@pytest.mark.parametrize("family", FAMILIES)
def test_no_grad_outputs_match_eager(family: str) -> None:
    model, inputs = COUPLED[family](GBS)
    ref = copy.deepcopy(model)
    cm = two_phase(model, inputs)
    with torch.no_grad():
        out, want = cm(*inputs), ref(*inputs)
    assert_close_errors({**max_rel_err_outputs(out, want), **buffer_errors(model, ref)}, TOL)
    assert all(p.grad is None for p in model.parameters())


def test_batch_norm_in_eval_is_not_coupled() -> None:
    model, inputs = COUPLED["batch_norm"](GBS)
    cm = two_phase(model, inputs)
    step(cm, model, inputs)  # in training: two-phase, the running statistics move
    ref = copy.deepcopy(model)
    model.eval()
    ref.eval()
    assert "coupled" not in dict(cm.graph_module.named_children())  # recompiled for eval
    out, got = step(cm, model, inputs)
    want_out, want = step(ref, ref, inputs)
    errors = {**max_rel_err_outputs(out, want_out), **grad_errors(got, want, GRAD_FLOOR),
              **buffer_errors(model, ref)}
    assert_close_errors(errors, TOL)
    # compiled in eval from the start, it is not even a coupling to reject
    mbcompile.compile(model, GBS, 2, 2, example_inputs=inputs, coupling="reject")


# --------------------------------------------------------------------------- #
# 5. What backward may go through
# --------------------------------------------------------------------------- #


@pytest.mark.parametrize("through", ["loss plus logits", "logits alone"])
def test_backward_through_a_non_loss_output_raises(through: str) -> None:
    """The logits' own backward never ran: a gradient into them must not vanish silently."""
    model, inputs = COUPLED["logits"](GBS)
    cm = two_phase(model, inputs)
    loss, logits = cm(*inputs)
    extra = logits.pow(2).mean()
    with pytest.raises(MicrobatchError, match="other than its loss"):
        (loss + extra if through == "loss plus logits" else extra).backward()


def test_backward_twice_raises() -> None:
    model, inputs = COUPLED["clip"](GBS)
    ref = copy.deepcopy(model)
    cm = two_phase(model, inputs)
    loss = cm(*inputs)
    loss.backward(retain_graph=True)
    got = grads_of(model)
    with pytest.raises(MicrobatchError, match="ran twice"):
        loss.backward()
    ref(*inputs).backward()
    assert_close_errors(grad_errors(got, grads_of(ref), GRAD_FLOOR), TOL)
    assert_close_errors(grad_errors(grads_of(model), got), 0.0)  # the second added nothing


def test_the_incoming_gradient_scales_the_step() -> None:
    model, inputs = COUPLED["siglip"](GBS)
    ref = copy.deepcopy(model)
    cm = two_phase(model, inputs)
    (3 * cm(*inputs)).backward()
    (3 * ref(*inputs)).backward()
    assert_close_errors(grad_errors(grads_of(model), grads_of(ref), GRAD_FLOOR), TOL)


# --------------------------------------------------------------------------- #
# 6. Inspectable, and optional
# --------------------------------------------------------------------------- #


def _targets(gm: Any, op: str) -> set[str]:
    return {n.target for n in gm.graph.nodes if n.op == op}


def test_the_rewritten_graph_shows_p_c_and_the_step() -> None:
    model, inputs = COUPLED["siglip"](GBS)
    cm = two_phase(model, inputs)
    text = cm.graph_module.print_readable(False)
    for name in ("class body", "class coupled", "two_phase_step"):
        assert name in text
    body, coupled = cm.graph_module.body, cm.graph_module.coupled
    # SigLIP's temperature and bias act on the (B, B) logits: C's own parameters
    assert _targets(coupled, "get_attr") == {"t_prime", "bias"}
    assert not _targets(body, "get_attr") & {"t_prime", "bias"}
    assert {"image.inp", "text.inp"} <= _targets(body, "call_module")  # the encoders: P
    assert not _targets(coupled, "call_module")


#: family -> the op the strict mode names
MIXING_OPS = {"clip": "matmul", "siglip": "matmul", "simclr": "cat", "triplet": "cdist",
              "centering": "sub", "rmse": "sqrt", "rmse_plus_ce": "sqrt",
              "batch_norm": "BatchNorm1d", "logits": "sub"}


@pytest.mark.parametrize("family", FAMILIES)
def test_coupling_reject_names_the_op(family: str) -> None:
    model, inputs = COUPLED[family](GBS)
    with pytest.raises(MixingError, match=MIXING_OPS[family]):
        mbcompile.compile(model, GBS, 2, 2, example_inputs=inputs, coupling="reject")


# --------------------------------------------------------------------------- #
# 7. Mixtral with its router aux loss (the global-batch load-balancing loss)
# --------------------------------------------------------------------------- #


@pytest.fixture(scope="module")
def mixtral() -> dict[str, Any]:
    """Mixtral, 2 layers, 4 experts, top-2, float32, with output_router_logits=True; the aux
    loss's coefficient is 1 so that its gradient is not lost in the cross-entropy's. One
    compiled step and one eager step (compiling it takes most of this file's time)."""
    tf = pytest.importorskip("transformers")
    tf.logging.set_verbosity_error()
    build = zoo.hf("MixtralForCausalLM", "MixtralConfig", dtype=torch.float32,
                   **{**zoo.MOE, "output_router_logits": True, "router_aux_loss_coef": 1.0})
    model = build()
    ref = copy.deepcopy(model)
    batch = {**zoo.tokens(GBS), "use_cache": False}
    cm = mbcompile.compile(model, GBS, 2, 2, example_kwargs=batch, coupling="two_phase")
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        out = cm(**batch)
        out.loss.backward()
    want = ref(**batch)
    want.loss.backward()
    return {"model": model, "ref": ref, "out": out, "want": want, "warnings": caught}


def test_mixtral_with_router_aux_loss_matches_eager(mixtral: dict[str, Any]) -> None:
    out, want = mixtral["out"], mixtral["want"]
    assert want.aux_loss is not None and want.aux_loss.requires_grad
    assert want.loss.dtype == zoo.F32_MODEL.loss_dtype
    errors = {**max_rel_err_outputs(out, want),  # loss, aux_loss, logits, router_logits
              **grad_errors(grads_of(mixtral["model"]), grads_of(mixtral["ref"]), GRAD_FLOOR)}
    assert {"out.loss", "out.aux_loss", "out.logits"} <= errors.keys()
    assert len(errors) == 3 + len(want.router_logits) + len(list(mixtral["ref"].parameters()))
    assert_close_errors(errors, zoo.F32_MODEL.tol)


def test_mixtral_runs_as_a_two_phase_step(mixtral: dict[str, Any]) -> None:
    """One scalar loss: the step must not fall back to keeping every microbatch's activations."""
    retained = [str(w.message) for w in mixtral["warnings"]
                if issubclass(w.category, RetainedActivationsWarning)]
    assert not retained


class StatisticFirst(nn.Module):
    """Returns a statistic (a batch mean) before its loss (the root of an MSE: coupled)."""

    def __init__(self) -> None:
        super().__init__()
        self.l1, self.l2 = nn.Linear(4, 8), nn.Linear(8, 3)

    def forward(self, x: torch.Tensor, y: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        p = self.l2(torch.tanh(self.l1(x)))
        return p.mean(), torch.nn.functional.mse_loss(p, y).sqrt()


def test_the_coupled_scalar_is_the_loss_not_a_statistic_returned_before_it() -> None:
    """The first scalar trained output was taken for the loss: backward of the loss then
    raised that it was "a per-sample output" (found by a hunt)."""
    torch.manual_seed(0)
    model = StatisticFirst().double()
    eager = copy.deepcopy(model)
    g = torch.Generator().manual_seed(0)
    x, y = torch.randn(GBS, 4, generator=g).double(), torch.randn(GBS, 3, generator=g).double()
    cm = mbcompile.compile(model, GBS, 2, 2, example_inputs=(x, y), cost_model=False)
    assert cm.analysis.coupled_loss == 1
    got, want = cm(x, y), eager(x, y)
    assert all(abs(float(a - b)) <= TOL for a, b in zip(got, want))
    got[1].backward()
    want[1].backward()
    assert all(float((p.grad - q.grad).abs().max()) <= TOL
               for p, q in zip(model.parameters(), eager.parameters()))
