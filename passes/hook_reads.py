"""A hook whose code provably writes nothing: called as it is, without the sandbox.

``hook_sandbox.call_sandboxed`` records the Python state a hook can reach before each call
and compares it after (tenths of a millisecond a call, on every layer call of a step for a
global module hook). Most hooks a step runs per microbatch only read (``return None``,
``out * SCALE``, ``assert out.shape[-1] == 64``). Like dynamo, which knows what a frame can
write from its bytecode, ``reads_only`` proves that of a call, in two parts:

- once per code object (``_plan``): its bytecode holds no call but of a builtin that only
  reads (``isinstance``, ``len``: ``_PURE_CALLS``, each by its global name, with the
  number of arguments it may take; ``setattr``, ``print``, ``exec``, a method or a
  function held in a variable are calls like any other), no store other than to its own
  locals (``STORE_ATTR``, ``STORE_SUBSCR``, ``STORE_GLOBAL``,
  ``STORE_DEREF``, deletes), no in-place operator (``+=`` writes a tensor or calls a
  user's ``__iadd__``), no import, iteration (a generator's ``next`` is a write), ``with``,
  ``try``, inner function, ``yield``, nor a private attribute (``m.__dict__``) or one
  leading into autograd's graph (``out.grad_fn``); only loads, operators, comparisons,
  subscripts, tuples, jumps and ``assert``;
- on each call (``_inert``): every value its code can load from outside its locals (the
  arguments it reads, its defaults, closure variables and the globals it names) is one
  whose operators, attributes, truth and subscripts run only Python's or torch's code: a
  number, string, dtype, ``torch.Size``, a plain tensor or parameter, a tuple, list or dict
  of those, a torch layer whose attributes the code names are such values, torch's and
  ``math``'s modules, a builtin. A user's object (its ``__mul__``, a property,
  ``__bool__``), a ``defaultdict`` (a read inserts), a tensor subclass
  (``__torch_function__``) fails it, and the call is sandboxed as before. Checked on each
  call, as the values can change between calls (a closure variable rebound after compile),
  and so is each builtin it calls: still Python's own, not shadowed by a global.

Such a call cannot print, open a file, call an installed package, register a tensor hook,
or write any object: nothing of it could be put back, so the sandbox has nothing to do.

Example::

    reads_only(lambda m, args, out: out * 2.0, (layer, (x,), out))   # True
    reads_only(lambda m, args, out: seen.append(out), (layer, (x,), out))  # False: a call
"""

from __future__ import annotations

import builtins
import dis
import inspect
import math
import sys
import types
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn as nn

__all__ = ["reads_only"]

#: opcodes that touch only the frame's own stack and locals, or run the operand's operator
#: (inert operands, checked per call: Python's or torch's code only)
_SAFE = frozenset({
    "RESUME", "NOP", "CACHE", "EXTENDED_ARG", "PUSH_NULL", "POP_TOP", "COPY", "SWAP",
    "LOAD_FAST", "LOAD_FAST_CHECK", "LOAD_FAST_LOAD_FAST", "STORE_FAST", "DELETE_FAST",
    "LOAD_CONST", "RETURN_VALUE", "RETURN_CONST", "LOAD_GLOBAL", "LOAD_DEREF",
    "COPY_FREE_VARS", "LOAD_ATTR", "BINARY_OP", "COMPARE_OP", "IS_OP", "CONTAINS_OP",
    "UNARY_NEGATIVE", "UNARY_NOT", "UNARY_INVERT", "UNARY_POSITIVE", "TO_BOOL",
    "BINARY_SUBSCR", "BINARY_SLICE", "BUILD_TUPLE", "BUILD_LIST", "BUILD_SLICE",
    "BUILD_MAP", "BUILD_CONST_KEY_MAP", "BUILD_STRING", "FORMAT_VALUE", "FORMAT_SIMPLE",
    "UNPACK_SEQUENCE", "LOAD_ASSERTION_ERROR", "RAISE_VARARGS", "NOT_TAKEN",
})
_LOADS = frozenset({"LOAD_FAST", "LOAD_FAST_CHECK", "LOAD_FAST_LOAD_FAST"})
#: builtins a hook that only reads may call (``isinstance(out, torch.Tensor)``), by name,
#: with the numbers of positional arguments allowed: on values ``_inert`` accepts each runs
#: only Python's or torch's code (the dunder method named) and writes nothing
_PURE_CALLS: dict[str, tuple[Any, tuple[int, ...]]] = {
    "isinstance": (builtins.isinstance, (2,)),  # type(x), C.__instancecheck__
    "issubclass": (builtins.issubclass, (2,)),  # C.__subclasscheck__
    "len": (builtins.len, (1,)),  # x.__len__
    "abs": (builtins.abs, (1,)),  # x.__abs__
    "min": (builtins.min, (1, 2, 3)),  # iteration, __lt__ (no ``key=``: a call of its own)
    "max": (builtins.max, (1, 2, 3)),  # iteration, __gt__
    "round": (builtins.round, (1, 2)),  # x.__round__
    "int": (builtins.int, (1,)),  # x.__int__, __index__ (a tensor's item)
    "float": (builtins.float, (1,)),  # x.__float__
    "bool": (builtins.bool, (1,)),  # x.__bool__, __len__
    "type": (builtins.type, (1,)),  # the type of x (three arguments make a class)
    "callable": (builtins.callable, (1,)),  # a slot's presence
}
_CALLS = frozenset({"PRECALL", "CALL"})  # 3.11's call takes two opcodes, later ones one
_METHOD_LOADS = sys.version_info >= (3, 12)  # LOAD_ATTR's low bit: a method, to be called
#: attributes through which torch's objects lead to what ``_inert`` does not look into (an
#: autograd node's ``metadata`` dict); private ones (``m.__dict__``, ``t._base``) too
_LEADS_OUT = frozenset({"grad_fn", "metadata", "next_functions"})
_NOT_PLAIN = inspect.CO_GENERATOR | inspect.CO_COROUTINE | inspect.CO_ASYNC_GENERATOR | \
    inspect.CO_ITERABLE_COROUTINE


