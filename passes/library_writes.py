"""Calls forward makes into an installed package only for their effect, refused at compile.

Capture runs forward once, at compile time. A call into an installed package that computes
(``einops.rearrange(h, ...)``, transformers' functions, numpy on Python numbers) is part of
the graph, or a constant of it. A call made for what it writes outside the Python state
the capture records and replays (``bar.update(1)`` on a ``tqdm`` bar, ``wandb.log``, a
``SummaryWriter``'s ``add_scalar``, ``yaml.dump`` into a stream) would happen once, there,
and never in a step. So while the capture traces a forward whose code names such a package
(``names_other_package``: a global, a closure variable, an attribute of a module of the
user's, what those hold, a base class of such a module), each call from the user's code
into an installed package's Python code or built-in functions (``sys.setprofile``: slow,
so only there) is told apart before it runs:

- the model's own packages (those its modules' classes come from: transformers, peft), and
  ``COMPUTE`` packages (numpy, except its file writers, einops): made;
- a read of a package's object (a property, ``__getitem__``, ``__len__``): made;
- any other method of a package's object that is not a module (``bar.update``,
  ``writer.add_scalar``, ``run.log``, a constructor): it writes that object, the package's
  own: refused before it runs;
- a function (or a method of a module) given no traced value (a tensor, an fx proxy, a
  symbolic size): it can compute nothing of the graph, so it is made for its effect:
  refused before it runs; a built-in function (its arguments are not seen): refused;
- a function given a traced value: made, unless it is declared to return None or its code
  can return nothing else (every ``return`` returns the constant None: ``_only_none``, read
  from its bytecode once per code object), both refused before it runs; and refused when it
  returns none anyway (a function that returns a value on another path: then made once, on
  the trace's values, and never in a step).

Example::

    def forward(self, x):
        h = rearrange(self.lin(x), "b c -> b c")   # made: traced values in, traced out
        BAR.update(1)   # refused: "a call of tqdm.update in the installed package 'tqdm'"
        return h
"""

from __future__ import annotations

import contextlib
import dis
import sys
import traceback
import types
from collections.abc import Iterable, Iterator
from typing import Any

import torch
import torch.fx as fx
import torch.nn as nn

from .errors import CaptureError
from .library_calls import IN_PACKAGE, installed, names_library, package_of, users_call
from .sources import user_frame
from .whose_code import holds_state, user_code

__all__ = ["COMPUTE", "library_writes_refused", "library_writes_watched", "model_packages",
           "names_other_package"]

#: installed packages that compute only: a call into one is made (numpy's ``_NUMPY_WRITERS``
#: aside, refused as any package's writes)
COMPUTE = frozenset({"numpy", "einops", "opt_einsum", "functorch"})
_NUMPY_WRITERS = frozenset({"save", "savez", "savez_compressed", "savetxt", "tofile", "dump"})
#: methods that read their object (a property's getter is found by its code)
_READS = frozenset({"__getattribute__", "__getattr__", "__getitem__", "__contains__",
                    "__len__", "__iter__", "__eq__", "__ne__", "__hash__", "__bool__",
                    "__repr__", "__str__", "__format__", "__instancecheck__",
                    "__subclasscheck__", "get", "keys", "values", "items"})
_TRACED = (torch.Tensor, fx.Proxy, torch.SymInt, torch.SymFloat, torch.SymBool)
_RETURN = dis.opmap["RETURN_VALUE"]
_GENERATOR = 0x20 | 0x80 | 0x200  # CO_GENERATOR, CO_COROUTINE, CO_ASYNC_GENERATOR


def _class_file(kind: type) -> str | None:
    return getattr(sys.modules.get(kind.__module__), "__file__", None)


def model_packages(model: nn.Module) -> frozenset[str]:
    """The installed packages the classes of ``model``'s modules come from (transformers,
    peft): their code computes the model, and is traced."""
    found = set()
    for module in model.modules():
        path = _class_file(type(module))
        if installed(path):
            found.add(package_of(str(path)))
    return frozenset(found)


