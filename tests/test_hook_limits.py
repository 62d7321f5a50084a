"""Hooks and autograd next to the maths (issue 35): each case docs/limits.md listed as silently
different is now exact or refused. Each is run for three steps against eager, through the
fuzzer's oracle (``tests/fuzz/oracle.py``: loss, outputs, every gradient, buffers, parameters,
generators and the modules' Python state), with an SGD optimizer with momentum between the
steps, whose parameters and state must match eager's too; a refusal must change nothing."""

from __future__ import annotations

import copy
import math
import threading
import warnings
from collections.abc import Callable
from typing import Any

import pytest
import torch
import torch.nn as nn
from fuzz import Spec, build, make_inputs
from fuzz.oracle import _value_error, python_state, state_changes, state_of, step_errors
from models import assert_close_errors, rel_err, tanh_pair

import mbcompile
from mbcompile import MbcompileError

pytestmark = pytest.mark.filterwarnings("ignore")

_STEPS = 3


def _optimizer(model: nn.Module) -> torch.optim.Optimizer:
    return torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)


def three_steps(spec: Spec, **options: Any) -> str | None:
    """Three compiled steps of ``spec``'s model against three eager steps of a copy: every
    step's errors within ``spec.rel``, and after each optimizer step the parameters and the
    momentum buffers equal. Returns None, or the refusal's message (compile or step), after
    checking that the refusal changed nothing."""
    model, ref = build(spec), build(spec)
    inputs = make_inputs(spec)
    if spec.torch_compile:
        options["torch_compile"] = {"backend": "aot_eager"}
    before, python = state_of(model), _python(model)
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            cm = mbcompile.compile(model, spec.gbs, spec.num_csx, spec.mbs,
                                   example_inputs=make_inputs(spec, spec.example_batch),
                                   recompute=spec.recompute, **options)
    except MbcompileError as err:
        _assert_unchanged(model, before, python, "a refused compile")
        return str(err)
    _assert_unchanged(model, before, python, "compile")
    opt, ref_opt = _optimizer(model), _optimizer(ref)
    for step in range(_STEPS):
        opt.zero_grad(set_to_none=True)
        before, python, momenta = state_of(model), _python(model), _momenta(opt)
        try:
            errors = step_errors(model, cm, ref, inputs, seed=spec.seed + step)
        except MbcompileError as err:
            _assert_unchanged(model, before, python, f"refused step {step}")
            assert _same(momenta, _momenta(opt)), "a refused step changed the optimizer"
            return str(err)
        assert_close_errors(errors, spec.rel)
        opt.step()
        ref_opt.step()
        after = {f"parameter {n}": rel_err(p.detach(), q.detach(), 1e-3) for (n, p), (_, q)
                 in zip(model.named_parameters(), ref.named_parameters())}
        after.update({f"momentum {i}": rel_err(a, b, 1e-3) if a is not None and b is not None
                      else (0.0 if a is b else math.inf)
                      for i, (a, b) in enumerate(zip(_momenta(opt), _momenta(ref_opt)))})
        assert_close_errors(after, spec.rel)
    return None


def _python(model: nn.Module) -> dict[str, Any]:
    """The modules' Python state, copied (tensors detached: legacy weight_norm's is not a
    leaf, which ``copy.deepcopy`` refuses)."""
    def frozen(v: Any) -> Any:
        if isinstance(v, torch.Tensor):
            return v.detach().clone()
        if isinstance(v, dict):
            return {k: frozen(x) for k, x in v.items()}
        if isinstance(v, (list, tuple)):
            return type(v)(frozen(x) for x in v)
        return copy.copy(v)

    return {k: frozen(v) for k, v in python_state(model).items()}


def _assert_unchanged(model: nn.Module, before: dict[str, Any], python: dict[str, Any],
                      what: str) -> None:
    """Parameters, gradients, buffers, hooks, generators and every module's Python state
    (containers and tensors in attributes too) as they were."""
    assert not state_changes(before, state_of(model)), f"{what} changed the model"
    now = python_state(model)
    changed = [k for k in python.keys() | now.keys()
               if k not in now or k not in python or _value_error(now[k], python[k]) != 0]
    assert not changed, f"{what} changed Python state: {changed}"


def _momenta(opt: torch.optim.Optimizer) -> list[torch.Tensor | None]:
    return [None if opt.state[p].get("momentum_buffer") is None
            else opt.state[p]["momentum_buffer"].clone()
            for group in opt.param_groups for p in group["params"]]


