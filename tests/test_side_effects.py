"""Compiling has no side effects on the user's module, and the compiled module moves freely.

- The module, its submodules, their hooks, ``training`` flags, parameters
  (identity, values, ``requires_grad``, ``.grad``), buffers and the global RNG
  are as they were before ``compile`` (and after calls, apart from ``.grad``).
- Hooks and in-place buffer updates in ``forward`` are honoured or rejected,
  never dropped.
- ``state_dict()`` of the compiled module loads into the original and back, also
  when the compiled module sits inside a parent module.
- The compiled module follows the user's parameters when they are replaced.
- ``copy.deepcopy``, ``pickle`` and ``torch.save`` either work (and the copy runs
  and is exact, and independent of the original) or raise a clear MbcompileError.
"""

from __future__ import annotations

import copy
import io
import pickle
import warnings
from typing import Any

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

import mbcompile
from mbcompile import MbcompileError
from mbcompile.models import make_cnn, make_mlp, make_tiny_gpt

DTYPE = torch.float64
GBS = 8


def _models():
    return {
        "mlp": make_mlp(GBS, dtype=DTYPE),
        "cnn": make_cnn(GBS, dtype=DTYPE),
        "tiny_gpt": make_tiny_gpt(GBS, dtype=DTYPE, vocab=16, width=8, depth=1, heads=2, seq=6),
    }


def _compile(model, batch, **kw):
    return mbcompile.compile(model, GBS, 2, 2, example_inputs=batch, **kw)


# --------------------------------------------------------------------------- #
# a full picture of a module's state
# --------------------------------------------------------------------------- #


def _hooks(module: nn.Module) -> dict[str, list[Any]]:
    names = [n for n in vars(module) if n.endswith("_hooks") or n.endswith("_hooks_with_kwargs")
             or "hook" in n]
    out = {}
    for n in sorted(names):
        value = getattr(module, n)
        out[n] = list(value.items()) if isinstance(value, dict) else value
    return out


def _picture(model: nn.Module) -> dict[str, Any]:
    """Everything compile must leave alone, by identity where identity matters."""
    return {
        "type": type(model),
        "modules": [(name, m, type(m), m.training, sorted(vars(m)), _hooks(m),
                     "forward" in vars(m)) for name, m in model.named_modules()],
        "params": [(name, p, p.requires_grad, p.grad, p.detach().clone(), p.dtype, p.device)
                   for name, p in model.named_parameters()],
        "buffers": [(name, b, b.clone()) for name, b in model.named_buffers()],
        "state_dict_keys": list(model.state_dict()),
    }


def _assert_same_picture(before: dict[str, Any], after: dict[str, Any], where: str) -> None:
    assert before["type"] is after["type"], where
    assert before["state_dict_keys"] == after["state_dict_keys"], where
    assert len(before["modules"]) == len(after["modules"]), f"{where}: submodules changed"
    for b, a in zip(before["modules"], after["modules"]):
        name = b[0]
        assert b[0] == a[0] and b[1] is a[1] and b[2] is a[2], f"{where}: submodule {name}"
        assert b[3] == a[3], f"{where}: {name}.training changed"
        assert b[4] == a[4], f"{where}: attributes of {name} changed: {set(a[4]) ^ set(b[4])}"
        assert b[5] == a[5], f"{where}: hooks of {name} changed"
        assert b[6] == a[6], f"{where}: {name}.forward patched"
    assert len(before["params"]) == len(after["params"]), where
    for b, a in zip(before["params"], after["params"]):
        name = b[0]
        assert b[0] == a[0] and b[1] is a[1], f"{where}: parameter {name} replaced"
        assert b[2] == a[2], f"{where}: {name}.requires_grad changed"
        assert b[3] is a[3], f"{where}: {name}.grad changed"
        assert torch.equal(b[4], a[4]), f"{where}: {name} values changed"
        assert (b[5], b[6]) == (a[5], a[6]), f"{where}: {name} dtype/device changed"
    assert len(before["buffers"]) == len(after["buffers"]), where
    for b, a in zip(before["buffers"], after["buffers"]):
        assert b[0] == a[0] and b[1] is a[1], f"{where}: buffer {b[0]} replaced"
        assert torch.equal(b[2], a[2]), f"{where}: buffer {b[0]} values changed"


