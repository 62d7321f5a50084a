"""Hooks of a layer the graph calls live, checked inside each compiled step.

A layer the fx graph calls as one node (``nn.Linear``, ...) runs its own hooks at each
call and in its backward, so on each microbatch, where eager runs them once per step on
the whole batch. For each call of the compiled module every hook of such a layer
(forward, pre, backward) is wrapped in ``WatchedHook``, and put back after it (under
``torch_compile`` the wrapper is hidden from dynamo, which would trace it). Outside a
compiled step the wrapper only calls the hook. Inside one:

- a hook that writes Python state (``self.acts[name] = out.detach()``, a counter, a
  list it appends to, a print, a call into an installed package: ``wandb.log``),
  registers a tensor hook on the layer's output, or rewires a module (registers or
  removes a hook, rebinds a parameter), would do so per microbatch, with each
  microbatch's values: it is run sandboxed
  (``passes.hook_sandbox``; one whose code provably writes nothing, not:
  ``passes.hook_reads``), and refused with ``UncheckedHookError`` at its first write,
  with everything it wrote put back and the step not run;
- a hook that only computes runs per microbatch: one present at compile was checked on a
  copy of the layer (``passes.forward_modes.check_layer_hooks``); one registered later is
  not called on made-up data, and if it changes what the layer receives or returns it is
  refused the same way, since nothing tells whether it reads the whole batch
  (``out - out.mean(0)``);
- a hook marked ``mbcompile.per_microbatch(hook)`` runs as written, once per microbatch
  (a probe of the microbatches, an injected failure).

A global module hook (``register_module_forward_hook``) is treated the same on those
layers, as a hook registered after compile (``_OnLayers``): compile never calls one
(``passes.global_hooks``), and in a step it is not called on mbcompile's own modules (the
rewritten graph, its microbatch body); torch's call of the compiled module itself calls it
on the model (``called_as``), as eager's call does. A global backward hook is refused.

Example: ``cm = compile(model, ...)``, then ``model.fc.register_forward_hook(lambda m, a, out:
seen.append(out.shape[0]))``; the next ``cm(x)`` raises, naming ``fc`` and ``seen``, and
changes nothing.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterable, Iterator, Sequence
from typing import Any

import torch
from torch.nn.modules import module as module_globals
from torch.utils import _pytree as pytree

from mbcompile.errors import CaptureError, InputError, UncheckedHookError
from mbcompile.passes import global_hooks, sandbox_patches
from mbcompile.passes.export_hooks import module_tracker_note
from mbcompile.passes.hook_reads import reads_only
from mbcompile.passes.hook_sandbox import Kept, call_sandboxed, runs_per_microbatch
from mbcompile.passes.library_calls import IN_PACKAGE as _LIBRARY
from mbcompile.passes.python_state import REWIRED

__all__ = ["CallHooks", "UncheckedHookError", "WatchedHook", "called_as", "capture_refused",
           "global_backward_refused", "hook_keys", "in_step", "rewatched", "unwatch",
           "watch_hooks"]


class _Steps:
    """How many compiled microbatch calls are running (the wrapper acts only inside one)."""

    depth = 0
    #: the running call's ``watch_hooks`` arguments and what it wrapped (None outside a
    #: call, so nothing holds the user's layers after it): a first float16 step's second
    #: forwards, in ``loss.backward()``, run with the hooks its call ran with
    #: (``CallHooks``), watched as the call watched them (``rewatched``)
    watching: tuple[Any, ...] | None = None
    watched: list[tuple[dict[int, Any], int, Any]] = []

    @staticmethod
    def enter() -> None:
        """A microbatch starts: its hooks are watched, and what their sandbox puts in place
        stays until it ends (``sandbox_patches``: once per microbatch, not per call)."""
        _Steps.depth += 1
        sandbox_patches.hold()

    @staticmethod
    def leave() -> None:
        _Steps.depth -= 1
        sandbox_patches.release()


in_step = _Steps


class WatchedHook:
    """A user's forward (pre-)hook of a live layer, called as registered outside a step,
    checked inside one (see the module docstring); ``checked``: present at compile."""

    __slots__ = ("checked", "fn", "global_", "kept", "layer")

    def __init__(self, fn: Any, layer: str, checked: bool = False, global_: bool = False
                 ) -> None:
        self.fn, self.layer, self.checked, self.global_ = fn, layer, checked, global_
        self.kept: Kept = {}  # the sandbox's watch of its last clean call (per layer)

    def __call__(self, module: torch.nn.Module, *args: Any) -> Any:
        if not _Steps.depth:
            return self.fn(module, *args)
        marked = runs_per_microbatch(self.fn)
        if self.checked and marked:
            return self.fn(module, *args)
        # a hook whose code provably writes nothing (no call, no in-place operator): run as
        # it is, and its tensors cannot be written in place either (``hook_reads``)
        pure = not marked and reads_only(self.fn, (module, *args))
        # a hook compile did not check: its in-place writes to what the layer gets, seen
        tensors = [] if self.checked or pure else \
            [t for t in pytree.tree_leaves(args) if isinstance(t, torch.Tensor)]
        versions = [t._version for t in tensors]
        if marked or pure:
            result = self.fn(module, *args)
        else:
            result, wrote = call_sandboxed(self.fn, module, args, kept=self.kept)
            if wrote is not None and _LIBRARY in wrote:
                raise UncheckedHookError(
                    f"{self._what(module)} makes {wrote.removeprefix('through ')}; the layer "
                    "runs its hooks once per microbatch, where eager runs them once per "
                    "step on the whole batch, and what a library writes (a log, a file, a "
                    "socket) cannot be put back. Fix: make the call from the training loop "
                    "(after the step, with the values you keep), or mark the hook "
                    "mbcompile.per_microbatch(hook) to make it on each microbatch on "
                    "purpose. The step was not run, and the call was refused before it ran: "
                    "parameters, gradients and your objects are as they were")
            if wrote is not None and any(word in wrote for word in REWIRED):
                raise UncheckedHookError(
                    f"{self._what(module)} changes {wrote}; the layer runs its hooks once "
                    "per microbatch, where eager runs them once per step, so this would be "
                    "done on each microbatch, and the hooks, parameters and buffers of the "
                    "rest of the step would differ from eager's. Fix: register or remove "
                    "hooks and set or delete parameters and buffers outside forward (before "
                    "the step, in the training loop), or mark the hook "
                    "mbcompile.per_microbatch(hook) if it is meant to run on each "
                    "microbatch. The step was not run, and what the hook changed was put "
                    "back: parameters, buffers, hooks, gradients and your objects are as "
                    "they were")
            if wrote is not None:
                raise UncheckedHookError(
                    f"{self._what(module)} writes {wrote}; the layer runs its hooks once "
                    "per microbatch, on each microbatch's rows, where eager runs them once "
                    "per step on the whole batch, so what it records would differ from "
                    f"eager. Fix: register the hook on {_OWN[self.global_]} and keep what it "
                    "records on that module (its hooks are traced, and their writes "
                    "replayed once per step with the whole batch's values), or mark it "
                    "mbcompile.per_microbatch(hook) to run it on each microbatch on purpose. "
                    "The step was not run, and what the hook wrote was put back: "
                    "parameters, gradients and your objects are as they were"
                    + module_tracker_note(self.fn))
        if not self.checked and (
                result is not None or any(t._version != v for t, v in zip(tensors, versions))):
            raise UncheckedHookError(
                f"{self._what(module, later=True)} changes what the layer "
                f"{'returns' if len(args) > 1 else 'receives'} (it returned a value or wrote "
                "a tensor in place); the layer runs its hooks once per microbatch, and "
                f"compile checks only {_CHECKED[self.global_]}, so the step could differ "
                f"from eager. Fix: {_FIX[self.global_]}, or make it only read (return "
                "None). The step was not run: parameters and gradients are as they were")
        return result

    def _what(self, module: torch.nn.Module, later: bool = False) -> str:
        layer = f"{type(module).__name__} {self.layer!r}"
        if self.global_:
            return f"the global module hook {_name(self.fn)}, called on {layer},"
        return f"a forward hook registered on {layer} after compile" if later else \
            f"a hook of {layer}"

    def __repr__(self) -> str:
        return f"WatchedHook({self.fn!r})"


_OWN = {False: "a module of your own that wraps the layer",
        True: "the layers you mean (on a module of your own that wraps a torch layer)"}
_CHECKED = {False: "the hooks present when it ran",
            True: "a layer's own hooks (global module hooks are not called on made-up data)"}
_FIX = {False: "register the hook before mbcompile.compile() (or compile again after "
               "registering it)",
        True: "register it on the layer itself before mbcompile.compile()"}


def _name(fn: Any) -> str:
    fn = getattr(fn, "fn", fn)  # a per_microbatch mark's wrapper
    return repr(getattr(fn, "__qualname__", None) or type(fn).__name__)


def _hook_dicts(layer: torch.nn.Module) -> tuple[dict[int, Any], ...]:
    """Every hook a live layer runs per microbatch: at its call, and in its backward."""
    return (layer._forward_pre_hooks, layer._forward_hooks, layer._backward_pre_hooks,
            layer._backward_hooks)


def hook_keys(layers: Iterable[tuple[str, torch.nn.Module]]) -> frozenset[int]:
    """The keys of ``layers``' hooks: at compile, the ones it checked (a backward hook added
    later compiles again, and is checked then)."""
    return frozenset(k for _, layer in layers for hooks in _hook_dicts(layer) for k in hooks)


def watch_hooks(layers: Sequence[tuple[str, torch.nn.Module]], known: frozenset[int],
                cache: dict[int, tuple[Any, bool, Any]], opaque: bool = False
                ) -> list[tuple[dict[int, Any], int, Any]]:
    """Wrap, in place, every forward (pre-)hook of ``layers`` (``known``: the keys present at
    compile, which it checked; ``RemovableHandle`` numbers hooks across all modules), and
    return what ``unwatch`` puts back: the wrapping lasts one call of the compiled module,
    so the user's hook dictionaries are theirs again after it, refused or not. The global
    module hooks are wrapped too (``_OnLayers``).

    ``cache`` (key -> hook, checked, wrapper) keeps one wrapper per hook across calls:
    with ``opaque`` (a body compiled with ``torch_compile``) each wrapper is hidden from
    dynamo, which calls it as it is; dynamo guards on the hooks it meets, so a new wrapper
    on every call would compile the body again on every call."""
    _Steps.watching, _Steps.watched = (layers, known, cache, opaque), []
    if not cache and not any(global_hooks.tables) and not any(
            m._forward_pre_hooks or m._forward_hooks or m._backward_pre_hooks
            or m._backward_hooks for _, m in layers):
        return []  # the usual call: no hook anywhere (four truth tests a layer)
    watched = _watch_global(layers, cache, opaque) if any(global_hooks.tables) else []
    for name, layer in layers:
        for hooks in _hook_dicts(layer):
            for key in list(hooks):  # per call: a truth test a layer without hooks
                fn, checked = hooks[key], key in known
                kept = cache.get(key)
                if kept is None or kept[0] is not fn or kept[1] != checked:
                    wrapper: Any = WatchedHook(fn, name, checked)
                    if opaque:
                        wrapper = torch.compiler.disable(_as_function(wrapper))
                    kept = cache[key] = (fn, checked, wrapper)
                watched.append((hooks, key, fn))
                hooks[key] = kept[2]
    for key in cache.keys() - {key for _, key, _ in watched}:
        del cache[key]  # a hook removed: its wrapper goes with it
    _Steps.watched = watched  # until ``unwatch``
    return watched


def _as_function(hook: WatchedHook | _OnLayers) -> Any:
    def watched(module: torch.nn.Module, *args: Any) -> Any:
        return hook(module, *args)
    watched.fn = hook  # type: ignore[attr-defined]  # a refusal names the user's hook by it
    return watched


def unwatch(watched: list[tuple[dict[int, Any], int, Any]]) -> None:
    _Steps.watching, _Steps.watched = None, []
    for hooks, key, fn in watched:
        if key in hooks:  # a hook may remove itself
            hooks[key] = fn


@contextlib.contextmanager
def rewatched(watching: tuple[Any, ...]) -> Iterator[None]:
    """The hooks of a call (``watching``: ``in_step.watching`` during it) watched again,
    after it: a first float16 step runs its second forwards in ``loss.backward()``
    (``deferred.py``) with its hooks watched as in the call, none run unchecked, and no
    global hook called on mbcompile's own modules."""
    watched = watch_hooks(*watching)
    try:
        yield
    finally:
        unwatch(watched)