@dataclass(frozen=True)
class _Plan:
    """What a code object that writes nothing can load from outside its locals."""

    params: tuple[int, ...]  # positions of the arguments it reads
    star: bool  # it reads ``*args``
    globals: tuple[str, ...]
    attributes: frozenset[str]  # every attribute name it loads, on whatever
    calls: tuple[str, ...] = ()  # the builtins it calls (``_PURE_CALLS``)


_PLANS: dict[types.CodeType, _Plan | None] = {}


def _plan(code: types.CodeType) -> _Plan | None:
    """``code``'s plan, or None where its bytecode may write (see the module docstring)."""
    if code.co_flags & _NOT_PLAIN or code.co_cellvars or \
            any(isinstance(c, types.CodeType) for c in code.co_consts):
        return None
    loads: set[str] = set()
    globals_: list[str] = []
    attributes: set[str] = set()
    callees: list[str | None] = []  # what each call to come calls: a builtin's name, or not
    calls: set[str] = set()
    previous = ""
    for ins in dis.get_instructions(code):
        op = ins.opname
        if op not in _SAFE and op not in _CALLS and "JUMP" not in op:  # a store, an import,
            return None                                                 # iteration
        if op == "CALL":
            callee = callees.pop() if callees else None
            if callee not in _PURE_CALLS or ins.arg not in _PURE_CALLS[callee][1]:
                return None  # anything but a builtin that only reads, or with keywords
            calls.add(callee)
        elif op == "PUSH_NULL" or op == "LOAD_ATTR" and _METHOD_LOADS and ins.arg & 1:
            callees.append(None)  # a call of a variable's function, or of a method
        elif op == "LOAD_GLOBAL" and ins.arg & 1:  # a global to call (3.11+: NULL pushed)
            callees.append(ins.argval)
        if op == "BINARY_OP" and ins.argrepr.endswith("="):  # in place: ``x += 1``
            return None
        if op == "RAISE_VARARGS" and previous != "LOAD_ASSERTION_ERROR":  # not ``assert``
            return None
        if op == "LOAD_ATTR":
            if ins.argval.startswith("_") or ins.argval in _LEADS_OUT:
                return None
            attributes.add(ins.argval)
        elif op == "LOAD_GLOBAL":
            globals_.append(ins.argval)
        elif op in _LOADS:
            loads.update(ins.argval if isinstance(ins.argval, tuple) else (ins.argval,))
        previous = op
    named = code.co_argcount + code.co_kwonlyargcount
    star = bool(code.co_flags & inspect.CO_VARARGS) and code.co_varnames[named] in loads
    return _Plan(tuple(i for i in range(code.co_argcount) if code.co_varnames[i] in loads),
                 star, tuple(dict.fromkeys(globals_)), frozenset(attributes), tuple(calls))