def _with_hooks(model: nn.Module) -> list[str]:
    """Register harmless hooks on every submodule; returns a log they append to (on each
    microbatch, on purpose: ``mbcompile.per_microbatch``).

    (Hooks on the model itself are a separate case: fx traces ``forward`` directly.)
    """
    log: list[str] = []
    for name, m in list(model.named_modules())[1:]:
        m.register_forward_pre_hook(mbcompile.per_microbatch(
            lambda mod, args, name=name: log.append(f"pre {name}")))
        m.register_forward_hook(mbcompile.per_microbatch(
            lambda mod, args, out, name=name: log.append(f"post {name}")))
    return log


@pytest.mark.parametrize("name", ["mlp", "cnn", "tiny_gpt"])
@pytest.mark.parametrize("mode", ["train", "eval", "mixed"])
def test_compile_leaves_the_module_unchanged(name, mode):
    model, batch = _models()[name]
    _with_hooks(model)
    if mode == "eval":
        model.eval()
    elif mode == "mixed":
        list(model.children())[0].eval()  # a submodule in eval mode inside a training model
    for p in list(model.parameters())[:2]:
        p.grad = torch.ones_like(p)
    list(model.parameters())[-1].requires_grad_(False)
    before = _picture(model)
    rng = torch.get_rng_state()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", mbcompile.MbcompileWarning)
        cm = _compile(model, batch)
    _assert_same_picture(before, _picture(model), "after compile")
    assert torch.equal(rng, torch.get_rng_state()), "compile consumed the global RNG"
    # the compiled module holds the user's module itself: parameters are shared
    assert cm.module is model
    assert {id(p) for p in cm.parameters()} == {id(p) for p in model.parameters()}
    # calls change nothing but gradients
    with torch.no_grad():
        cm(*batch)
    _assert_same_picture(before, _picture(model), "after a no_grad call")


def test_a_leaf_modules_hook_that_records_is_refused_unless_marked_per_microbatch():
    """A torch layer runs its hooks on each microbatch: one that records (F6 of the forward
    fuzzer) would see each microbatch where eager sees the batch, so it is refused, with
    what it wrote put back (compile calls it on made-up data, which it does not keep
    either); marked ``per_microbatch`` it runs on each microbatch, as asked."""
    model, batch = make_mlp(GBS, dtype=DTYPE)
    rows: list[int] = []
    handle = model.net[0].register_forward_hook(
        lambda mod, args, out: rows.append(args[0].shape[0]))
    cm = _compile(model, batch)
    assert rows == []
    with pytest.raises(mbcompile.CaptureError, match=r"writes rows.*per_microbatch\(hook\)"):
        cm(*batch)
    assert rows == [] and all(p.grad is None for p in model.parameters())
    handle.remove()
    model.net[0].register_forward_hook(mbcompile.per_microbatch(
        lambda mod, args, out: rows.append(args[0].shape[0])))
    cm(*batch)
    assert rows == [2, 2, 2, 2]  # gbs 8 over 2 systems, mbs 2


