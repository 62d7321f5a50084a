"""What a compiled graph depends on in the model besides its inputs: the mode key.

A ``CompiledModule`` keeps one compiled graph per key: every module's ``training``
flag, the identity of what fills every parameter, buffer and submodule slot, and the
keys of the hooks the graphs were traced through (``CompiledModule._mode_key``).
The helpers here compute the slots and hook parts cheaply, on every call, and name
what changed when a recompile warns. So is the dtype and device of every parameter and
buffer, and torch's default dtype (``tensor_kinds``): ``model.to(torch.bfloat16)`` keeps
the Parameter objects, but a graph captured before it holds casts to the old dtype
(torch.export writes GPT-2's ``position_embeds.to(device)`` as a cast to float32), and a
``torch.tensor(0.1)`` in forward is made in the default dtype of its capture.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import torch
import torch.nn as nn

__all__ = ["changed_since", "hooks_by_module", "hooks_changed", "hooks_key", "is_submodule",
           "key_of", "kinds_changed", "slots", "tensor_kinds"]


def slots(modules: Sequence[nn.Module]) -> tuple[int, ...]:
    """The identity of what fills each module's parameter, buffer and submodule slots, and
    of its class (``m.__class__ = Patched`` changes the code forward runs)."""
    return (*map(id, map(type, modules)),
            *(id(v) for m in modules
              for held in (m._parameters, m._buffers, m._modules) for v in held.values()))


def key_of(modules: Sequence[nn.Module], filled: tuple[int, ...], live: frozenset[int]
           ) -> tuple[Any, ...]:
    """The mode key: (training flags, ``slots``, ``hooks_key``, ``tensor_kinds``)."""
    return (tuple(m.training for m in modules), filled, hooks_key(modules, live),
            tensor_kinds(modules))


def changed_since(model: nn.Module, hooks_before: Mapping[str, Any] | None,
                  live: frozenset[int], before: tuple[Any, ...] | None,
                  now: tuple[Any, ...]) -> str | None:
    """What a recompile names: whose hooks changed, else which dtypes or devices did."""
    return hooks_changed(model, hooks_before, live) or kinds_changed(
        before[3] if before is not None else None, now[3])


def tensor_kinds(modules: Sequence[nn.Module]) -> tuple[Any, ...]:
    """torch's default dtype, then the dtype and device of each parameter and buffer."""
    return (torch.get_default_dtype(), *((v.dtype, v.device) for m in modules
                                         for held in (m._parameters, m._buffers)
                                         for v in held.values() if v is not None))


def kinds_changed(before: tuple[Any, ...] | None, now: tuple[Any, ...]) -> str | None:
    """What ``tensor_kinds`` says changed since ``before`` (None: nothing did)."""
    if before is None or before == now:
        return None

    def kinds(key: tuple[Any, ...], other: tuple[Any, ...]) -> str:
        return ", ".join(sorted({f"{str(dtype).removeprefix('torch.')} on {device}"
                                 for dtype, device in set(key[1:]) - set(other[1:])}))

    said = [f"torch's default dtype was {before[0]}, now {now[0]}"] if before[0] != now[0] \
        else []
    gone, new = kinds(before, now), kinds(now, before)
    if gone and new:
        said.append(f"the model's parameters or buffers were {gone}, now {new}")
    elif gone or new:  # a kind that none had before, or that none has now
        said.append(f"some of the model's parameters or buffers are now {new}" if new else
                    f"none of the model's parameters or buffers is {gone} any more")
    if len(before) != len(now):  # weight_norm, register_parameter, a layer added or removed
        said.append(f"the model had {len(before) - 1} parameters and buffers, now "
                    f"{len(now) - 1}")
    elif before[1:] != now[1:] and not (gone or new):
        said.append("some of the model's parameters or buffers changed dtype or device")
    return "; ".join(said)


def hooks_key(modules: Sequence[nn.Module], live: frozenset[int]) -> tuple[Any, ...]:
    """The hooks the graphs were traced through (each key and function: one replaced under
    its key changes what runs): every module's but those of the ``live`` layers (their
    hooks run at their call), and the global module hooks. Read on every call (hooks are
    rare: a module without any costs four truth tests)."""
    out: list[Any] = [_entries(_GLOBAL_HOOKS) if any(_GLOBAL_HOOKS) else ()]
    for i, m in enumerate(modules):
        if m._backward_pre_hooks or m._backward_hooks or (
                (m._forward_pre_hooks or m._forward_hooks) and id(m) not in live):
            out.append((i, _entries(_hook_dicts(m, id(m) in live))))
    return tuple(out)


def is_submodule(model: nn.Module, target: str) -> bool:
    try:
        model.get_submodule(target)
    except AttributeError:
        return False
    return True


def _entries(tables: Sequence[dict[int, Any]]) -> tuple[tuple[tuple[int, Any], ...], ...]:
    """Each hook table's (key, hook) pairs: what ``hooks_key`` and ``hooks_by_module``
    compare."""
    return tuple(tuple(h.items()) for h in tables)


def _hook_dicts(m: nn.Module, live: bool = False) -> tuple[dict[int, Any], ...]:
    """The hook dictionaries the graphs depend on: a live layer's forward hooks run at its
    call, but its backward hooks are checked at compile (``check_layer_hooks``)."""
    backward = (m._backward_pre_hooks, m._backward_hooks)
    return backward if live else (m._forward_pre_hooks, m._forward_hooks, *backward)


_GLOBAL_HOOKS = tuple(getattr(nn.modules.module, f"_global_{kind}_hooks") for kind in (
    "forward_pre", "forward", "backward_pre", "backward"))


def hooks_by_module(model: nn.Module, live: frozenset[int]) -> dict[str, Any]:
    """Per module name: the module's id and the keys of the hooks ``hooks_key`` watches (to
    name whose changed, or which module was replaced)."""
    state = {name or "<model>": (id(m), _entries(_hook_dicts(m, id(m) in live)))
             for name, m in model.named_modules()}
    state["<global module hooks>"] = (None, _entries(_GLOBAL_HOOKS))
    return state


def hooks_changed(model: nn.Module, before: Mapping[str, Any] | None,
                  live: frozenset[int]) -> str | None:
    """Which module's hooks changed since ``before`` (None: none did)."""
    if before is None:
        return None
    for name, (module, hooks) in hooks_by_module(model, live).items():
        if name in before and module != before[name][0]:  # not its hooks: a new module
            return f"{name!r} was replaced by another module"
        if name in before and hooks != before[name][1]:
            return f"the hooks of {name!r} changed"
    return None