def names_other_package(model: nn.Module, named: Iterable[Any], allowed: frozenset[str]
                        ) -> bool:
    """Whether the user's code forward reaches names an installed package outside
    ``allowed``: one of ``named`` (the walk's globals and closure variables, the call's
    non-tensor arguments), an attribute of a module whose ``forward`` is the user's
    (``self.bar``), what those hold at any depth (``self.loggers["bar"]``), what the
    methods of an object of the user's held there name (``self.logger.log(loss)``, where
    ``log`` calls ``yaml.dump``), or a base class of such a module (a trainer framework's,
    whose methods ``self.log`` calls)."""
    roots = list(named)
    for module in model.modules():
        kind = type(module)
        forward = getattr(kind.forward, "__func__", kind.forward)
        if not isinstance(forward, types.FunctionType) or \
                not user_code(forward.__code__.co_filename):
            continue
        roots.append(module)
        if any(installed(p := _class_file(base)) and package_of(str(p)) not in allowed
               for base in kind.__mro__):
            return True
    return _reaches_package(roots, allowed)


def _reaches_package(roots: list[Any], allowed: frozenset[str]) -> bool:
    """Whether a package's module, function or object outside ``allowed`` is among
    ``roots`` or what they hold (containers, plain objects, a module's public attributes,
    what the user's functions and the methods of the user's objects name), at any depth, up
    to ``_LIMIT`` objects and ``_ITEMS`` entries of each container."""
    seen: set[int] = set()
    while roots and len(seen) < _LIMIT:
        value = roots.pop()
        if isinstance(value, _SKIPPED) or id(value) in seen:
            continue
        seen.add(id(value))
        if names_library([value], allowed):
            return True
        if isinstance(value, dict):
            roots.extend(list(value.values())[:_ITEMS])
        elif isinstance(value, (list, tuple, set, frozenset)):
            roots.extend(list(value)[:_ITEMS])
        elif isinstance(value, nn.Module):
            roots.extend(v for k, v in vars(value).items() if k[0] != "_")
        elif isinstance(value, types.FunctionType) and user_code(value.__code__.co_filename):
            roots.extend(_named_by(value))  # a helper of the user's: what its code names
        elif holds_state(value):
            roots.extend(vars(value).values())
            roots.extend(f for kind in type(value).__mro__ for f in vars(kind).values()
                         if isinstance(f, types.FunctionType))  # ``self.logger.log(loss)``
    return False


def _named_by(fn: types.FunctionType) -> list[Any]:
    """The globals ``fn``'s code (and its inner code) names, and its closure's values."""
    codes, names = [fn.__code__], []
    while codes:
        code = codes.pop()
        names.extend(code.co_names)
        codes.extend(c for c in code.co_consts if isinstance(c, types.CodeType))
    found = [fn.__globals__[n] for n in names if n in fn.__globals__]
    for cell in fn.__closure__ or ():
        with contextlib.suppress(ValueError):  # not yet bound
            found.append(cell.cell_contents)
    return found


_LIMIT, _ITEMS = 20_000, 1_000
_SKIPPED = (torch.Tensor, str, bytes, int, float, bool, type(None))  # hold no package's object


def _traced(value: Any, depth: int = 2) -> bool:
    """Whether ``value`` is or holds (in a list, tuple or dict, two levels down) a traced
    value."""
    if isinstance(value, _TRACED):
        return True
    if depth and isinstance(value, (list, tuple)):
        return any(_traced(v, depth - 1) for v in value[:64])
    if depth and isinstance(value, dict):
        return any(_traced(v, depth - 1) for v in list(value.values())[:64])
    return False


def _reads(code: types.CodeType, owner: Any) -> bool:
    """Whether ``code``, run as a method of ``owner``, reads it: a reading dunder or a
    property's getter."""
    if code.co_name in _READS:
        return True
    member = getattr(type(owner), code.co_name, None)
    return isinstance(member, property) and getattr(member.fget, "__code__", None) is code


def library_writes_watched(model: nn.Module, named: Iterable[Any], refused: list[str]
                           ) -> contextlib.AbstractContextManager[None]:
    """``library_writes_refused`` where ``names_other_package`` finds the user's code naming
    a package outside the model's own and ``COMPUTE`` (else nothing: the watch is slow)."""
    allowed = model_packages(model) | COMPUTE
    return library_writes_refused(allowed, refused) if names_other_package(
        model, named, allowed) else contextlib.nullcontext()


