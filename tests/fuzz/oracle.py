"""The oracle: one compiled step against one eager step, twice, or an allowed refusal."""

from __future__ import annotations

import enum
import math
import random
import traceback
import types
import warnings
from dataclasses import dataclass, field, is_dataclass
from typing import Any

import numpy as np
import torch
import torch.nn as nn
from models import (
    assert_close_errors,
    buffer_errors,
    grad_errors,
    grads_of,
    plan_free,
    rel_err,
)
from torch.utils import _pytree as pytree

import mbcompile
from mbcompile import MbcompileError, MicrobatchError

from .base import (
    GRAD_FLOOR,
    LR,
    SCALE_FLOOR,
)
from .model import Spec, build, make_inputs

# --------------------------------------------------------------------------- #
# The oracle
# --------------------------------------------------------------------------- #


@dataclass
class Outcome:
    """What one example did. ``status``: "compared" (both steps checked), "refused at
    compile", "refused at step 1/2". ``problems``: ``(kind, message)``, kind one of
    "silent wrong result", "internal crash", "state changed"; empty when all is allowed."""

    status: str = "compared"
    problems: list[tuple[str, str]] = field(default_factory=list)
    refusal: str = ""

    def add(self, kind: str, message: str) -> None:
        self.problems.append((kind, message))


def _clone(inputs: tuple[torch.Tensor, ...]) -> tuple[torch.Tensor, ...]:
    return tuple(t.clone() for t in inputs)


def _python_attrs(module: nn.Module) -> dict[str, Any]:
    return {k: v for k, v in vars(module).items()
            if not k.startswith("_") and isinstance(v, (bool, int, float, str))}


def state_of(model: nn.Module) -> dict[str, Any]:
    """Everything a compile or a refused step must leave as it was."""
    out: dict[str, Any] = {}
    for n, p in model.named_parameters():
        out[f"parameter {n}"] = (id(p), p.detach().clone(), p.requires_grad,
                                 None if p.grad is None else p.grad.detach().clone())
    for n, m in model.named_modules():  # not named_buffers(): what sits in the slot, tensor or not
        for k, b in m._buffers.items():
            out[f"buffer {n}.{k}"] = b.detach().clone() if isinstance(b, torch.Tensor) else b
    for n, m in model.named_modules():
        out[f"module {n or 'root'} training"] = m.training
        for k in ("_forward_hooks", "_forward_pre_hooks", "_backward_hooks",
                  "_backward_pre_hooks"):
            out[f"module {n or 'root'} {k}"] = tuple(getattr(m, k).items())
        out[f"module {n or 'root'} attributes"] = _python_attrs(m)
        if hasattr(m, "module_state"):  # globalstate.py: globals of its own
            out[f"module {n or 'root'} globals"] = m.module_state()
        for k, v in vars(m).items():
            if isinstance(v, torch.Generator):
                out[f"generator {n}.{k}"] = v.get_state()
    return out


def _same(a: Any, b: Any) -> bool:
    """Equal values of the same type (a compile that leaves, say, an fx Proxy where a buffer
    was is a change, not an error of the comparison)."""
    if type(a) is not type(b):
        return False
    if isinstance(a, torch.Tensor):
        return a.dtype == b.dtype and a.shape == b.shape and torch.equal(a, b)
    if isinstance(a, (tuple, list)):
        return len(a) == len(b) and all(_same(x, y) for x, y in zip(a, b))
    if isinstance(a, dict):
        return a.keys() == b.keys() and all(_same(a[k], b[k]) for k in a)
    try:
        return bool(a == b)
    except Exception:
        return False


def state_changes(before: dict[str, Any], after: dict[str, Any]) -> list[str]:
    return sorted(k for k in before.keys() | after.keys()
                  if k not in before or k not in after or not _same(before[k], after[k]))


