"""Exact or refused at forward time: what a forward does around its ops (issue 25).

Each model is ten lines; each is compiled on an uneven plan (gbs 7 over 2 systems,
mbs 2: microbatches 2, 2 | 2, 1) and compared with one eager full-batch step in
float64 (``models.step_errors``: the loss, every output, every ``.grad`` and its
None-ness, every buffer), or refused with the project's own error. The oracle is
eager PyTorch; nothing expected is computed by mbcompile.
"""

from __future__ import annotations

import copy
import warnings
from typing import Any

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F
from host_reads import HostReads
from models import TOL, assert_close_errors, plan_free, step_errors

import mbcompile
from mbcompile.passes import rules

GBS, SYSTEMS, MBS = 7, 2, 2
COMPILED = {"backend": "aot_eager"}  # torch_compile without a C++ toolchain's inductor


pytestmark = pytest.mark.usefixtures("float64_default")  # conftest.py


def _batch(n: int = GBS, out: int = 3) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(1)
    return torch.randn(n, 4, generator=g), torch.randn(n, out, generator=g)


def _compile(model: nn.Module, batch: tuple[Any, ...], **kw: Any) -> mbcompile.CompiledModule:
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", mbcompile.MbcompileWarning)  # two-phase memory notes
        return mbcompile.compile(model, GBS, SYSTEMS, MBS, example_inputs=batch,
                                 **plan_free(MBS, **kw))


def _assert_exact(model: nn.Module, cm: Any, batch: tuple[Any, ...], tol: float = TOL) -> None:
    """One step of ``cm`` equals one eager step; the parameters stay leaves."""
    assert_close_errors(step_errors(model, cm, batch), tol)
    assert all(p.is_leaf and p.grad_fn is None for p in model.parameters())


def _two_steps(model: nn.Module, cm: Any, batch: tuple[Any, ...]) -> None:
    """Two steps, with an SGD update between them, each against eager on a copy."""
    ref = copy.deepcopy(model)
    for _ in range(2):
        for module, call in ((model, cm), (ref, ref)):
            module.zero_grad(set_to_none=True)
            call(*batch)[0].backward()
            with torch.no_grad():
                for p in module.parameters():
                    if p.grad is not None:
                        p.sub_(0.1 * p.grad)
        for (name, p), q in zip(model.named_parameters(), ref.parameters()):
            assert p.is_leaf, name
            assert (p.grad is None) == (q.grad is None), name
            torch.testing.assert_close(p, q, rtol=1e-12, atol=1e-12, msg=name)
        for (name, b), c in zip(model.named_buffers(), ref.buffers()):
            torch.testing.assert_close(b, c, rtol=1e-12, atol=1e-12, msg=name)


# --------------------------------------------------------------------------- grad mode


class Teacher(nn.Module):
    """Distillation: the teacher runs without grad, in one of forward's grad-mode forms."""

    def __init__(self, form: str) -> None:
        super().__init__()
        self.teacher, self.student, self.form = nn.Linear(4, 3), nn.Linear(4, 3), form

    @torch.no_grad()
    def _decorated(self, x: torch.Tensor) -> torch.Tensor:
        return self.teacher(x)

    def _teach(self, x: torch.Tensor) -> torch.Tensor:
        if self.form == "no_grad":
            with torch.no_grad():
                return self.teacher(x)
        if self.form == "set_grad_enabled":
            with torch.set_grad_enabled(False):
                return self.teacher(x)
        if self.form == "inference_mode":
            with torch.inference_mode():
                t = self.teacher(x)
            return t.clone()  # an inference tensor is cloned before autograd sees it
        return self._decorated(x)

    def forward(self, x: torch.Tensor, y: torch.Tensor) -> tuple[torch.Tensor, ...]:
        t = self._teach(x)
        o = self.student(x)
        return F.mse_loss(o, t) + F.mse_loss(o, y), t, o


FORMS = ["no_grad", "set_grad_enabled", "inference_mode", "decorator"]