def _only_none(code: types.CodeType) -> bool:
    """Whether every path out of ``code`` returns the constant None (``RECORDS.append(v)``
    with no ``return``): each ``RETURN_VALUE`` comes straight after ``LOAD_CONST None``
    and is no jump's target (``return v or None`` jumps to it with ``v``), and one at least
    is there (a check that only raises is made: its error is the answer). Worked out once
    per code object.

    >>> _only_none((lambda v: None).__code__), _only_none((lambda v: v).__code__)
    (True, False)
    """
    found = _ONLY_NONE.get(code)
    if found is None:
        found, before, returns = True, None, False
        for ins in dis.get_instructions(code):
            returns = returns or ins.opname.startswith("RETURN_")
            if ins.opname == "RETURN_CONST" and ins.argval is not None or \
                    ins.opname == "RETURN_VALUE" and (ins.is_jump_target or before is None or
                                                      before.opname != "LOAD_CONST" or
                                                      before.argval is not None):
                found = False
                break
            if ins.opname not in ("CACHE", "EXTENDED_ARG"):
                before = ins
        found = _ONLY_NONE[code] = found and returns
    return found


_ONLY_NONE: dict[types.CodeType, bool] = {}


def _returns_none(frame: types.FrameType) -> bool:
    """Whether the function ``frame`` runs (found among its module's globals) is annotated
    ``-> None``."""
    fn = frame.f_globals.get(frame.f_code.co_name)
    fn = getattr(fn, "__wrapped__", fn)
    if getattr(fn, "__code__", None) is not frame.f_code:
        return False
    return getattr(fn, "__annotations__", {}).get("return", ...) in (None, "None")


@contextlib.contextmanager
def library_writes_refused(allowed: frozenset[str], refused: list[str]) -> Iterator[None]:
    """While the block runs (a capture's trace), a call from the user's code into an
    installed package outside ``allowed`` that can only be made for its effect (the module
    docstring) raises ``CaptureError``, named in ``refused``; before it runs, or, for a
    function given traced values that returns none, as it returns."""
    outer = sys.getprofile()
    pending: dict[int, types.FrameType] = {}  # calls given traced values, checked at return

    def refuse(name: str, path: str, caller: types.FrameType, why: str) -> None:
        where = user_frame(traceback.extract_stack(caller))
        what = f"makes a call of {name} {IN_PACKAGE} {package_of(path)!r} at {where} ({why})"
        refused.append(what)
        raise CaptureError(f"forward {what}")

    def profile(frame: types.FrameType, event: str, arg: Any) -> None:
        if outer is not None:
            outer(frame, event, arg)
        if event == "return" or event == "c_return":  # most events: checked first
            if not pending or event == "c_return":
                return
            if pending.pop(id(frame), None) is frame and not _traced(arg) and \
                    frame.f_code.co_code[frame.f_lasti] == _RETURN:  # (not an exception)
                refuse(frame.f_code.co_qualname, frame.f_code.co_filename, frame.f_back or frame,
                       "it was given traced values and returns none, so it was made for its "
                       "effect, once, on the trace's values")
            return
        found = users_call(frame, event, arg)
        if found is None:
            return
        path, caller = found
        package = package_of(path)
        name = frame.f_code.co_name if event == "call" else getattr(arg, "__name__", "?")
        if package in allowed or (package in COMPUTE and not (
                package == "numpy" and name in _NUMPY_WRITERS)):
            return
        if event == "c_call":
            qualname = getattr(arg, "__qualname__", name)
            refuse(qualname, path, caller, "a built-in function: what it writes cannot be "
                   "told from the trace")
        code = frame.f_code
        local = frame.f_locals
        owner = local.get(code.co_varnames[0], None) if code.co_argcount else None
        method = code.co_argcount and code.co_varnames[0] in ("self", "cls")
        # a constructor writes only the object it makes (a ModelOutput of traced values),
        # and is judged as a function below: given no traced value (tqdm(...)), refused
        if method and not isinstance(owner, (nn.Module, *_TRACED)) and \
                code.co_name != "__init__":
            if _reads(code, owner):
                return
            refuse(code.co_qualname, path, caller, "a method of the package's object: it "
                   "writes that object, which compile cannot replay once per step")
        if not any(_traced(v) for v in local.values()):
            refuse(code.co_qualname, path, caller, "given no traced value, it computes "
                   "nothing of the graph: it is made for its effect")
        if code.co_name == "__init__":  # (returns None: what it makes is the object)
            return
        if _returns_none(frame):
            refuse(code.co_qualname, path, caller, "it is declared to return None, so it is "
                   "made for its effect")
        if code.co_flags & _GENERATOR:
            return
        if _only_none(code):
            refuse(code.co_qualname, path, caller, "its code returns nothing but None, so it "
                   "is made for its effect")
        pending[id(frame)] = frame

    sys.setprofile(profile)
    try:
        yield
    finally:
        sys.setprofile(outer)