def _tables(layers: Iterable[tuple[str, torch.nn.Module]]) -> list[dict[int, Any]]:
    """Every hook table a step's call reads: each live layer's, with the flags torch keeps
    per hook (keywords, always called), and the global ones."""
    return [*(t for _, m in layers for t in (
        *_hook_dicts(m), m._forward_pre_hooks_with_kwargs, m._forward_hooks_with_kwargs,
        m._forward_hooks_always_called)), *global_hooks.tables,
        module_globals._global_forward_hooks_always_called,
        module_globals._global_forward_hooks_with_kwargs]


class CallHooks:
    """The hooks a running call runs with (taken during it), to run a first float16 step's
    second forwards with in ``loss.backward()``: eager fixes a step's hooks at its forward,
    so a hook added between the call and ``backward()`` never runs for the step, and a
    full backward hook removed between still does."""

    def __init__(self) -> None:
        layers = _Steps.watching[0] if _Steps.watching is not None else ()
        user = {(id(table), key): fn.fn if isinstance(fn, _OnModel) else fn
                for table, key, fn in _Steps.watched}  # under the call's wrappers
        self.tables = [(t, {k: user.get((id(t), k), v) for k, v in t.items()})
                       for t in _tables(layers)]
        self.full = [(m, m._is_full_backward_hook) for _, m in layers]

    @contextlib.contextmanager
    def __call__(self) -> Iterator[None]:
        """The call's hooks in place in the block (in place: torch holds the tables by
        identity), and those in place now after it."""
        now = [(table, dict(table)) for table, _ in self.tables]
        full = [(m, m._is_full_backward_hook) for m, _ in self.full]
        try:
            _put(self.tables, self.full)
            yield
        finally:
            _put(now, full)