def _generators(model: nn.Module) -> dict[str, torch.Tensor]:
    return {f"{n}.{k}": v.get_state() for n, m in model.named_modules()
            for k, v in vars(m).items() if isinstance(v, torch.Generator)}


class FuzzerError(Exception):
    """A generated model that eager PyTorch cannot run: a bug of this file, never a finding."""


@dataclass
class _Run:
    out: Any
    grads: dict[str, torch.Tensor | None]
    inputs: tuple[torch.Tensor, ...]
    rng: torch.Tensor
    other_rngs: tuple[Any, Any]  # Python's and numpy's global generators


def _run(module: nn.Module, call: Any, inputs: tuple[torch.Tensor, ...], seed: int) -> _Run:
    """One training step of ``call`` on fresh copies of ``inputs``, from no gradients and
    ``torch.manual_seed(seed)``; backward on the first output (the loss)."""
    module.zero_grad(set_to_none=True)
    args = _clone(inputs)
    torch.manual_seed(seed)
    random.seed(seed)
    np.random.seed(seed)
    out = call(*args)
    leaves = [t for t in pytree.tree_leaves(out) if isinstance(t, torch.Tensor)]
    leaves[0].backward()
    return _Run(out, grads_of(module), args, torch.get_rng_state(),
                (random.getstate(), np.random.get_state()[1].tolist()))


def _output_errors(got: Any, want: Any, scale: float) -> dict[str, float]:
    """Per output leaf: the relative error; a structural difference (structure, dtype, shape,
    requires_grad, a Python number) is an entry naming it, with error ``inf``."""
    got_leaves, got_spec = pytree.tree_flatten(got)
    want_leaves, want_spec = pytree.tree_flatten(want)
    if got_spec != want_spec:
        return {f"output structure {got_spec} != eager {want_spec}": math.inf}
    errors: dict[str, float] = {}
    for i, (g, w) in enumerate(zip(got_leaves, want_leaves)):
        name = f"out[{i}]"
        if not isinstance(w, torch.Tensor):
            ok = type(g) is type(w) and g == w
            errors[f"{name} = {g!r}, eager {w!r}" if not ok else name] = 0.0 if ok else math.inf
        elif not isinstance(g, torch.Tensor):
            errors[f"{name} is {type(g).__name__}, eager a tensor"] = math.inf
        elif g.dtype != w.dtype or g.shape != w.shape:
            errors[f"{name} {g.dtype}{tuple(g.shape)}, eager {w.dtype}{tuple(w.shape)}"] = math.inf
        elif g.requires_grad != w.requires_grad:
            errors[f"{name} requires_grad {g.requires_grad}, eager {w.requires_grad}"] = math.inf
        else:
            errors[name] = (rel_err(g.detach(), w.detach(), scale) if w.is_floating_point()
                            else 0.0 if torch.equal(g, w) else math.inf)
    return errors