def _same(a: list[torch.Tensor | None], b: list[torch.Tensor | None]) -> bool:
    return all((x is None and y is None) or (x is not None and y is not None and torch.equal(x, y))
               for x, y in zip(a, b))


#: uneven plans: 7 over 2 systems in microbatches of 2 (2, 2 | 2, 1); a coupled term (two-phase);
#: recompute (a second block follows, so checkpointing has a repeated block to take)
PLANS = {
    "split": {},
    "two_phase": {"coupled": True},
    "recompute": {"recompute": True, "gbs": 9, "mbs": 3, "loss": "ce"},
}


def _spec(constructs: tuple[str, ...], plan: str) -> Spec:
    extra = ("plain",) if plan == "recompute" else ()
    return Spec((*constructs, *extra), **PLANS[plan])


# ------------------------------------------------------------------- F7: legacy weight hooks


@pytest.mark.parametrize("plan", list(PLANS))
@pytest.mark.parametrize("construct", ["spectral_norm_legacy", "weight_norm_legacy"])
def test_a_legacy_weight_attribute_is_the_steps_after_a_step(construct, plan):
    """Legacy ``spectral_norm`` / ``weight_norm`` keep ``weight`` as a plain attribute their
    pre-hook sets at every call: after a compiled step it holds the step's value, as after
    an eager one (the fuzzer's F7: it kept the last eager call's)."""
    assert three_steps(_spec((construct,), plan)) is None


def test_the_legacy_weight_is_set_in_eval_mode_too():
    spec = Spec(("spectral_norm_legacy",))
    model = build(spec)
    x, y = make_inputs(spec)
    cm = mbcompile.compile(model, spec.gbs, spec.num_csx, spec.mbs, example_inputs=(x, y))
    model.eval()
    ref = build(spec).eval()
    with torch.no_grad():
        cm(x, y)
        ref(x, y)
    lin, ref_lin = model.blocks[0].lin, ref.blocks[0].lin
    assert rel_err(lin.weight, ref_lin.weight) <= 1e-12
    assert not lin.weight.requires_grad


# ------------------------------------------------------------------- torch_compile's meta run


@pytest.mark.slow
def test_with_torch_compile_a_layer_hook_never_sees_meta_tensors():
    """torch_compile finds which outputs require grad by a run on meta tensors; a layer with a
    forward hook keeps autograd's path instead, so the hook (marked to run per microbatch)
    sees only the step's tensors, and the step is exact."""
    model, (x, y) = tanh_pair()
    ref = copy.deepcopy(model)
    cm = mbcompile.compile(model, 7, 2, 2, example_inputs=(x, y),
                           torch_compile={"backend": "aot_eager"})
    devices: list[str] = []
    model.a.register_forward_hook(mbcompile.per_microbatch(
        lambda m, args, out: devices.append(out.device.type)))
    for _ in range(2):
        model.zero_grad(set_to_none=True)
        ref.zero_grad(set_to_none=True)
        cm(x, y).backward()
        ref(x, y).backward()
        for (n, p), q in zip(model.named_parameters(), ref.parameters()):
            assert rel_err(p.grad, q.grad) <= 1e-10, n
    assert devices and set(devices) == {"cpu"}, devices


# ------------------------------------------------------------------- F6: layer hooks that record


@pytest.mark.parametrize("plan", list(PLANS))
def test_a_layer_hook_that_records_is_refused_with_nothing_changed(plan):
    """A forward hook of a torch layer that records the output in a dict and counts its calls
    (the fuzzer's F6: it recorded each microbatch) is refused at the first step, naming what
    it writes and both fixes; compile called it on made-up data and kept nothing of that."""
    message = three_steps(_spec(("recording_hook_leaf",), plan))
    assert message is not None and "self.acts['lin']" in message and "self.calls" in message
    assert "module of your own" in message and "mbcompile.per_microbatch(hook)" in message


@pytest.mark.parametrize("plan", list(PLANS))
def test_the_same_hook_on_a_module_of_ones_own_is_exact(plan):
    """The fix the refusal names: the hook on a module wrapping the layer, keeping what it
    records on that module, is traced and its write replayed once per step with the whole
    batch's output, equal to eager's after each of three steps."""
    assert three_steps(_spec(("recording_hook_wrapped",), plan)) is None


def _count(module: nn.Module, args: tuple, out: torch.Tensor) -> None:
    global _CALLS
    _CALLS += 1


_CALLS = 0


def _counting() -> tuple[Callable[..., None], Callable[[], int]]:
    calls = 0

    def hook(m: nn.Module, args: tuple, out: torch.Tensor) -> None:
        nonlocal calls
        calls += 1

    return hook, lambda: calls