def _put(tables: list[tuple[dict[int, Any], dict[int, Any]]],
         full: list[tuple[torch.nn.Module, bool | None]]) -> None:
    """Each table holding what it is paired with, in its order, and each layer's kind of
    backward hook (full or not, which torch records on the layer) as paired."""
    for table, held in tables:
        table.clear()
        table.update(held)
    for m, flag in full:
        m._is_full_backward_hook = flag


class _OnModel:
    """A global module hook called on the compiled module: called on the user's model in its
    place (eager calls it on the model, with the same inputs and outputs)."""

    __slots__ = ("compiled", "fn", "model")

    def __init__(self, fn: Any, compiled: torch.nn.Module, model: torch.nn.Module) -> None:
        self.fn, self.compiled, self.model = fn, compiled, model

    @property
    def __wrapped__(self) -> Any:  # what code_reach walks
        return self.fn

    def __call__(self, module: torch.nn.Module, *args: Any) -> Any:
        return self.fn(self.model if module is self.compiled else module, *args)


def called_as(compiled: torch.nn.Module, model: torch.nn.Module, call: Any,
              args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
    """``call(*args, **kwargs)``: torch's call of ``compiled``, where each global module
    hook torch calls on ``compiled`` is called on ``model``, as eager's call of the model
    calls it; a global backward hook is refused first. A capture refused because a
    parameter slot holds a plain tensor (``functional_call(cm, ...)`` under export) says
    so (``capture_refused``)."""
    try:
        return _called_as(compiled, model, call, args, kwargs)
    except UncheckedHookError:
        raise
    except CaptureError as exc:
        capture_refused(model, exc)
        raise


def _called_as(compiled: torch.nn.Module, model: torch.nn.Module, call: Any,
               args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
    if not any(global_hooks.tables):
        return call(*args, **kwargs)
    global_backward_refused("The call was not run: nothing was changed")
    watched = []
    for table in global_hooks.tables:
        for key, fn in list(table.items()):
            watched.append((table, key, fn))
            table[key] = _OnModel(fn, compiled, model)
    try:
        return call(*args, **kwargs)
    finally:
        unwatch(watched)


class _OnLayers:
    """A global module hook in a step: called on the user's layers the graph calls as one
    node (``live``: their names by id), watched there as a layer's hook registered after
    compile is (``WatchedHook``), or as written where marked ``per_microbatch``; never on
    mbcompile's own modules (the rewritten graph, its microbatch body)."""

    __slots__ = ("fn", "live", "watched")

    def __init__(self, fn: Any, live: dict[int, str]) -> None:
        self.fn, self.live = fn, live
        self.watched: dict[int, WatchedHook] = {}  # per layer (by id, as ``live``)

    def __call__(self, module: torch.nn.Module, *args: Any) -> Any:
        watched = self.watched.get(id(module))
        if watched is None:
            name = self.live.get(id(module))
            if name is None:
                return None
            watched = self.watched[id(module)] = WatchedHook(self.fn, name, global_=True)
        return watched(module, *args)


def _watch_global(layers: tuple[tuple[str, torch.nn.Module], ...],
                  cache: dict[int, tuple[Any, Any, Any]], opaque: bool
                  ) -> list[tuple[dict[int, Any], int, Any]]:
    """``watch_hooks``'s part for the global module hooks: each wrapped in ``_OnLayers``."""
    live = {id(m): name for name, m in layers}
    watched = []
    for table in global_hooks.tables:
        for key, held in list(table.items()):
            fn = held.fn if isinstance(held, _OnModel) else held
            kept = cache.get(key)
            if kept is None or kept[0] is not fn or kept[1] != live:
                wrapper: Any = _OnLayers(fn, live)
                if opaque:
                    wrapper = torch.compiler.disable(_as_function(wrapper))
                kept = cache[key] = (fn, live, wrapper)
            watched.append((table, key, held))
            table[key] = kept[2]
    return watched


def global_backward_refused(what: str) -> None:
    """``UncheckedHookError`` for a global module backward hook
    (``register_module_full_backward_hook``), marked per microbatch or not: it would run in
    each microbatch's backward of each layer the graph calls as one node, with that
    microbatch's gradients, and not at all on a module forward traces through, where eager
    runs it once per step on each (``what``: nothing was compiled, or the call not run)."""
    for table in global_hooks.BACKWARD:
        for fn in table.values():
            fn = fn.fn if isinstance(fn, _OnModel) else fn
            raise UncheckedHookError(
                f"the global module backward hook {_name(fn)} "
                "(register_module_full_backward_hook) would run in each microbatch's backward "
                "of each torch layer the graph calls as one node, with that microbatch's "
                "gradients, and not on the modules forward traces through, where eager runs "
                "it once per step on each module with the whole batch's. Fix: register "
                "backward hooks on the torch layers themselves (compile checks a layer's own "
                "backward hooks, and refuses one a microbatch would change), or remove it "
                f"while training with the compiled module. {what}")


def capture_refused(model: torch.nn.Module, exc: CaptureError) -> None:
    """Raise ``InputError`` from ``exc`` where torch.export refused a call because a
    parameter slot of ``model`` holds a plain tensor (``functional_call(cm, ...)``,
    ``torch.nn.utils.stateless``), the cause export's own message does not name."""
    if "torch.export" not in str(exc):
        return
    for name, m in model.named_modules():
        for key, p in m._parameters.items():
            if p is not None and not isinstance(p, torch.nn.Parameter):
                where = f"{name}.{key}" if name else key
                raise InputError(
                    f"{type(model).__name__}'s parameter {where!r} "
                    "holds a plain tensor, not an nn.Parameter (torch.func.functional_call("
                    "cm, weights) and torch.nn.utils.stateless put the tensors they are given "
                    "there), which capture='export' cannot capture: torch.export refused it "
                    "(its error is the __cause__ of this one). Fix: call functional_call on "
                    "the model itself (functional_call(cm.module, ...): exact), or compile "
                    "with capture='fx', which runs such a call with weights that are leaf "
                    "tensors or under torch.no_grad(); nothing was changed") from exc