def step_errors(model: nn.Module, cm: Any, ref: nn.Module, inputs: tuple[torch.Tensor, ...],
                seed: int) -> dict[str, float]:
    """One step of ``cm`` (sharing ``model``'s parameters) against one eager step of ``ref``
    (built identically; its state carried along from the previous step). Like
    ``models.step_errors``, plus: the inputs as each forward left them, parameter values
    (EMA writes), leaf-ness and identity, ``requires_grad``, generators, the global RNG.
    The compiled step runs first: an ``MbcompileError`` it raises propagates before eager
    runs."""
    ids = [id(p) for p in model.parameters()]
    got = _run(model, cm, inputs, seed)
    try:
        want = _run(ref, ref, inputs, seed)
    except Exception as err:  # the generated model must run eagerly: a bug of this file
        raise FuzzerError(f"the eager reference failed: {type(err).__name__}: {err}") from err
    errors = _output_errors(got.out, want.out, SCALE_FLOOR)
    errors.update({f"grad {n}": e for n, e in
                   grad_errors(got.grads, want.grads, GRAD_FLOOR, SCALE_FLOOR).items()})
    errors.update(buffer_errors(model, ref, SCALE_FLOOR))
    for (n, p), (_, q) in zip(model.named_parameters(), ref.named_parameters()):
        errors[f"parameter {n}"] = rel_err(p.detach(), q.detach(), SCALE_FLOOR)
        if not p.is_leaf:
            errors[f"parameter {n} is no longer a leaf"] = math.inf
        if p.requires_grad != q.requires_grad:
            errors[f"parameter {n} requires_grad {p.requires_grad}"] = math.inf
    if [id(p) for p in model.parameters()] != ids:
        errors["parameters replaced by other objects"] = math.inf
    for i, (g, w) in enumerate(zip(got.inputs, want.inputs)):
        errors[f"input {i} after the step"] = rel_err(g, w, SCALE_FLOOR)
    got_gens, want_gens = _generators(model), _generators(ref)
    for n, w in want_gens.items():
        if n not in got_gens or not torch.equal(got_gens[n], w):
            errors[f"generator {n} state differs"] = math.inf
    if not torch.equal(got.rng, want.rng):
        errors["global RNG state after the step differs"] = math.inf
    if got.other_rngs != want.other_rngs:
        errors["Python's or numpy's RNG state after the step differs"] = math.inf
    unchecked = {f"blocks.{i}.{name}" for i, block in enumerate(model.blocks)
                 for name in block.unchecked_state}
    want_state = {k: v for k, v in python_state(ref).items() if k not in unchecked}
    for k, v in python_state(model).items():
        if k in unchecked:
            continue
        errors[f"python state {k}"] = _value_error(v, want_state.pop(k, _ABSENT))
    errors.update((f"python state {k}", math.inf) for k in want_state)
    return errors


_ABSENT = object()
_MODULE_INTERNALS = frozenset(vars(nn.Module()))
_STATE_TYPES = (bool, int, float, str, type(None), enum.Enum, tuple, list, dict, torch.Tensor)


def python_state(model: nn.Module) -> dict[str, Any]:
    """The Python values of every module that forward may read or write: attributes of any
    name (private ones too) holding numbers, flags, strings, enums, containers, tensors kept
    in plain attributes, and plain objects (a config), by their attributes."""
    out: dict[str, Any] = {}
    for n, m in model.named_modules():
        for k, v in vars(m).items():
            if k in _MODULE_INTERNALS or k.startswith("__"):
                continue
            if isinstance(v, _STATE_TYPES):
                out[f"{n or 'root'}.{k}"] = v
            elif is_dataclass(v) or isinstance(v, types.SimpleNamespace):
                out[f"{n or 'root'}.{k}"] = dict(vars(v))
        if hasattr(m, "module_state"):  # globalstate.py: module globals of its own
            out.update((f"{n} global {k}", v) for k, v in m.module_state().items())
    return out


def _value_error(got: Any, want: Any) -> float:
    """0 for equal Python values (tensors to rounding: ``rel_err`` with the value floor),
    inf for anything else: another type, structure or value."""
    if type(got) is not type(want):
        return math.inf
    if isinstance(want, torch.Tensor):
        if got.shape != want.shape or got.dtype != want.dtype:
            return math.inf
        return rel_err(got.detach(), want.detach(), SCALE_FLOOR)
    if isinstance(want, (tuple, list)):
        if len(got) != len(want):
            return math.inf
        return max((_value_error(a, b) for a, b in zip(got, want)), default=0.0)
    if isinstance(want, dict):
        if list(got) != list(want):
            return math.inf
        return max((_value_error(got[k], want[k]) for k in want), default=0.0)
    return 0.0 if got == want else math.inf


def _sgd(model: nn.Module) -> None:
    with torch.no_grad():
        for p in model.parameters():
            if p.grad is not None:
                p.sub_(LR * p.grad.to(p.dtype))