@pytest.mark.parametrize("capture", ["auto", "export"])
@pytest.mark.parametrize("form", FORMS)
def test_a_no_grad_region_trains_only_what_eager_trains(form, capture):
    torch.manual_seed(0)
    model, batch = Teacher(form), _batch()
    cm = _compile(model, batch, capture=capture)
    out = cm(*batch)
    assert out[1].requires_grad is False and out[2].requires_grad is True
    _assert_exact(model, cm, batch)
    assert model.teacher.weight.grad is None and model.teacher.bias.grad is None


def test_a_no_grad_region_under_torch_compile_and_recompute():
    torch.manual_seed(0)
    model, batch = Teacher("no_grad"), _batch()
    _assert_exact(model, _compile(model, batch, torch_compile=COMPILED), batch)
    assert model.teacher.weight.grad is None


class NestedEnable(nn.Module):
    """``torch.enable_grad()`` inside a no-grad region: its part trains again."""

    def __init__(self) -> None:
        super().__init__()
        self.a, self.b = nn.Linear(4, 3), nn.Linear(4, 3)

    def forward(self, x: torch.Tensor, y: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        with torch.no_grad():
            frozen = self.a(x)
            with torch.enable_grad():
                trained = self.b(x) * frozen
        return F.mse_loss(trained, y), frozen


@pytest.mark.parametrize("capture", ["fx", "export"])
def test_grad_mode_turned_back_on_inside_a_region_is_kept(capture):
    torch.manual_seed(0)
    model, batch = NestedEnable(), _batch()
    _assert_exact(model, _compile(model, batch, capture=capture), batch)
    assert model.a.weight.grad is None and model.b.weight.grad is not None


def test_a_trusted_module_inside_a_no_grad_region_is_refused():
    class Inner(nn.Linear):
        pass

    class Net(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.inner, self.out = Inner(4, 3), nn.Linear(4, 3)

        def forward(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
            with torch.no_grad():
                t = self.inner(x)
            return F.mse_loss(self.out(x), t + y)

    with rules.scoped():
        mbcompile.trust_module(Inner)
        with pytest.raises(mbcompile.CaptureError, match="no-grad region"):
            _compile(Net(), _batch(), capture="fx")


# --------------------------------------------------------------------------- autocast


class Autocast(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.a, self.b = nn.Linear(4, 8), nn.Linear(8, 3)

    def forward(self, x: torch.Tensor, y: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        h = self.a(x).relu()
        with torch.autocast("cpu", dtype=torch.bfloat16):
            logits = self.b(h)
        return F.mse_loss(logits.float(), y), logits


def test_an_autocast_region_keeps_eager_dtypes_and_values():
    """float32 (autocast leaves float64 alone): the logits come back bf16 as in eager (a
    dropped region gives float32), and the step equals eager's to bf16 rounding: the
    gradients' sums over the batch run in bf16, split into microbatches."""
    torch.manual_seed(0)
    model = Autocast().float()
    batch = tuple(t.float() for t in _batch())
    cm = _compile(model, batch)
    assert cm.original_graph_module is not None
    out = cm(*batch)
    assert out[1].dtype == torch.bfloat16
    _assert_exact(model, cm, batch, tol=2 * 2**-7)  # bf16's rounding: its sums are split
    with pytest.raises(mbcompile.CaptureError, match="autocast region"):
        _compile(model, batch, capture="fx")


# --------------------------------------------------------------------------- tensor hooks


class Hooked(nn.Module):
    """A gradient hook registered in forward, after an earlier use of the hooked value."""

    def __init__(self) -> None:
        super().__init__()
        self.a, self.b = nn.Linear(4, 8), nn.Linear(8, 3)

    def forward(self, x: torch.Tensor, y: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        h = self.a(x)
        early = h.sum(1, keepdim=True)  # used before the hook: eager's hook sees it too
        h.register_hook(lambda g: g * 0.25)
        o = self.b(h.relu()) + early
        return F.mse_loss(o, y), o


@pytest.mark.parametrize("kw", [{}, {"torch_compile": COMPILED}], ids=["eager", "compiled"])
def test_a_tensor_hook_registered_in_forward_is_kept(kw):
    torch.manual_seed(0)
    model, batch = Hooked(), _batch()
    _assert_exact(model, _compile(model, batch, **kw), batch)


class HookedWith(nn.Module):
    def __init__(self, hook: Any) -> None:
        super().__init__()
        self.a, self.b, self.hook = nn.Linear(4, 8), nn.Linear(8, 3), hook

    def forward(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        h = self.a(x)
        h.register_hook(self.hook)
        return F.mse_loss(self.b(h), y)


@pytest.mark.parametrize("hook, why", [
    (lambda g: g.clamp(-0.01, 0.01), "is not linear in the gradient"),
    (lambda g: g - g.mean(0), "mixes the samples of the batch"),
], ids=["clamp", "centre"])
def test_a_tensor_hook_that_a_microbatch_would_change_is_refused(hook, why):
    with pytest.raises(mbcompile.CaptureError, match=why):
        _compile(HookedWith(hook), _batch())


def test_a_tensor_hook_under_export_is_refused_at_its_line():
    with pytest.raises(mbcompile.CaptureError, match=r"registers a tensor hook at .*register_hook"):
        _compile(Hooked(), _batch(), capture="export")


# --------------------------------------------------------------------------- parametrizations


def _spectral() -> nn.Module:
    return nn.utils.parametrizations.spectral_norm(nn.Linear(4, 3))


def _legacy_spectral() -> nn.Module:
    return nn.utils.spectral_norm(nn.Linear(4, 3))


def _weight_norm() -> nn.Module:
    return nn.utils.parametrizations.weight_norm(nn.Linear(4, 3))


class Parametrized(nn.Module):
    def __init__(self, make: Any) -> None:
        super().__init__()
        self.a = make()

    def forward(self, x: torch.Tensor, y: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        o = self.a(x)
        return F.mse_loss(o, y), o


@pytest.mark.parametrize("make", [_spectral, _legacy_spectral, _weight_norm])
def test_a_parametrization_runs_once_per_step(make):
    """Spectral norm's power iteration updates ``_u``/``_v`` (``weight_u``) once per step, as
    eager does, over two steps with an update between them."""
    torch.manual_seed(0)
    model, batch = Parametrized(make), _batch()
    cm = _compile(model, batch)
    _assert_exact(model, cm, batch)
    _two_steps(model, cm, batch)
    assert all(isinstance(b, torch.Tensor) and not isinstance(b, torch.fx.Proxy)
               for b in vars(model.a).values() if hasattr(b, "shape"))


def test_spectral_norm_under_torch_compile():
    torch.manual_seed(0)
    model, batch = Parametrized(_spectral), _batch()
    _assert_exact(model, _compile(model, batch, torch_compile=COMPILED), batch)


# --------------------------------------------------------------------------- state writes


class EmaCopy(nn.Module):
    """An EMA of the trained layer, kept as frozen parameters and updated under no_grad."""

    def __init__(self) -> None:
        super().__init__()
        self.a, self.ema = nn.Linear(4, 3), nn.Linear(4, 3)
        self.ema.requires_grad_(False)

    def forward(self, x: torch.Tensor, y: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        with torch.no_grad():
            for e, p in zip(self.ema.parameters(), self.a.parameters()):
                e.mul_(0.9).add_(p, alpha=0.1)
        o = self.a(x) + self.ema(x)
        return F.mse_loss(o, y), o


@pytest.mark.parametrize("kw", [{}, {"torch_compile": COMPILED}], ids=["eager", "compiled"])
def test_a_frozen_parameter_updated_in_place_stays_a_leaf(kw):
    torch.manual_seed(0)
    model, batch = EmaCopy(), _batch()
    cm = _compile(model, batch, **kw)
    _assert_exact(model, cm, batch)
    _two_steps(model, cm, batch)  # torch_compile: the second step ran into "backward twice"


def test_a_trained_parameter_written_in_place_is_refused():
    class Clamped(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.a = nn.Linear(4, 3)

        def forward(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
            with torch.no_grad():
                self.a.weight.clamp_(-0.1, 0.1)
            return F.mse_loss(self.a(x), y)

    model = Clamped()
    before = model.a.weight.detach().clone()
    with pytest.raises(mbcompile.CaptureError, match="trained parameter 'a.weight' in place"):
        _compile(model, _batch())
    assert torch.equal(model.a.weight, before)


class Counter(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.a = nn.Linear(4, 3)
        self.register_buffer("seen", torch.zeros((), dtype=torch.long))

    def forward(self, x: torch.Tensor, y: torch.Tensor) -> tuple[torch.Tensor, Any]:
        self.seen += x.shape[0]
        o = self.a(x)
        return F.mse_loss(o, y), o, o.shape[-1]


@pytest.mark.parametrize("kw", [{}, {"capture": "export"}, {"torch_compile": COMPILED}],
                         ids=["auto", "export", "compiled"])
def test_a_buffer_counter_and_a_returned_size_compile_and_match(kw):
    """Both crashed inside mbcompile ("'Node' object is not iterable", "KeyError: -1")."""
    torch.manual_seed(0)
    model, batch = Counter(), _batch()
    cm = _compile(model, batch, **kw)
    assert isinstance(model.seen, torch.Tensor) and int(model.seen) == 0  # capture undone
    out = cm(*batch)
    assert out[2] == 3 and int(model.seen) == GBS
    _assert_exact(model, cm, batch)


def test_a_python_counter_in_forward_moves_once_per_step():
    """Compiling leaves it alone; each step moves it by one, as eager does (the read is
    guarded, the write replayed: tests/test_python_state.py has the other forms)."""
    class Calls(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.a, self.calls = nn.Linear(4, 3), 0

        def forward(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
            self.calls += 1
            return F.mse_loss(self.a(x), y)

    model = Calls()
    cm = _compile(model, _batch())
    assert model.calls == 0
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", mbcompile.RecompileWarning)
        for step in range(1, 3):
            cm(*_batch())
            assert model.calls == step


def test_a_gradient_penalty_is_refused_under_export_with_the_reason():
    """torch.export cannot keep it; the fx capture does (tests/test_user_losses.py)."""

    class Penalty(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.a = nn.Linear(4, 3)

        def forward(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
            x = x.detach().requires_grad_(True)
            o = self.a(x)
            (g,) = torch.autograd.grad(o.sum(), x, create_graph=True)
            return F.mse_loss(o, y) + g.pow(2).sum(1).mean()

    with pytest.raises(mbcompile.CaptureError, match="differentiates inside forward"):
        _compile(Penalty(), _batch(), capture="export")
    assert torch.autograd.grad.__module__ == "torch.autograd"  # the patch is undone


# --------------------------------------------------------------------------- guards


class Weighted(nn.Module):
    """A loss weight, a branch flag and a dropout probability read as Python values."""

    def __init__(self) -> None:
        super().__init__()
        self.a, self.drop = nn.Linear(4, 3), nn.Dropout(0.0)
        self.beta, self.flag = 1.0, False

    def forward(self, x: torch.Tensor, y: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        o = self.drop(self.a(x))
        if self.flag:
            o = o * 2
        return self.beta * F.mse_loss(o, y), o


@pytest.mark.parametrize("capture", ["auto", "export"])
@pytest.mark.parametrize("change", ["beta", "flag", "dropout_p"])
def test_python_state_changed_after_compile_recompiles_with_a_warning(change, capture):
    torch.manual_seed(0)
    model, batch = Weighted(), _batch()
    cm = _compile(model, batch, capture=capture)
    _assert_exact(model, cm, batch)
    if change == "beta":
        model.beta = 0.5
    elif change == "flag":
        model.flag = True
    else:
        model.drop.p = 1.0  # every value dropped: deterministic
    name = {"beta": "beta", "flag": "flag", "dropout_p": "drop.p"}[change]
    if change == "dropout_p" and capture == "auto":  # fx keeps Dropout one live node
        assert_close_errors(step_errors(model, cm, batch), TOL)
        return
    with pytest.warns(mbcompile.RecompileWarning, match=rf"{name} was .*, now"):
        errors = step_errors(model, cm, batch)
    assert_close_errors(errors, TOL)
    with warnings.catch_warnings():
        warnings.simplefilter("error", mbcompile.RecompileWarning)  # once per state
        assert_close_errors(step_errors(model, cm, batch), TOL)


class HookedBlock(nn.Module):
    """A module of the user's (traced into) with a pre-hook that counts calls in a buffer
    and a forward hook that rescales the output."""

    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(4, 3)
        self.register_buffer("calls", torch.zeros((), dtype=torch.long))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.lin(x)


def test_a_layer_hook_that_mixes_samples_is_refused():
    """A layer called as one node runs its hooks per microbatch: one that reads the whole
    batch (centring the output) would change the step, so compile refuses it."""
    model = Parametrized(lambda: nn.Linear(4, 3))
    model.a.register_forward_hook(lambda m, args, out: out - out.mean(0))
    with pytest.raises(mbcompile.CaptureError, match="depending on the whole batch"):
        _compile(model, _batch())


def test_module_hooks_present_at_compile_run_once_per_step():
    torch.manual_seed(0)
    model, batch = Parametrized(HookedBlock), _batch()

    def count(module: nn.Module, args: tuple[Any, ...]) -> None:
        module.calls += 1

    model.a.register_forward_pre_hook(count)
    model.a.register_forward_hook(lambda module, args, out: out * 3)
    cm = _compile(model, batch)
    _assert_exact(model, cm, batch)
    assert int(model.a.calls) == 1  # one compiled step (the eager step ran on a copy)


def test_a_forward_hook_added_after_compile_under_torch_compile_recompiles():
    """Under torch_compile dynamo traced the layer in, so a new hook compiles again (and is
    checked); removing it goes back to the graph compiled first, still cached."""
    torch.manual_seed(0)
    model, batch = Parametrized(lambda: nn.Linear(4, 3)), _batch()
    cm = _compile(model, batch, torch_compile=COMPILED)
    handle = model.a.register_forward_hook(lambda m, args, out: out * 3)
    with pytest.warns(mbcompile.RecompileWarning, match="hooks of 'a' changed"):
        _assert_exact(model, cm, batch)
    handle.remove()
    with warnings.catch_warnings():
        warnings.simplefilter("error", mbcompile.RecompileWarning)
        _assert_exact(model, cm, batch)


def _state(model: nn.Module) -> dict[str, torch.Tensor | None]:
    return {**{k: v.clone() for k, v in model.state_dict().items()},
            **{f"{k}.grad": None if p.grad is None else p.grad.clone()
               for k, p in model.named_parameters()}}


@pytest.mark.parametrize("hook", [
    lambda m, args, out: out * 3,                       # returns a new output
    lambda m, args, out: out.sub_(out.mean(0)),         # writes the output in place
    lambda m, args: (args[0] * 2,),                     # a pre-hook returning new arguments
], ids=["returns", "in_place", "pre_hook"])
def test_a_hook_changing_a_live_layer_added_after_compile_is_refused(hook):
    """A layer the graph calls as one node runs its hooks per microbatch. compile checks
    the hooks present then; one added later is not called on made-up data, and if it
    changes what the layer computes the step is refused before anything changes."""
    torch.manual_seed(0)
    model, batch = Parametrized(lambda: nn.Linear(4, 3)), _batch()
    cm = _compile(model, batch)
    cm(*batch)[0].backward()  # a first step: gradients to keep
    pre = hook.__code__.co_argcount == 2
    handle = (model.a.register_forward_pre_hook if pre else model.a.register_forward_hook)(hook)
    before = _state(model)
    with pytest.raises(mbcompile.CaptureError, match="registered on Linear 'a' after compile"):
        cm(*batch)
    after = _state(model)
    assert before.keys() == after.keys() and all(
        (b is None and a is None) or torch.equal(b, a) for b, a in zip(before.values(),
                                                                       after.values()))
    handle.remove()  # the layer as compiled: no recompile, exact again
    model.zero_grad(set_to_none=True)
    with warnings.catch_warnings():
        warnings.simplefilter("error", mbcompile.RecompileWarning)
        _assert_exact(model, cm, batch)


def test_a_hook_added_after_compile_marked_per_microbatch_runs_per_microbatch():
    """A hook marked ``mbcompile.per_microbatch`` (counting, logging, injecting a failure)
    runs as written, once per microbatch, outside a step too, and the step stays exact
    (unmarked, a hook that writes Python state is refused: tests/test_hook_limits.py)."""
    torch.manual_seed(0)
    model, batch = Parametrized(lambda: nn.Linear(4, 3)), _batch()
    cm = _compile(model, batch)
    rows: list[int] = []
    model.a.register_forward_hook(
        mbcompile.per_microbatch(lambda m, args, out: rows.append(out.shape[0])))
    with warnings.catch_warnings():
        warnings.simplefilter("error", mbcompile.RecompileWarning)
        cm(*batch)[0].backward()
    assert rows == [n for sizes in cm.plan.microbatch_sizes for n in sizes if n]  # 2, 2, 2, 1
    rows.clear()
    model(*batch)  # eager, outside any step: the watched hook is only called
    assert rows == [GBS]
    model.zero_grad(set_to_none=True)
    _assert_exact(model, cm, batch)


def test_compiling_again_checks_a_hook_added_after_compile():
    torch.manual_seed(0)
    model, batch = Parametrized(lambda: nn.Linear(4, 3)), _batch()
    _compile(model, batch)
    handle = model.a.register_forward_hook(lambda m, args, out: out * 3)
    _assert_exact(model, _compile(model, batch), batch)  # checked, and exact
    handle.remove()
    model.a.register_forward_hook(lambda m, args, out: out - out.mean(0))
    with pytest.raises(mbcompile.CaptureError, match="depending on the whole batch"):
        _compile(model, batch)


class TwoLayers(nn.Module):
    """``b``'s input requires grad, so a backward hook on ``b`` changes what reaches ``a``."""

    def __init__(self) -> None:
        super().__init__()
        self.a, self.b = nn.Linear(4, 5), nn.Linear(5, 3)

    def forward(self, x: torch.Tensor, y: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        o = self.b(torch.tanh(self.a(x)))
        return F.mse_loss(o, y), o


def test_a_backward_hook_that_mixes_samples_is_refused():
    model, batch = TwoLayers(), _batch()
    model.b.register_full_backward_hook(lambda m, gi, go: (gi[0] - gi[0].mean(0),))
    with pytest.raises(mbcompile.CaptureError, match="the gradient it passes back"):
        _compile(model, batch)


def test_a_backward_hook_added_after_compile_recompiles_and_is_checked():
    """A live layer's backward hooks run in each microbatch's backward: adding one
    recompiles (and checks it), where adding a forward hook does not."""
    torch.manual_seed(0)
    model, batch = TwoLayers(), _batch()
    cm = _compile(model, batch)
    handle = model.b.register_full_backward_hook(lambda m, gi, go: (gi[0] * 0.25,))
    with pytest.warns(mbcompile.RecompileWarning, match="hooks of 'b' changed"):
        _assert_exact(model, cm, batch)
    handle.remove()
    model.b.register_full_backward_hook(lambda m, gi, go: (gi[0] - gi[0].mean(0),))
    with pytest.warns(mbcompile.RecompileWarning), pytest.raises(
            mbcompile.CaptureError, match="the gradient it passes back"):
        cm(*batch)


def test_a_hook_added_to_a_module_of_the_users_after_compile_recompiles():
    torch.manual_seed(0)
    model, batch = Parametrized(HookedBlock), _batch()
    cm = _compile(model, batch)
    model.a.register_forward_hook(lambda m, args, out: out * 3)
    with pytest.warns(mbcompile.RecompileWarning, match="hooks of 'a' changed"):
        _assert_exact(model, cm, batch)


def test_requires_grad_changed_after_compile_is_read_live():
    """Freezing a layer after compile needs no recompile: nothing compiled depends on it."""
    torch.manual_seed(0)
    model, batch = Teacher("no_grad"), _batch()
    cm = _compile(model, batch)
    model.student.bias.requires_grad_(False)
    with warnings.catch_warnings():
        warnings.simplefilter("error", mbcompile.RecompileWarning)
        _assert_exact(model, cm, batch)
    assert model.student.bias.grad is None and len(cm._cache) == 1


def test_guards_add_no_host_read_per_step():
    torch.manual_seed(0)
    model, batch = Weighted(), _batch()
    cm = _compile(model, batch)
    assert any(g.name == "beta" for g in cm._compiled().guards)
    cm(*batch)[0].backward()  # warm
    with HostReads() as reads:
        cm(*batch)[0].backward()
    assert reads.total == 0  # the default step reads nothing (nonfinite="return")


# --------------------------------------------------------------------------- generators


class Noisy(nn.Module):
    """Noise from a generator the model owns, in the per-sample part; optionally a loss
    that couples samples (a two-phase step runs the per-sample part twice)."""

    def __init__(self, coupled: bool) -> None:
        super().__init__()
        self.a, self.coupled = nn.Linear(4, 3), coupled
        self.g = torch.Generator().manual_seed(3)

    def per_sample(self, x: torch.Tensor) -> torch.Tensor:
        h = self.a(x)
        return h + torch.randn(h.shape, generator=self.g, dtype=h.dtype)

    def head(self, h: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        loss = F.mse_loss(h, y, reduction="sum") / h.shape[0]
        if self.coupled:
            z = F.normalize(h, dim=1)
            loss = loss + (z @ z.T).logsumexp(1).mean()
        return loss

    def forward(self, x: torch.Tensor, y: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        h = self.per_sample(x)
        return self.head(h, y), h


class NoisyBlock(nn.Module):
    def __init__(self, g: torch.Generator) -> None:
        super().__init__()
        self.lin, self.g = nn.Linear(4, 4), g

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        noise = torch.randn(x.shape, generator=self.g, dtype=x.dtype)
        return torch.tanh(self.lin(x)) * (1 + 0.1 * noise)  # the gradient reads the noise


class NoisyBlocks(nn.Module):
    """Repeated blocks (what ``recompute`` checkpoints), each drawing from the model's own
    generator."""

    def __init__(self) -> None:
        super().__init__()
        self.g = torch.Generator().manual_seed(3)
        self.blocks = nn.ModuleList([NoisyBlock(self.g) for _ in range(3)])

    def per_sample(self, x: torch.Tensor) -> torch.Tensor:
        for block in self.blocks:
            x = block(x)
        return x

    def head(self, h: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        return F.mse_loss(h, y)

    def forward(self, x: torch.Tensor, y: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        h = self.per_sample(x)
        return self.head(h, y), h


def _against_hand_split(model: nn.Module, cm: Any, batch: tuple[torch.Tensor, torch.Tensor]
                        ) -> nn.Module:
    """One step of ``cm`` against its reference for random draws and per-microbatch
    statistics: the per-sample part run eagerly on each microbatch, in the plan's order (the
    draws come in the same order), the loss on the joined batch. (Draws cannot equal one
    full-batch draw, whose stream is split otherwise.) Returns the reference model."""
    ref = copy.deepcopy(model)
    loss = cm(*batch)[0]
    loss.backward()
    x, y = batch
    slices = [(a, b) for system in cm.plan.microbatch_slices for a, b in system if b > a]
    want = ref.head(torch.cat([ref.per_sample(x[a:b]) for a, b in slices]), y)
    want.backward()
    torch.testing.assert_close(loss, want, rtol=1e-12, atol=0)
    for (name, p), q in zip(model.named_parameters(), ref.parameters()):
        torch.testing.assert_close(p.grad, q.grad, rtol=1e-10, atol=1e-12, msg=name)
    return ref


@pytest.mark.parametrize("case", ["two_phase", "two_phase_compiled", "recompute"])
def test_a_model_owned_generator_draws_as_eager_does(case):
    """Drawn once, at the full batch, before the loop (passes/draws.py): the eager step's
    noise and generator state (tests/test_rng.py has the three-step checks)."""
    torch.manual_seed(0)
    model = NoisyBlocks() if case == "recompute" else Noisy(coupled=True)
    batch = _batch(out=4 if case == "recompute" else 3)
    kw = ({"recompute": True} if case == "recompute" else
          {"torch_compile": COMPILED} if case == "two_phase_compiled" else {})
    cm = _compile(model, batch, **kw)
    if case == "recompute":
        assert cm.plan.recompute and "checkpoint" in cm.graph_module.body.code
    else:
        assert cm.analysis.two_phase
    assert "generator" in cm.graph_module.code  # drawn in the top graph, not per microbatch
    model.g.manual_seed(5)
    ref = copy.deepcopy(model)
    cm(*batch)[0].backward()
    ref(*batch)[0].backward()
    for (name, p), q in zip(model.named_parameters(), ref.parameters()):
        torch.testing.assert_close(p.grad, q.grad, rtol=1e-10, atol=1e-12, msg=name)
    assert torch.equal(model.g.get_state(), ref.g.get_state())  # one draw per step


_HIDDEN = torch.Generator().manual_seed(9)  # a generator no module holds


class HiddenNoise(nn.Linear):
    """A trusted layer drawing from a generator mbcompile cannot see."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return super().forward(x) + torch.randn(x.shape[0], self.out_features,
                                                generator=_HIDDEN, dtype=x.dtype)


def test_randomness_a_two_phase_step_cannot_replay_stops_the_step():
    class Net(Noisy):
        def __init__(self) -> None:
            super().__init__(coupled=True)
            self.a = HiddenNoise(4, 3)

        def per_sample(self, x: torch.Tensor) -> torch.Tensor:
            return self.a(x)

    with rules.scoped():
        mbcompile.trust_module(HiddenNoise)
        torch.manual_seed(0)
        model, batch = Net(), _batch()
        cm = _compile(model, batch)
        assert cm.analysis.two_phase
        before = [p.detach().clone() for p in model.parameters()]
        with pytest.raises(mbcompile.MicrobatchError, match="phase 3 than in phase 1"):
            cm(*batch)
        assert all(p.grad is None for p in model.parameters())
        assert all(torch.equal(p, b) for p, b in zip(model.parameters(), before))


# --------------------------------------------------------------------------- batch norm


class BatchNormContrastive(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.a, self.bn, self.b = nn.Linear(4, 6), nn.BatchNorm1d(6), nn.Linear(6, 3)

    def per_sample(self, x: torch.Tensor) -> torch.Tensor:
        return self.b(torch.relu(self.bn(self.a(x))))

    def head(self, h: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        z = F.normalize(h, dim=1)
        return F.mse_loss(h, y) + (z @ z.T).logsumexp(1).mean()

    def forward(self, x: torch.Tensor, y: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        h = self.per_sample(x)
        return self.head(h, y), h


def test_per_microbatch_batch_norm_in_a_two_phase_step_updates_once_per_microbatch():
    torch.manual_seed(0)
    model, batch = BatchNormContrastive(), _batch(10)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", mbcompile.MbcompileWarning)
        cm = mbcompile.compile(model, 10, 2, 3, example_inputs=batch,
                               batch_norm="per_microbatch")
    assert cm.analysis.two_phase and cm.plan.num_nonempty_microbatches == 4
    ref = _against_hand_split(model, cm, batch)
    assert int(model.bn.num_batches_tracked) == int(ref.bn.num_batches_tracked) == 4
    torch.testing.assert_close(model.bn.running_mean, ref.bn.running_mean, rtol=1e-12, atol=0)
