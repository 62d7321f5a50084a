"""The model's own ``nn.Module`` methods, called through the compiled module.

``cm`` is an ``nn.Module``: ``cm.parameters()`` is ``nn.Module``'s, run on ``cm``, whatever
the model's class does. Where the model's class overrides one of the methods users call
on the module object, ``cm`` calls the override, as ``model.f(...)`` would run:

>>> class Net(nn.Module):
...     def parameters(self, recurse=True):  # train the head only
...         return self.head.parameters(recurse)
>>> cm = mbcompile.compile(Net(), ...)
>>> len(list(cm.parameters())) == len(list(cm.module.parameters()))  # was every parameter
True

A method the model does not override stays ``nn.Module``'s, run on ``cm``: the same
parameters, buffers and ``state_dict()`` keys as before. Names keep ``cm``'s prefix
(``named_parameters()`` says ``module.head.weight``, as ``named_children()`` does), and a
method that returns the module returns ``cm``. An override and hooks registered on ``cm``
for the same call (a ``load_state_dict`` override and a load hook on ``cm``) cannot both
run as they would on the model: refused with ``InputError``, naming ``cm.module``.

``add_module``, ``register_module``, ``register_parameter`` and ``register_buffer`` of a
name ``cm`` does not own register it on the model, as ``cm.name = value`` does
(``face.py``): torch's own refused a name the model has (``cm.add_module("head", new)``,
``KeyError: attribute 'head' already exists``) and kept a new one on ``cm``.
"""

from __future__ import annotations

import inspect
from collections.abc import Callable, Iterator
from typing import Any

import torch
import torch.nn as nn

from mbcompile.passes.errors import InputError

__all__ = ["ModelMethods"]

#: methods whose override's result is returned as it is
_PASSED_ON = ("parameters", "buffers", "zero_grad")
#: methods that return the module itself: the override runs on the model, ``cm`` is returned
_RETURN_SELF = ("train", "eval", "requires_grad_", "to", "cpu", "cuda", "float", "double",
                "half", "bfloat16", "type", "share_memory", "to_empty")
#: the load or save a method runs, by the hooks ``cm`` runs around it (``_refuse_hooks``)
_HOOKS = {"state_dict": ("_state_dict_pre_hooks", "_state_dict_hooks"),
          "load_state_dict": ("_load_state_dict_pre_hooks", "_load_state_dict_post_hooks")}
_FACE = "mbcompile.face"  # whose hooks keep the model's keys (``ModelFace._face_state_dict``)


class ModelMethods:
    """Mixin for ``ModelFace``: the model's overrides of ``nn.Module`` methods (module doc)."""

    def _face_model(self) -> nn.Module | None:
        """The model (submodule ``module``); None while this module is built. Read from
        ``__dict__``: never through ``__getattr__``, which itself asks for it."""
        return self.__dict__.get("_modules", {}).get("module")

    def _override(self, name: str) -> Callable[..., Any] | None:
        """The model's bound method ``name`` where its class overrides ``nn.Module``'s."""
        model = self._face_model()
        if model is None or getattr(type(model), name, None) is getattr(nn.Module, name):
            return None
        return getattr(model, name)

    def named_parameters(self, *args: Any, **kwargs: Any) -> Iterator[tuple[str, Any]]:
        return self._named_tensors("named_parameters", args, kwargs)

    def named_buffers(self, *args: Any, **kwargs: Any) -> Iterator[tuple[str, Any]]:
        return self._named_tensors("named_buffers", args, kwargs)

    def _named_tensors(self, name: str, args: tuple[Any, ...], kwargs: dict[str, Any]
               ) -> Iterator[tuple[str, Any]]:
        """The override's tensors, under ``cm``'s prefix (``module.``)."""
        own = self._override(name)
        default = getattr(nn.Module, name)
        if own is None:
            return default(self, *args, **kwargs)
        bound = inspect.signature(default).bind(self, *args, **kwargs).arguments
        bound.pop("self")
        prefix = bound.pop("prefix", "")
        inner = prefix + ("." if prefix else "") + "module."
        return ((inner + key, value) for key, value in own(**bound))

    def state_dict(self, *args: Any, **kwargs: Any) -> Any:
        own = self._override("state_dict")
        if own is None:
            return nn.Module.state_dict(self, *args, **kwargs)
        self._refuse_hooks("state_dict")
        return own(*args, **kwargs)  # the model's keys, as this module's state_dict() has

    def load_state_dict(self, *args: Any, **kwargs: Any) -> Any:
        own = self._override("load_state_dict")
        if own is None:
            return nn.Module.load_state_dict(self, *args, **kwargs)
        self._refuse_hooks("load_state_dict")
        return own(*args, **kwargs)

    def add_module(self, name: str, module: nn.Module | None) -> None:
        model = self._model_of(name)  # type: ignore[attr-defined]
        (super() if model is None else model).add_module(name, module)  # type: ignore[misc]

    def register_module(self, name: str, module: nn.Module | None) -> None:
        self.add_module(name, module)

    def register_parameter(self, name: str, param: nn.Parameter | None) -> None:
        model = self._model_of(name)  # type: ignore[attr-defined]
        (super() if model is None else model).register_parameter(name, param)  # type: ignore[misc]

    def register_buffer(self, name: str, tensor: torch.Tensor | None,
                        persistent: bool = True) -> None:
        model = self._model_of(name)  # type: ignore[attr-defined]
        (super() if model is None else model).register_buffer(name, tensor, persistent)  # type: ignore[misc]

    def _refuse_hooks(self, method: str) -> None:
        """An override of ``method`` runs on the model, without the hooks registered on this
        module (but mbcompile's own key hooks, which the override's keys do not need)."""
        hooks = [h for table in _HOOKS[method] for h in getattr(self, table).values()
                 if getattr(getattr(h, "hook", h), "__module__", None) != _FACE]
        if hooks:
            model = type(self._face_model()).__name__
            raise InputError(
                f"{model} overrides {method}(), which cm.{method}() runs on the model, but "
                f"hooks were registered on the compiled module for it ({hooks[0]!r}), which "
                f"that call would skip; register them on the model instead "
                f"(cm.module.register_..._hook), as eager would run them")


def _model_first(name: str, returns_self: bool) -> Callable[..., Any]:
    """``nn.Module``'s method ``name``, or the model's override of it (``returns_self``:
    then this module is returned, as the override returns the model)."""
    default = getattr(nn.Module, name)

    def method(self: ModelMethods, *args: Any, **kwargs: Any) -> Any:
        own = self._override(name)
        if own is None:
            return default(self, *args, **kwargs)
        result = own(*args, **kwargs)
        return self if returns_self else result

    method.__name__ = method.__qualname__ = name
    method.__doc__ = default.__doc__
    return method


for _name in _PASSED_ON:
    setattr(ModelMethods, _name, _model_first(_name, returns_self=False))
for _name in _RETURN_SELF:
    setattr(ModelMethods, _name, _model_first(_name, returns_self=True))