def reads_only(fn: Any, passed: tuple[Any, ...]) -> bool:
    """Whether ``fn(*passed)`` provably writes nothing (see the module docstring): a plain
    function whose code only reads, called on values whose operators are Python's or
    torch's."""
    if type(fn) is not types.FunctionType:  # a bound method's self, a callable object
        return False
    code = fn.__code__
    plan = _PLANS.get(code, _UNSEEN)
    if plan is _UNSEEN:
        plan = _PLANS[code] = _plan(code)
    if plan is None:
        return False
    names = plan.attributes
    for i in plan.params:
        if i < len(passed) and not _inert(passed[i], names):
            return False
    if plan.star and not all(_inert(v, names) for v in passed[code.co_argcount:]):
        return False
    if fn.__defaults__ and not all(_inert(v, names) for v in fn.__defaults__):
        return False
    if fn.__kwdefaults__ and not all(_inert(v, names) for v in fn.__kwdefaults__.values()):
        return False
    for cell in fn.__closure__ or ():
        try:
            value = cell.cell_contents
        except ValueError:  # not bound yet: loading it raises
            continue
        if not _inert(value, names):
            return False
    namespace = fn.__globals__
    if plan.calls and not _builtins_called(plan.calls, namespace):
        return False
    for name in plan.globals:
        value = namespace.get(name, _UNSEEN)
        if value is _UNSEEN:
            value = _BUILTINS.get(name)  # a builtin (``len``), never called here
            if not (value is None or _library(value)):
                return False
        elif not _inert(value, names):
            return False
    return True


def _builtins_called(calls: tuple[str, ...], namespace: dict[str, Any]) -> bool:
    """Each name in ``calls`` is Python's own builtin there: not shadowed by a global of
    the module, nor replaced in ``builtins``, whose namespace the module's code uses."""
    space = namespace.get("__builtins__", _BUILTINS)
    if space is not builtins and space is not _BUILTINS:
        return False
    return all(name not in namespace and _BUILTINS.get(name) is _PURE_CALLS[name][0]
               for name in calls)


_UNSEEN: Any = object()
_BUILTINS = vars(builtins)
#: exact types whose operators, attributes and truth run only Python's or torch's code
_ATOMS = frozenset({type(None), bool, int, float, complex, str, bytes, slice, type(...),
                    torch.dtype, torch.device, torch.Size, torch.layout, torch.memory_format})
_TENSORS = frozenset({torch.Tensor, nn.Parameter})
_MODULES = frozenset({torch, math, torch.nn.functional})
_ITEMS = 64  # a longer container is not looked through per call: sandboxed instead
_DEPTH = 4


def _inert(value: Any, names: frozenset[str], depth: int = 0) -> bool:
    """Whether loading ``value``, its items and the attributes ``names`` of it runs only
    Python's or torch's code, with nothing of the user's behind them (loops, not
    generators: this runs on each call of a hook)."""
    kind = type(value)
    if kind in _ATOMS:
        return True
    if depth > _DEPTH:
        return False
    if kind in _TENSORS:  # a tensor's own attributes set by the user: looked into
        own = value.__dict__
        if own and names:
            for n in names:
                if n in own and not _inert(own[n], names, depth + 1):
                    return False
        return True
    if kind is tuple or kind is list:
        if len(value) > _ITEMS:
            return False
        for item in value:
            if not _inert(item, names, depth + 1):
                return False
        return True
    if kind is dict:
        if len(value) > _ITEMS:
            return False
        for k, item in value.items():
            if type(k) not in _ATOMS or not _inert(item, names, depth + 1):
                return False
        return True
    if isinstance(value, nn.Module):  # what the code names of it: its own values
        if not _torch_layer(kind):
            return False
        own = value.__dict__
        for n in names:
            for table in (own, own["_parameters"], own["_buffers"], own["_modules"]):
                if n in table and not _inert(table[n], names, depth + 1):
                    return False
        return True
    if kind is types.ModuleType:  # ``torch.float64``: what the code names of it
        if value not in _MODULES:
            return False
        own = vars(value)
        for n in names:
            if n in own and not (_library(own[n]) or _inert(own[n], names, depth + 1)):
                return False
        return True
    return False


def _torch_layer(kind: type) -> bool:
    found = _TORCH_LAYERS.get(kind)
    if found is None:
        found = _TORCH_LAYERS[kind] = kind.__module__.startswith("torch.")
    return found


_TORCH_LAYERS: dict[type, bool] = {}


def _library(value: Any) -> bool:
    """A builtin or torch function or class: loaded, not called (the calls it makes are
    ``_PURE_CALLS``, each checked by ``_builtins_called``)."""
    kind = type(value)
    if kind is not types.BuiltinFunctionType and not issubclass(kind, type):
        return False
    found = _LIBRARY.get(value)
    if found is None:
        module = str(getattr(value, "__module__", ""))
        found = _LIBRARY[value] = module in ("builtins", "math") or \
            module.partition(".")[0] == "torch"
    return found


_LIBRARY: dict[Any, bool] = {}