class RootScaled(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(8, 3)

    def forward(self, x, y):
        pred = self.lin(x)
        return F.mse_loss(pred, y), pred


def test_forward_hooks_on_the_model_itself_are_honoured_or_rejected():
    """A hook on the root module that changes the inputs or outputs must not be dropped."""
    torch.manual_seed(0)
    model = RootScaled().to(DTYPE)
    _, batch = make_mlp(GBS, dtype=DTYPE)
    model.register_forward_pre_hook(lambda mod, args: (args[0] * 2, args[1]))
    model.register_forward_hook(lambda mod, args, out: (out[0] * 10, out[1]))
    try:
        cm = _compile(model, batch)
    except MbcompileError as err:
        assert "hook" in str(err)
        return
    want, got = model(*batch), cm(*batch)
    assert torch.allclose(got[0], want[0], rtol=1e-10, atol=0), (
        f"hooks on the model dropped silently: compiled loss {got[0].item()}, eager "
        f"{want[0].item()}")
    assert torch.allclose(got[1], want[1], rtol=1e-10, atol=0)


class Counter(nn.Module):
    """Counts its calls in a buffer, in place, inside forward."""

    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(8, 3)
        self.register_buffer("calls", torch.zeros((), dtype=DTYPE))

    def forward(self, x, y):
        self.calls.add_(1)
        return F.mse_loss(self.lin(x), y)


class RunningSum(nn.Module):
    """Accumulates a statistic of the batch into a buffer, in place, inside forward."""

    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(8, 3)
        self.register_buffer("total", torch.zeros(3, dtype=DTYPE))

    def forward(self, x, y):
        h = self.lin(x)
        self.total.add_(h.detach().sum(0))
        return F.mse_loss(h, y)


@pytest.mark.parametrize("cls", [Counter, RunningSum])
def test_in_place_buffer_updates_are_kept_or_rejected(cls):
    """compile must not run them on the user's buffers, nor silently drop them."""
    torch.manual_seed(0)
    model = cls().to(DTYPE)
    reference = copy.deepcopy(model)
    _, batch = make_mlp(GBS, dtype=DTYPE)
    before = {k: v.clone() for k, v in model.state_dict().items()}
    try:
        cm = _compile(model, batch)
    except MbcompileError as err:
        assert "in place" in str(err) or "in-place" in str(err) or "buffer" in str(err), err
        compiled = False
    else:
        compiled = True
    for k, v in model.state_dict().items():
        assert torch.equal(v, before[k]), f"compile changed {k}: {before[k]} -> {v}"
    if compiled:
        cm(*batch)
        reference(*batch)
        for (k, got), want in zip(model.named_buffers(), reference.buffers()):
            assert torch.allclose(got, want, rtol=1e-10, atol=0), (
                f"buffer {k} is {got} after a compiled call and {want} after an eager one")


# --------------------------------------------------------------------------- #
# state dicts
# --------------------------------------------------------------------------- #


def _perturbed(sd: dict[str, torch.Tensor], seed: int) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return {k: (v + torch.randn(v.shape, generator=g, dtype=v.dtype) if v.is_floating_point()
                else v.clone()) for k, v in sd.items()}


@pytest.mark.parametrize("name", ["mlp", "cnn"])
def test_state_dict_round_trip(name):
    model, batch = _models()[name]
    cm = _compile(model, batch)
    sd = cm.state_dict()
    assert list(sd) == list(model.state_dict())
    # compiled -> a fresh original
    fresh, _ = {"mlp": make_mlp, "cnn": make_cnn}[name](GBS, seed=1, dtype=DTYPE)
    fresh.load_state_dict(sd)
    for k, v in fresh.state_dict().items():
        assert torch.equal(v, sd[k]), k
    # an original's (changed) weights -> compiled, and the compiled call uses them
    new = _perturbed(model.state_dict(), 3)
    cm.load_state_dict(new)
    for k, v in model.state_dict().items():
        assert torch.equal(v, new[k]), k
    fresh.load_state_dict(new)
    with torch.no_grad():
        assert torch.allclose(cm(*batch)[0], fresh(*batch)[0], rtol=1e-10, atol=0)


def test_state_dict_round_trip_through_a_parent_module():
    model, batch = make_mlp(GBS, dtype=DTYPE)
    cm = _compile(model, batch)
    parent = nn.ModuleDict({"head": nn.Linear(2, 2).to(DTYPE), "body": cm})
    sd = parent.state_dict()
    parent.load_state_dict(sd)  # what torch.save(parent.state_dict()) + load does
    clone = nn.ModuleDict({"head": nn.Linear(2, 2).to(DTYPE),
                           "body": _compile(make_mlp(GBS, seed=2, dtype=DTYPE)[0], batch)})
    clone.load_state_dict(sd)
    for k, v in clone.state_dict().items():
        assert torch.equal(v, sd[k]), k


def test_compiled_module_follows_replaced_parameters():
    """load_state_dict(assign=True) swaps the Parameter objects; the compiled call must see it."""

    class Functional(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.w = nn.Parameter(torch.randn(8, 3, dtype=DTYPE))  # used directly: get_attr
            self.lin = nn.Linear(3, 3).to(DTYPE)

        def forward(self, x, y):
            return F.mse_loss(self.lin(x @ self.w), y)

    torch.manual_seed(0)
    model = Functional()
    x, _ = make_mlp(GBS, dtype=DTYPE)[1]
    y = torch.randn(GBS, 3, dtype=DTYPE)
    cm = _compile(model, (x, y))
    model.load_state_dict(_perturbed(model.state_dict(), 4), assign=True)
    with torch.no_grad():
        got, want = cm(x, y), model(x, y)
    assert torch.allclose(got, want, rtol=1e-10, atol=0), (
        f"compiled {got.item()} vs eager {want.item()}: the graph kept the old parameters")
    got = cm(x, y)
    got.backward()
    assert model.w.grad is not None, "the gradient went to the replaced parameter"


def test_compiled_module_follows_a_replaced_submodule_and_its_slots():
    """After calls have been made (the module list is kept between calls), a submodule
    replaced by assignment is seen by the next call, and so is a parameter of the new
    submodule swapped by hand in its slot (as FSDP2 swaps them): the graph reads that
    parameter directly (get_attr copies the reference), so only a recompile follows it."""

    class Inner(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.w = nn.Parameter(torch.randn(8, 3, dtype=DTYPE))  # used directly: get_attr

        def forward(self, x):
            return torch.tanh(x @ self.w)

    class Net(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.inner = Inner()
            self.lin = nn.Linear(3, 3).to(DTYPE)

        def forward(self, x, y):
            return F.mse_loss(self.lin(self.inner(x)), y)

    torch.manual_seed(0)
    model = Net()
    x, _ = make_mlp(GBS, dtype=DTYPE)[1]
    y = torch.randn(GBS, 3, dtype=DTYPE)
    cm = _compile(model, (x, y))
    for _ in range(2):
        cm(x, y).backward()

    def same() -> None:
        with torch.no_grad():
            got, want = cm(x, y), model(x, y)
        assert torch.allclose(got, want, rtol=1e-10, atol=0), (
            f"compiled {got.item()} vs eager {want.item()}: the graph kept an old parameter")
        model.zero_grad(set_to_none=True)
        cm(x, y).backward()
        assert model.inner.w.grad is not None, "the gradient went to a replaced parameter"

    old = model.inner
    model.inner = Inner()
    old.zero_grad(set_to_none=True)
    same()
    assert old.w.grad is None, "the gradient went to the replaced submodule"
    model.inner._parameters["w"] = nn.Parameter(torch.randn(8, 3, dtype=DTYPE))
    same()


# --------------------------------------------------------------------------- #
# copies
# --------------------------------------------------------------------------- #


def _step(cm: nn.Module, model: nn.Module, batch) -> tuple[torch.Tensor, list[torch.Tensor]]:
    model.zero_grad(set_to_none=True)
    loss = cm(*batch)[0]
    loss.backward()
    return loss.detach(), [p.grad.clone() for p in model.parameters()]


@pytest.mark.parametrize("name", ["mlp", "tiny_gpt"])
def test_deepcopy_works_and_is_exact_and_independent(name):
    model, batch = _models()[name]
    cm = _compile(model, batch)
    try:
        twin = copy.deepcopy(cm)
    except MbcompileError as err:  # allowed, if it says what to do
        assert "compile" in str(err)
        return
    assert twin.module is not model
    assert not {id(p) for p in twin.parameters()} & {id(p) for p in model.parameters()}
    assert twin.plan == cm.plan
    loss, grads = _step(cm, model, batch)
    twin_loss, twin_grads = _step(twin, twin.module, batch)
    assert torch.equal(loss, twin_loss)
    assert all(torch.equal(a, b) for a, b in zip(grads, twin_grads))
    # training the copy leaves the original alone
    with torch.no_grad():
        for p in twin.module.parameters():
            p.add_(1)
    assert torch.equal(_step(cm, model, batch)[0], loss)


def _round_trip(obj: Any, how: str) -> Any:
    if how == "pickle":
        return pickle.loads(pickle.dumps(obj))
    buffer = io.BytesIO()
    torch.save(obj, buffer)
    buffer.seek(0)
    return torch.load(buffer, weights_only=False)


@pytest.mark.parametrize("how", ["pickle", "torch.save"])
def test_pickling_works_or_raises_a_clear_error(how):
    model, batch = make_mlp(GBS, dtype=DTYPE)
    cm = _compile(model, batch)
    try:
        twin = _round_trip(cm, how)
    except MbcompileError as err:
        assert "deepcopy" in str(err) or "state_dict" in str(err), err
        return
    except Exception as err:  # anything else is a crash, not a clear error
        pytest.fail(f"{how} of a CompiledModule raised {type(err).__name__}: {err}")
    assert twin.plan == cm.plan
    loss, grads = _step(cm, model, batch)
    twin_loss, twin_grads = _step(twin, twin.module, batch)
    assert torch.equal(loss, twin_loss)
    assert all(torch.equal(a, b) for a, b in zip(grads, twin_grads))

