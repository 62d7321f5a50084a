"""Capture: what can be traced, what cannot (and how that is reported), and what is left alone."""

from __future__ import annotations

import copy
import inspect
import operator
import warnings
from typing import Any

import pytest
import torch
import torch.fx as fx
import torch.nn as nn
import torch.nn.functional as F
from models import (
    MODELS,
    TOL,
    grad_errors,
    grads_of,
    max_rel_err_outputs,
    tensor_leaves,
)

import mbcompile
from mbcompile import CaptureError, InputError, MbcompileError
from mbcompile.passes.capture import capture


class Branchy(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(6, 4)

    def forward(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        h = self.lin(x)
        if h.sum() > 0:  # untraceable
            h = -h
        return F.cross_entropy(h, y)


class StarArgs(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(6, 4)

    def forward(self, *inputs: torch.Tensor) -> torch.Tensor:
        return self.lin(inputs[0]).pow(2).mean()


class StarKwargs(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(6, 4)

    def forward(self, x: torch.Tensor, **extra: torch.Tensor) -> torch.Tensor:
        return self.lin(x).pow(2).mean()


def _xy(batch: int = 10) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    return (torch.randn(batch, 6, generator=g, dtype=torch.float64),
            torch.randint(0, 4, (batch,), generator=g))


def test_untraceable_control_flow_names_the_line() -> None:
    model = Branchy().double()
    with pytest.raises(CaptureError) as info:
        mbcompile.compile(model, 10, 2, 1, example_inputs=_xy())
    message = str(info.value)
    lines, start = inspect.getsourcelines(Branchy.forward)
    offset = next(i for i, line in enumerate(lines) if "# untraceable" in line)
    assert f"test_capture.py:{start + offset}" in message, message
    assert "if h.sum() > 0:" in message
    assert "Branchy" in message
    assert "GraphModule" in message  # one of the ways out
    assert isinstance(info.value, MbcompileError)


def test_star_args_forward_is_a_capture_error() -> None:
    x, _ = _xy()
    with pytest.raises(CaptureError, match=StarArgs.__name__):
        mbcompile.compile(StarArgs().double(), 10, 2, 1, example_inputs=(x,))


def test_star_kwargs_forward_maps_its_named_parameters() -> None:
    """forward(x, **extra), the HuggingFace shape: captured through torch.export; a keyword
    that reaches **extra is one more graph input (issue 27)."""
    x, _ = _xy()
    model = StarKwargs().double()
    cm = mbcompile.compile(model, 10, 2, 1, example_inputs=(x,))
    assert torch.allclose(cm(x), model(x), rtol=1e-12, atol=0)
    cm = mbcompile.compile(model, 10, 2, 1, example_inputs=(x,), example_kwargs={"z": x})
    assert torch.allclose(cm(x, z=x), model(x, z=x), rtol=1e-12, atol=0)
    with pytest.raises(CaptureError, match="capture='auto'"):
        mbcompile.compile(model, 10, 2, 1, example_inputs=(x,), capture="fx")


def test_not_a_module_is_refused() -> None:
    x, _ = _xy()
    with pytest.raises(mbcompile.ArgumentTypeError):
        mbcompile.compile(lambda t: t.sum(), 10, 2, 1, example_inputs=(x,))  # type: ignore[arg-type]


def test_example_inputs_are_required() -> None:
    model, _ = MODELS["mlp"](10)
    with pytest.raises(InputError, match="example_inputs"):
        mbcompile.compile(model, 10, 2, 1)


def test_traced_graph_module_is_accepted() -> None:
    model, batch = MODELS["mlp"](10)
    gm = fx.symbolic_trace(model)
    cm = mbcompile.compile(gm, 10, 3, 2, example_inputs=batch)
    assert isinstance(cm(*batch), tuple)
    # The GraphModule shares the model's parameters: training it trains the model.
    model.zero_grad(set_to_none=True)
    out = cm(*batch)
    out[0].backward()
    got = grads_of(model)
    model.zero_grad(set_to_none=True)
    want = model(*batch)
    want[0].backward()
    assert max(max_rel_err_outputs(out, want).values()) <= TOL
    assert max(grad_errors(got, grads_of(model)).values()) <= TOL


def test_traced_graph_module_with_dict_output() -> None:
    model, batch = MODELS["dict_out"](10)
    gm = fx.symbolic_trace(model)
    cm = mbcompile.compile(gm, 10, 3, 2, example_inputs=batch)
    with torch.no_grad():
        out, want = cm(*batch), model(*batch)
    assert list(out) == list(want)
    assert max(max_rel_err_outputs(out, want).values()) <= TOL


@pytest.mark.parametrize("name", ["tensor_out", "mlp", "dict_out", "dataclass_out",
                                  "namedtuple_out", "tiny_gpt"])
def test_capture_pass_alone_flattens_and_rebuilds(name: str) -> None:
    model, batch = MODELS[name](5)
    result = capture(model)
    flat = result.graph_module(*batch)
    assert isinstance(flat, tuple)
    assert all(isinstance(t, torch.Tensor) for t in flat)
    want = model(*batch)
    assert len(flat) == len(tensor_leaves(want))
    rebuilt = result.output_spec.rebuild(flat)
    assert type(rebuilt) is type(want)
    assert max(max_rel_err_outputs(rebuilt, want).values()) == 0.0


def test_capture_records_source_lines() -> None:
    model, _ = MODELS["mlp"](5)
    gm = capture(model).graph_module
    calls = [n for n in gm.graph.nodes if n.op in ("call_function", "call_method", "call_module")]
    assert calls and all(n.stack_trace for n in calls)
    assert any("mse_loss" in (n.stack_trace or "") for n in calls)


# --------------------------------------------------------------------------- #
# The user's module is left alone
# --------------------------------------------------------------------------- #

_HOOK_DICTS = ("_forward_hooks", "_forward_pre_hooks", "_backward_hooks",
               "_backward_pre_hooks", "_state_dict_hooks", "_load_state_dict_pre_hooks",
               "_load_state_dict_post_hooks", "_state_dict_pre_hooks")


def _snapshot(model: nn.Module) -> dict:
    return {
        "type": type(model),
        "params": [(n, p) for n, p in model.named_parameters()],
        "buffers": [(n, b) for n, b in model.named_buffers()],
        "modules": [(n, type(m), m.training) for n, m in model.named_modules()],
        "hooks": [(n, h, len(getattr(m, h, {}))) for n, m in model.named_modules()
                  for h in _HOOK_DICTS],
        "dicts": [(n, sorted(m.__dict__)) for n, m in model.named_modules()],
        "state": {k: v.clone() for k, v in model.state_dict().items()},
        "requires_grad": [p.requires_grad for p in model.parameters()],
    }


@pytest.mark.parametrize("name", ["tiny_gpt", "cnn", "batch_norm"])
def test_user_module_is_unchanged(name: str) -> None:
    model, batch = MODELS[name](10)
    if name == "batch_norm":
        model.eval()  # compiles in eval; BatchNorm's buffers must not move
    before = _snapshot(model)
    twin = copy.deepcopy(model)
    cm = mbcompile.compile(model, 10, 3, 2, example_inputs=batch)
    with torch.no_grad():
        cm(*batch)
    after = _snapshot(model)
    assert after["type"] is before["type"]
    assert all(n1 == n2 and p1 is p2 for (n1, p1), (n2, p2) in zip(after["params"],
                                                                     before["params"]))
    assert len(after["params"]) == len(before["params"])
    assert all(b1 is b2 for (_, b1), (_, b2) in zip(after["buffers"], before["buffers"]))
    for key in ("modules", "hooks", "dicts", "requires_grad"):
        assert after[key] == before[key], key
    assert after["state"].keys() == before["state"].keys()
    assert all(torch.equal(after["state"][k], before["state"][k]) for k in before["state"])
    # The model still runs eagerly, as its untouched twin does.
    with torch.no_grad():
        assert max(max_rel_err_outputs(model(*batch), twin(*batch)).values()) == 0.0


def test_compile_does_not_flip_training_flags() -> None:
    model, batch = MODELS["mlp"](10)
    model.net[1].eval()  # a mixed state the user chose
    flags = [m.training for m in model.modules()]
    mbcompile.compile(model, 10, 3, 2, example_inputs=batch)
    assert [m.training for m in model.modules()] == flags


def test_capture_error_leaves_module_unchanged() -> None:
    model = Branchy().double()
    before = _snapshot(model)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        with pytest.raises(CaptureError):
            mbcompile.compile(model, 10, 2, 1, example_inputs=_xy())
    after = _snapshot(model)
    for key in ("modules", "hooks", "dicts"):
        assert after[key] == before[key], key


# --------------------------------------------------------------------------- #
# torch.export capture: what it changes in the user's terms, and what it leaves alone
# --------------------------------------------------------------------------- #

class _Cache:
    """Inference state export cannot flatten (as transformers' DynamicCache)."""

    def __init__(self, h: torch.Tensor) -> None:
        self.h = h


class _InstanceConfig:
    def __init__(self) -> None:
        self.use_cache = True


class _ClassConfig:
    use_cache = True  # a class default, as configs that never set it


_SEEN_USE_CACHE: list[bool] = []  # module-level: export restores what forward sets on self


class CacheThroughKwargs(nn.Module):
    """Reads use_cache from its config unless **kwargs set it (GraniteMoE, PEFT's PeftModel):
    the example call cannot switch it off, since compile maps named parameters only."""

    def __init__(self, config: object) -> None:
        super().__init__()
        self.config = config
        self.lin = nn.Linear(4, 4)

    def forward(self, x: torch.Tensor, **kwargs: object) -> tuple[object, ...]:
        use_cache = kwargs.get("use_cache", self.config.use_cache)
        _SEEN_USE_CACHE.append(bool(use_cache))
        h = self.lin(x)
        out = ((h + 0.5).pow(3).mean(), h)
        return (*out, _Cache(h)) if use_cache else out


@pytest.mark.parametrize("config", [_InstanceConfig, _ClassConfig])
def test_export_switches_the_cache_off_and_restores_the_config(config: type) -> None:
    torch.manual_seed(0)
    model = CacheThroughKwargs(config()).double()
    own_before = dict(vars(model.config))
    x = torch.randn(6, 4, dtype=torch.float64)
    with pytest.raises(RuntimeError, match="not a known type"):  # with the cache left on
        torch.export.export(model, (x,))
    _SEEN_USE_CACHE.clear()
    cm = mbcompile.compile(model, 6, 2, 2, example_inputs=(x,))
    assert vars(model.config) == own_before and model.config.use_cache is True
    got = cm(x)
    # traced with the cache off: the append to the module-level list is the trace's,
    # replayed once per step (the capture put the list back as it was)
    assert _SEEN_USE_CACHE == [False]
    want = model(x)
    assert len(want) == 3 and len(got) == 2  # eager still builds its cache; the step does not
    assert max(max_rel_err_outputs(got, want[:2]).values()) <= TOL


class TransposedReshape(nn.Module):
    """(B, T, C) -> linear -> (B, C, T) contiguous -> (B, C*T), with an in-place op: export
    functionalizes the graph and writes the reshape as a view, valid only for the strides
    it traced with."""

    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(4, 3)

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        h = self.lin(x).transpose(1, 2).contiguous().reshape(x.size(0), -1)
        h = h.clone().add_(0.5)  # an in-place op: export's graph is functionalized
        return h.pow(3).mean(), h


def test_export_views_become_reshapes() -> None:
    """A graph that runs whatever strides the kernels give at run time (T5's view of a
    transposed attention output failed on both fake and real tensors)."""
    torch.manual_seed(0)
    model = TransposedReshape().double()
    x = torch.randn(6, 5, 4, dtype=torch.float64)
    exported = torch.export.export(model, (x,)).run_decompositions({}).graph_module
    assert torch.ops.aten.view.default in [n.target for n in exported.graph.nodes]
    cm = mbcompile.compile(model, 6, 2, 2, example_inputs=(x,), capture="export")
    targets = [n.target for n in cm.original_graph_module.graph.nodes]
    assert torch.ops.aten.view.default not in targets
    assert torch.ops.aten.reshape.default in targets
    assert max(max_rel_err_outputs(cm(x), model(x)).values()) <= TOL


class _Reverse(torch.autograd.Function):
    """Gradient reversal (domain adaptation): the identity forward, -g/2 backward."""

    @staticmethod
    def forward(ctx, x):
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad):
        return -0.5 * grad


class _Swish(torch.autograd.Function):
    """A hand-written derivative (as BLOOM's GeLUFunction): backward is forward's derivative."""

    @staticmethod
    def forward(ctx, x):
        ctx.save_for_backward(x)
        return x * torch.sigmoid(x)

    @staticmethod
    def backward(ctx, grad):
        (x,) = ctx.saved_tensors
        s = torch.sigmoid(x)
        return grad * (s + x * s * (1 - s))


class _SwishNew(torch.autograd.Function):
    """The same, written the new way (forward without ctx, setup_context)."""

    @staticmethod
    def forward(x):
        return x * torch.sigmoid(x)

    @staticmethod
    def setup_context(ctx, inputs, output):
        ctx.save_for_backward(inputs[0])

    @staticmethod
    def backward(ctx, grad):
        (x,) = ctx.saved_tensors
        s = torch.sigmoid(x)
        return grad * (s + x * s * (1 - s))


@mbcompile.trust_module
class _ReverseLayer(nn.Module):
    def forward(self, x):
        return _Reverse.apply(x)


class _WithFunction(nn.Module):
    """A classifier whose hidden features pass a custom Function, bare or in a trusted layer."""

    def __init__(self, function: type | None) -> None:
        super().__init__()
        self.inp, self.head, self.function = nn.Linear(8, 8), nn.Linear(8, 3), function
        self.rev = _ReverseLayer()

    def forward(self, x, y):
        h = torch.tanh(self.inp(x))
        h = self.rev(h) if self.function is None else self.function.apply(h)  # the line
        return F.cross_entropy(self.head(h), y)


def _with_function(function: type | None) -> tuple[nn.Module, tuple[torch.Tensor, ...]]:
    torch.manual_seed(0)
    g = torch.Generator().manual_seed(1)
    return _WithFunction(function).double(), (
        torch.randn(10, 8, generator=g, dtype=torch.float64),
        torch.randint(0, 3, (10,), generator=g))


def _assert_step_exact(model: nn.Module, batch: tuple[torch.Tensor, ...], **kw: Any) -> None:
    ref = copy.deepcopy(model)
    cm = mbcompile.compile(model, 10, 2, 2, example_inputs=batch, **kw)
    cm(*batch).backward()
    ref(*batch).backward()
    errors = grad_errors(grads_of(model), grads_of(ref))
    assert errors and max(errors.values()) <= TOL


@pytest.mark.parametrize("how", ["fx", "export", "auto"])
def test_a_custom_function_whose_backward_is_not_its_derivative_is_refused(how: str) -> None:
    """Tracing records a Function's forward ops and drops its backward: a gradient reversal
    would train with the identity's derivative (silently wrong), so it is refused at its
    line: by fx, which cannot test it, and by export (and auto, after fx) once the two
    derivatives were compared on random inputs."""
    model, batch = _with_function(_Reverse)
    before = {n: p.detach().clone() for n, p in model.state_dict().items()}
    rng = torch.random.get_rng_state()
    apply = torch.autograd.Function.__dict__["apply"]
    with pytest.raises(CaptureError) as info:
        mbcompile.compile(model, 10, 2, 2, example_inputs=batch, capture=how)
    message = str(info.value)
    line = inspect.getsource(_WithFunction.forward).splitlines()[2].strip()
    assert "custom autograd.Function _Reverse" in message and line in message
    assert "trust_module" in message
    assert ("differ by 1.5 relative" in message) == (how != "fx")
    assert all(torch.equal(p, before[n]) for n, p in model.state_dict().items())
    assert torch.equal(torch.random.get_rng_state(), rng)  # the check drew from its own RNG
    assert torch.autograd.Function.__dict__["apply"] is apply  # the patch is undone


@pytest.mark.parametrize("function", [_Swish, _SwishNew], ids=["old-style", "new-style"])
@pytest.mark.parametrize("how", ["export", "auto"])
def test_a_custom_function_whose_backward_is_its_derivative_is_kept(how, function) -> None:
    model, batch = _with_function(function)
    _assert_step_exact(model, batch, capture=how)


class _GradMultiply(torch.autograd.Function):
    """fairseq's: the identity forward, g * scale backward (the derivative only at scale 1)."""

    @staticmethod
    def forward(ctx, x, scale):
        ctx.scale = scale
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad):
        return grad * ctx.scale, None


class _MaskedRound(torch.autograd.Function):
    """A straight-through estimator where ``mask`` is set: forward rounds, backward passes g."""

    @staticmethod
    def forward(ctx, x, mask):
        return torch.where(mask, x.round(), x)

    @staticmethod
    def backward(ctx, grad):
        return grad, None


class _Sqrt(torch.autograd.Function):
    """sqrt with its own derivative: NaN on the check's negative inputs, as is autograd's."""

    @staticmethod
    def forward(ctx, x):
        ctx.save_for_backward(x)
        return torch.sqrt(x)

    @staticmethod
    def backward(ctx, grad):
        (x,) = ctx.saved_tensors
        return grad / (2 * torch.sqrt(x))


class _WrongSqrt(_Sqrt):
    """The same NaN places, but a wrong sign and scale."""

    @staticmethod
    def backward(ctx, grad):
        (x,) = ctx.saved_tensors
        return -10.0 * grad / (2 * torch.sqrt(x))


class _Subtle(nn.Module):
    """Functions a check on one call, without masks or on NaN would wrongly pass."""

    def __init__(self, kind: str) -> None:
        super().__init__()
        self.inp, self.mid, self.head, self.kind = (nn.Linear(8, 8), nn.Linear(8, 8),
                                                    nn.Linear(8, 3), kind)

    def forward(self, x, y):
        h = torch.tanh(self.inp(x))
        if self.kind == "second-call":  # the first call's backward is the derivative
            h = _GradMultiply.apply(torch.tanh(self.mid(_GradMultiply.apply(h, 1.0))), -1.0)
        elif self.kind == "masked":
            h = _MaskedRound.apply(h, h.detach().abs() > 0)
        else:  # positive here, but the check's inputs are random normals
            sqrt = _WrongSqrt if self.kind == "wrong-sqrt" else _Sqrt
            h = sqrt.apply(F.softplus(h) + 1e-3)
        return F.cross_entropy(self.head(h), y)


@pytest.mark.parametrize("kind", ["second-call", "masked", "wrong-sqrt", "under-no-grad"])
def test_subtly_wrong_backwards_are_refused_by_the_export_check(kind: str) -> None:
    torch.manual_seed(0)
    model = (_WithFunction(_Reverse) if kind == "under-no-grad" else _Subtle(kind)).double()
    _, batch = _with_function(None)
    with pytest.raises(CaptureError, match="differ by|not finite at the same places"):
        with torch.set_grad_enabled(kind != "under-no-grad"):
            mbcompile.compile(model, 10, 2, 2, example_inputs=batch, capture="export")


def test_a_right_backward_with_nan_on_random_inputs_is_kept() -> None:
    torch.manual_seed(0)
    _, batch = _with_function(None)
    _assert_step_exact(_Subtle("sqrt").double(), batch, capture="auto")


def test_a_custom_function_in_a_trusted_module_keeps_its_backward() -> None:
    model, batch = _with_function(None)
    _assert_step_exact(model, batch, capture="fx")


class _Checkpointed(nn.Module):
    """torch's own reentrant checkpoint is a Function too, whose backward is the forward's
    derivative: tracing through it is exact, so it is not refused."""

    def __init__(self) -> None:
        super().__init__()
        self.inp, self.head = nn.Linear(8, 8), nn.Linear(8, 3)

    def forward(self, x, y):
        h = torch.utils.checkpoint.checkpoint(torch.tanh, self.inp(x), use_reentrant=True)
        return F.cross_entropy(self.head(h), y)


def test_torch_reentrant_checkpoint_is_traced_through() -> None:
    torch.manual_seed(0)
    _, batch = _with_function(None)
    _assert_step_exact(_Checkpointed().double(), batch)


def test_the_function_watch_is_undone_when_threads_finish_out_of_order() -> None:
    """Capture A starts, capture B starts on another thread, A ends, B ends: torch's
    Function.apply is its own again, and while B ran, A's thread called it unwatched."""
    import threading

    from mbcompile.passes.custom_functions import _watching

    apply = torch.autograd.Function.__dict__["apply"]
    seen: dict[str, list[str]] = {"a": [], "b": []}
    b_in, a_out = threading.Event(), threading.Event()
    x = torch.ones(2, requires_grad=True)

    def capture_b() -> None:
        with _watching(lambda cls, *_: seen["b"].append(cls.__name__)):
            b_in.set()
            a_out.wait(10)
            _Swish.apply(x)

    with _watching(lambda cls, *_: seen["a"].append(cls.__name__)):
        thread = threading.Thread(target=capture_b)
        thread.start()
        b_in.wait(10)
        _Reverse.apply(x)
    _GradMultiply.apply(x, 2.0)  # A is over, B is not: this thread's call is nobody's
    a_out.set()
    thread.join(10)
    assert seen == {"a": ["_Reverse"], "b": ["_Swish"]}
    assert torch.autograd.Function.__dict__["apply"] is apply


class _Unpacks(nn.Module):
    """Unpacks a shape (an attribute proxy) and a split (a call's proxy), then iterates."""

    def __init__(self, iterate: bool = False) -> None:
        super().__init__()
        self.lin = nn.Linear(4, 4)
        self.iterate = iterate

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, c = x.shape
        p, q = self.lin(x).split(2, dim=2)
        y = p.reshape(b, t * 2) + q.reshape(b, t * 2) * c
        if self.iterate:
            y = sum(row for row in y)  # iterating a proxy: fx refuses it
        return y.sum()


def test_unpacking_a_proxy_traces_as_fx_does(monkeypatch: pytest.MonkeyPatch) -> None:
    """The capture's proxies read the calling function's instructions once per function
    (``fx_tracer._Proxy``); the graph is fx's own proxies', node for node, and iterating a
    proxy is refused as fx refuses it."""
    from mbcompile.passes import fx_tracer

    gm = capture(_Unpacks()).graph_module
    monkeypatch.setattr(fx_tracer.FlatOutputTracer, "proxy", fx.Tracer.proxy)
    assert gm.code == capture(_Unpacks()).graph_module.code
    assert sum(n.target is operator.getitem for n in gm.graph.nodes) == 5  # b, t, c; p, q
    monkeypatch.undo()
    with pytest.raises(CaptureError, match="cannot be iterated"):
        capture(_Unpacks(iterate=True))


def test_a_backward_hook_under_fsdp2_is_refused_with_a_fix_that_applies():
    """A sharded model's layers are traced through (their parameters are stand-ins for the
    shards), so "register it on the torch layers inside" would not help: the message says
    what does (a hunt on ranks)."""
    from mbcompile.passes.fx_tracer import FlatOutputTracer

    class Net(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.a, self.head = nn.Linear(3, 3), nn.Linear(3, 2)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return self.head(self.a(x)).sum()

    model = Net()
    model.head.register_full_backward_hook(lambda *args: None)
    with pytest.raises(CaptureError, match="sharded with FSDP2.*register_hook"):
        FlatOutputTracer({id(model): model}, "Net").trace(model)
    FlatOutputTracer(None, "Net").trace(model)  # unsharded: the layer's call keeps its hook