@pytest.mark.parametrize("how", ["closure", "nonlocal", "global", "print", "tensor_hook",
                                 "backward"])
def test_every_way_a_layer_hook_records_is_refused(how, capsys):
    """A closure's list, a closure's counter, a module-level counter, a print, a tensor hook
    on the output (it
    would fire on each microbatch's gradient), a backward hook that records the gradient's
    rows (it runs in each microbatch's backward): each refused, each put back, nothing
    printed, the gradients untouched."""
    model, batch = tanh_pair()
    cm = mbcompile.compile(model, 7, 2, 2, example_inputs=batch)
    rows: list[int] = []
    grads: list[torch.Tensor] = []
    counting, calls = _counting()
    hooks = {
        "nonlocal": counting,
        "closure": lambda m, args, out: rows.append(out.shape[0]),
        "global": _count,
        "print": lambda m, args, out: print("rows", out.shape[0]),
        "tensor_hook": lambda m, args, out: out.register_hook(grads.append),
    }
    if how == "backward":
        model.a.register_full_backward_hook(lambda m, gi, go: rows.append(go[0].shape[0]))
    else:
        model.a.register_forward_hook(hooks[how])
    with pytest.raises(mbcompile.CaptureError, match="per_microbatch"):
        cm(*batch)  # each microbatch's backward runs inside the call
    assert rows == [] and grads == [] and _CALLS == 0 and calls() == 0
    assert "rows" not in capsys.readouterr().out
    assert all(p.grad is None for p in model.parameters())


@pytest.mark.slow
@pytest.mark.parametrize("construct", ["recording_hook_leaf", "recording_hook_wrapped",
                                       "forward_hook_leaf"])
def test_layer_hooks_under_torch_compile(construct):
    """Under torch_compile dynamo compiles the body with the layer's call in it: a hook that
    records is refused all the same (its watch is hidden from dynamo), the fix is exact, and
    a hook that only computes stays exact over three steps, compiled once."""
    import torch._dynamo.utils as dynamo_utils

    spec = Spec((construct,), torch_compile=True)
    message = three_steps(spec)
    assert (message is not None) == (construct == "recording_hook_leaf"), message
    if construct == "forward_hook_leaf":  # no compile per call: the watch is the same object
        model, (x, y) = build(spec), make_inputs(spec)
        cm = mbcompile.compile(model, spec.gbs, spec.num_csx, spec.mbs, example_inputs=(x, y),
                               torch_compile={"backend": "aot_eager"})
        cm(x, y)[0].backward()
        graphs = dynamo_utils.counters["stats"]["unique_graphs"]
        for _ in range(2):
            cm(x, y)[0].backward()
        assert dynamo_utils.counters["stats"]["unique_graphs"] == graphs


def test_compile_puts_back_a_pre_and_post_hook_pair_after_the_whole_call():
    """A timer's pair of hooks (the post-hook reads what the pre-hook wrote), marked to run
    per microbatch: compile's probes call the layer with both, its writes are put back
    after the call (not between the two), and each microbatch of a step pairs them."""
    model, batch = tanh_pair()
    started: dict[str, int] = {}
    spans: list[int] = []

    def start(m: nn.Module, args: tuple) -> None:
        started["a"] = args[0].shape[0]

    def stop(m: nn.Module, args: tuple, out: torch.Tensor) -> None:
        spans.append(started.pop("a"))

    model.a.register_forward_pre_hook(mbcompile.per_microbatch(start))
    model.a.register_forward_hook(mbcompile.per_microbatch(stop))
    cm = mbcompile.compile(model, 7, 2, 2, example_inputs=batch)
    assert started == {} and spans == []
    cm(*batch)
    assert spans == [2, 2, 2, 1] and started == {}


def test_a_layer_hooks_own_state_is_read_live_not_guarded():
    """A layer's hooks run at each call, so the state they read (a closure's dict, a
    variable set after compile) is read then: arming them after compile recompiles nothing,
    and a hook that only computes follows the new state, equal to eager's step."""
    model, batch = tanh_pair()
    ref = copy.deepcopy(model)
    state = {"scale": 1.0}
    rows: list[int] = []

    def scaled(m: nn.Module, args: tuple, out: torch.Tensor) -> torch.Tensor:
        return out * state["scale"]

    def count(m: nn.Module, args: tuple) -> None:
        if state["scale"] != 1.0:
            rows.append(args[0].shape[0])

    for net in (model, ref):
        net.a.register_forward_hook(scaled)
    model.b.register_forward_pre_hook(mbcompile.per_microbatch(count))
    cm = mbcompile.compile(model, 7, 2, 2, example_inputs=batch)
    state["scale"] = 3.0
    with warnings.catch_warnings():
        warnings.simplefilter("error", mbcompile.RecompileWarning)
        loss = cm(*batch)
    loss.backward()
    expected = ref(*batch)
    expected.backward()
    assert rows == [2, 2, 2, 1]
    assert rel_err(loss.detach(), expected.detach(), 1e-3) < 1e-12
    for p, q in zip(model.parameters(), ref.parameters()):
        assert rel_err(p.grad, q.grad, 1e-3) < 1e-12