def _is_crash(err: BaseException) -> bool:
    """An MbcompileError that is an internal failure, not a deliberate refusal."""
    if "failed in mbcompile itself" in str(err):
        return True
    if isinstance(err, MicrobatchError):  # the loop wrapped an exception eager did not raise
        cause = err.__cause__
        return cause is not None and not isinstance(cause, MbcompileError)
    return False


def _describe(err: BaseException) -> str:
    text = f"{type(err).__name__}: {err}"
    cause = err.__cause__
    if cause is not None:
        text += f"\n  caused by {type(cause).__name__}: {cause}"
    return text


def check(spec: Spec) -> Outcome:
    """Run the oracle on ``spec``; the outcome lists every problem found."""
    outcome = Outcome()
    model, ref = build(spec), build(spec)
    inputs = make_inputs(spec)
    example = make_inputs(spec, spec.example_batch)
    example_copy = _clone(example)
    before = state_of(model)
    kwargs: dict[str, Any] = {"recompute": spec.recompute}
    if spec.torch_compile:
        kwargs["torch_compile"] = {"backend": "aot_eager"}
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            cm = mbcompile.compile(model, spec.gbs, spec.num_csx, spec.mbs,
                                   example_inputs=example, **plan_free(spec.mbs, **kwargs))
    except MbcompileError as err:
        outcome.status, outcome.refusal = "refused at compile", _describe(err)
        if _is_crash(err):
            outcome.add("internal crash", f"compile: {_describe(err)}")
        cm = None
    except Exception as err:  # anything else is a crash
        outcome.status = "crashed at compile"
        outcome.add("internal crash", f"compile: {type(err).__name__}: {err}\n"
                    f"{traceback.format_exc(limit=-4)}")
        cm = None
    changed = state_changes(before, state_of(model))
    if changed:
        outcome.add("state changed", f"compile changed the model: {changed}")
    for i, (a, b) in enumerate(zip(example, example_copy)):
        if not torch.equal(a, b):
            outcome.add("state changed", f"compile wrote to example input {i}")
    if cm is None:
        return outcome
    for step in (1, 2):
        if step == 2:  # an optimizer step, then the Python state the constructs read
            _sgd(model)
            _sgd(ref)
            for block, ref_block in zip(model.blocks, ref.blocks):
                block.mutate(model)
                ref_block.mutate(ref)
        model.zero_grad(set_to_none=True)  # as the step starts: it must end here if refused
        before = state_of(model)
        try:
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")
                errors = step_errors(model, cm, ref, inputs, seed=spec.seed + step)
        except MbcompileError as err:
            outcome.status, outcome.refusal = f"refused at step {step}", _describe(err)
            if _is_crash(err):
                outcome.add("internal crash", f"step {step}: {_describe(err)}")
            # a refused step leaves everything as it was (its gradients were None before)
            changed = state_changes(before, state_of(model))
            if changed:
                outcome.add("state changed", f"refused step {step} changed {changed}")
            return outcome
        except FuzzerError:
            raise
        except Exception as err:
            outcome.status = f"crashed at step {step}"
            outcome.add("internal crash", f"step {step}: {type(err).__name__}: {err}\n"
                        f"{traceback.format_exc(limit=-4)}")
            return outcome
        try:
            assert_close_errors(errors, spec.rel)
        except AssertionError as err:
            outcome.add("silent wrong result", f"step {step}: {err}")
            return outcome  # step 2 would start from different states
    return outcome


def _report(spec: Spec, outcome: Outcome) -> str:
    lines = [f"{kind}: {message}" for kind, message in outcome.problems]
    return (f"{spec!r}\n(outcome: {outcome.status})\n" + "\n".join(lines) +
            f"\nreproduce: cd tests && python -c \"import fuzz as f; "
            f"print(f.check(f.{spec!r}))\"")


def assert_ok(spec: Spec) -> Outcome:
    outcome = check(spec)
    assert not outcome.problems, _report(spec, outcome)
    return outcome