_LOG: list[int] = []


def _log(rows: int) -> None:
    _LOG.append(rows)


@pytest.mark.parametrize("how", ["helper", "other_module", "file"])
def test_a_layer_hook_writing_through_another_function_or_a_file_is_refused(how, tmp_path):
    """The sandbox walks the hook's code as forward's is walked (``code_reach``): a global
    written by a helper it calls, another module's globals written by that module's
    function, and a file it opens are seen; each refused at its first call in a step, with
    the globals put back, no file made and no gradient."""
    from fuzz import global_helpers

    model, batch = tanh_pair()
    cm = mbcompile.compile(model, 7, 2, 2, example_inputs=batch)
    before = (global_helpers.COUNT, global_helpers.LAST)
    path = tmp_path / "rows.txt"
    hooks = {
        "helper": lambda m, args, out: _log(out.shape[0]),
        "other_module": lambda m, args, out: global_helpers.record(out.detach()),
        "file": lambda m, args, out: path.open("a").write(f"{out.shape[0]}\n"),
    }
    handle = model.a.register_forward_hook(hooks[how])
    try:
        with pytest.raises(mbcompile.CaptureError, match="per_microbatch") as refusal:
            cm(*batch)
    finally:
        handle.remove()
    named = {"helper": "the global _LOG", "other_module": "the global COUNT",
             "file": "a file (it opens a file at"}[how]
    assert named in str(refusal.value)
    assert _LOG == [] and (global_helpers.COUNT, global_helpers.LAST) == before
    assert not path.exists()
    assert all(p.grad is None for p in model.parameters())


def test_a_marked_hook_writing_through_a_helper_or_a_file_runs_per_microbatch_only(tmp_path):
    """Marked, the same helper's write, and a file's, run once per microbatch in a step;
    compile's probes called them on made-up data, and changed nothing: the writes reached
    through the helper were put back, and the file opened to write was os.devnull."""
    model, batch = tanh_pair()
    path = tmp_path / "rows.txt"

    def to_file(m: nn.Module, args: tuple, out: torch.Tensor) -> None:
        with open(path, "a") as f:
            f.write(f"{out.shape[0]}\n")

    handles = [model.a.register_forward_hook(
        mbcompile.per_microbatch(lambda m, args, out: _log(out.shape[0]))),
        model.b.register_forward_hook(mbcompile.per_microbatch(to_file))]
    try:
        cm = mbcompile.compile(model, 7, 2, 2, example_inputs=batch)
        assert _LOG == [] and not path.exists()
        cm(*batch)
        assert _LOG == [2, 2, 2, 1] and path.read_text().split() == ["2", "2", "2", "1"]
    finally:
        for handle in handles:
            handle.remove()
        _LOG.clear()


class _LockedScale:
    """A hook object holding what cannot be copied (a lock, as a progress bar holds)."""

    def __init__(self) -> None:
        self.lock, self.scale = threading.Lock(), 2.0

    def __call__(self, m: nn.Module, args: tuple, out: torch.Tensor) -> torch.Tensor:
        with self.lock:
            return out * self.scale


def test_a_hook_object_that_cannot_be_copied_is_checked_on_the_layer_copy_as_is():
    """Compile's check runs a layer's hooks on a copy of the layer; a hook object that
    cannot be deep-copied is shared by the copy (it used to fail in mbcompile itself), and
    the step is eager's."""
    model, batch = tanh_pair()
    ref = copy.deepcopy(model)
    model.a.register_forward_hook(_LockedScale())
    ref.a.register_forward_hook(lambda m, args, out: out * 2.0)
    cm = mbcompile.compile(model, 7, 2, 2, example_inputs=batch)
    loss = cm(*batch)
    loss.backward()
    expected = ref(*batch)
    expected.backward()
    assert rel_err(loss.detach(), expected.detach(), 1e-3) < 1e-12
    for p, q in zip(model.parameters(), ref.parameters()):
        assert rel_err(p.grad, q.grad, 1e-3) < 1e-12
