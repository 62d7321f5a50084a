"""The compiled module's face: it looks like the model it compiled.

Code written for the model reads its attributes and its forward's signature:
``transformers.Trainer`` keeps only the dataset columns that ``forward`` names, and reads
``loss_type``, ``accepts_loss_kwargs`` and ``config``; ``save_pretrained`` and ``generate``
belong to the model. torch.compile's ``OptimizedModule`` forwards attribute reads to the
module it wraps; ``ModelFace`` does the same for a module that holds the user's model as
its submodule ``module``:

- an attribute the compiled module does not have is read from the model (``cm.config``,
  ``cm.save_pretrained(...)``, ``cm.generate(...)``, which runs the plain model);
- an attribute the compiled module does not own is written to the model, as eager's
  ``model.name = value`` (``cm.loss_type = "ForCausalLM"``, ``cm.temperature = 4.0`` read by
  forward's ``getattr(self, "temperature", 1.0)``, a new Parameter or layer), and deleted
  there (``del cm.head``); but a private plain value the model lacks (``cm._x = 1``) stays
  on the compiled module: a library's bookkeeping on the object it was handed (accelerate
  reads ``_original_forward`` back from ``cm.__dict__``);
- ``cm.training`` is the model's, ``cm.apply(fn)`` and ``cm.modules()`` reach each of the
  model's modules once (the compiled module passes ``isinstance(m, type(model))`` and has
  the model's methods: listed too, a loop would act on the model twice), and a load
  pre-hook registered on ``cm`` sees the model's keys (``face_methods.py``: the model's own
  overrides of ``nn.Module`` methods);
- ``inspect.signature(cm.forward)`` is the model's forward's;
- ``cm.__class__`` is the model's class, so ``isinstance(cm, type(model))`` holds while
  ``type(cm)`` stays the compiled module's (as ``wrapt.ObjectProxy`` and ``unittest.mock``
  do). Code that asks what the model is gets the model's answer: the Trainer reads the
  label names from the class's forward, and saves with ``save_pretrained`` (tied weights,
  config and all) only for an ``isinstance(model, PreTrainedModel)``. ``repr(cm)``,
  ``dir(cm)`` and pickling still show and keep the compiled module.
"""

from __future__ import annotations

import inspect
from collections.abc import Callable, Iterator
from typing import Any

import torch.nn as nn
from torch.nn.modules.module import _EXTRA_STATE_KEY_SUFFIX

from mbcompile.face_methods import ModelMethods

__all__ = ["ModelFace", "SignedForward"]


class ModelFace(ModelMethods):
    """Mixin for an ``nn.Module`` subclass whose submodule ``module`` is the user's model,
    whose ``_face_signature`` is the signature of the model's forward and whose
    ``_face_class`` is the model's class (module doc)."""

    @property  # type: ignore[misc]
    def __class__(self) -> type:  # noqa: D105 - isinstance(cm, type(model)) (module doc)
        return self.__dict__.get("_face_class") or type(self)

    def __repr__(self) -> str:
        text = nn.Module.__repr__(self)  # type: ignore[arg-type]
        shown = self._get_name()  # type: ignore[attr-defined]  # the model's class name
        return type(self).__name__ + text[len(shown):] if text.startswith(shown) else text

    def __dir__(self) -> list[str]:
        model = self._face_model()
        return sorted({*nn.Module.__dir__(self), *dir(type(self)),  # type: ignore[arg-type]
                       *(dir(model) if model is not None else ())})

    def _face_state_dict(self) -> None:
        """Make ``state_dict()`` keys the model's own (``net.0.weight``, not
        ``module.net.0.weight``), also when this module sits inside a parent: hooks, not
        overrides, so nesting works; ``load_state_dict`` takes the same keys, and the keys
        it reports missing or unexpected are named so too."""
        self.register_state_dict_post_hook(_strip_module_prefix)  # type: ignore[attr-defined]
        handle = self.register_load_state_dict_pre_hook(  # type: ignore[attr-defined]
            _add_module_prefix)  # kept last (_load_from_state_dict)
        self.__dict__["_face_prefix_hook"] = handle.id
        self.register_load_state_dict_post_hook(_named_as_saved)  # type: ignore[attr-defined]

    def _load_from_state_dict(self, *args: Any, **kwargs: Any) -> None:
        """torch runs load pre-hooks in registration order: the one that adds ``module.``
        runs last, so a hook the user registered on ``cm`` sees the model's keys (a hook
        renaming legacy keys, as registered on the model)."""
        hooks = self._load_state_dict_pre_hooks  # type: ignore[attr-defined]
        if (key := self.__dict__.get("_face_prefix_hook")) in hooks:
            hooks.move_to_end(key)
        nn.Module._load_from_state_dict(self, *args, **kwargs)  # type: ignore[arg-type]

    @property
    def training(self) -> bool:
        """The model's flag (``cm.module.eval()``, a loop over ``cm.modules()`` setting
        ``m.training``, change it); this module's own only while it is built."""
        model = self._face_model()
        return model.training if model is not None else self.__dict__.get("_face_training", True)

    @training.setter
    def training(self, mode: bool) -> None:
        model = self._face_model()
        if model is not None:
            model.training = mode
        else:
            self.__dict__["_face_training"] = mode

    def apply(self, fn: Callable[[nn.Module], None]) -> Any:
        """``fn`` on each of the model's modules once, as ``model.apply(fn)``: not on this
        module too, which passes ``isinstance(m, type(model))`` and has the model's methods
        (an init for the model would act twice); returns this module."""
        self.module.apply(fn)  # type: ignore[attr-defined]
        return self

    def named_modules(self, memo: set[nn.Module] | None = None, prefix: str = "",
                      remove_duplicate: bool = True) -> Iterator[tuple[str, nn.Module]]:
        """The model's modules, named as ``named_parameters()`` names them
        (``module.head``): not this module itself, which looks like the model (a loop
        testing ``isinstance(m, Net)`` or ``hasattr(m, "reset_parameters")`` would act on
        the model twice). Inside a parent's walk (``memo`` given) it lists itself too."""
        if memo is not None:
            yield from nn.Module.named_modules(self, memo, prefix,  # type: ignore[arg-type]
                                               remove_duplicate)
            return
        memo = {self} if remove_duplicate else set()  # type: ignore[arg-type]
        for name, module in self._modules.items():  # type: ignore[attr-defined]
            if module is not None:
                yield from module.named_modules(memo, prefix + ("." if prefix else "") + name,
                                                remove_duplicate)

    def get_extra_state(self) -> Any:
        """torch asks ``self.__class__`` (the model's) whether there is extra state, then
        asks this module for it (``nn.Module``'s own raises): the model's, which the
        state-dict hook also moves from the model's key to this one (the same value)."""
        return self.module.get_extra_state()  # type: ignore[attr-defined]

    def set_extra_state(self, state: Any) -> None:
        """Nothing: the model's own ``set_extra_state`` takes the key (``_add_module_prefix``
        gives it a copy)."""

    def __reduce_ex__(self, protocol: Any) -> Any:
        # pickle refuses an object whose __class__ is not its type (copyreg.__newobj__)
        return _rebuild, (type(self),), self.__getstate__()

    def __init_subclass__(cls, **kwargs: Any) -> None:
        super().__init_subclass__(**kwargs)
        forward = cls.__dict__.get("forward")
        if forward is not None and not isinstance(forward, SignedForward):
            cls.forward = SignedForward(forward)  # type: ignore[method-assign]

    def __getattr__(self, name: str) -> Any:
        try:
            return nn.Module.__getattr__(self, name)  # type: ignore[arg-type]
        except AttributeError:
            model = self._face_model()
            if model is None or name.startswith("__"):  # while building, and protocols
                raise
        try:
            return getattr(model, name)
        except AttributeError:
            raise AttributeError(
                f"{type(self).__name__!r} object has no attribute {name!r}, and neither has "
                f"the {type(model).__name__} it compiled") from None

    def __setattr__(self, name: str, value: Any) -> None:
        model = self._model_of(name)
        if model is not None and (not name.startswith("_") or hasattr(model, name)
                                  or isinstance(value, (nn.Parameter, nn.Module))):
            setattr(model, name, value)  # as eager's model.name = value (module doc)
            return
        nn.Module.__setattr__(self, name, value)  # type: ignore[arg-type]

    def __delattr__(self, name: str) -> None:
        model = self._model_of(name)
        if model is not None and hasattr(model, name):
            delattr(model, name)
            return
        nn.Module.__delattr__(self, name)  # type: ignore[arg-type]

    def _model_of(self, name: str) -> nn.Module | None:
        """The model, where ``name`` is not this module's own (``_owns``); else None."""
        model = self._face_model()
        return None if model is None or self._owns(name) else model

    def _owns(self, name: str) -> bool:
        """Whether ``name`` is the compiled module's own (its state, a method, a property,
        or one of its parameters, buffers or submodules): then it is never the model's."""
        d = self.__dict__
        return (name in d or hasattr(type(self), name) or name in d.get("_parameters", ())
                or name in d.get("_buffers", ()) or name in d.get("_modules", ()))


def _strip_module_prefix(module: nn.Module, state_dict: dict[str, Any], prefix: str,
                         local_metadata: Any) -> None:
    inner = prefix + "module."
    for key in [k for k in state_dict if k.startswith(inner)]:
        state_dict[_model_name(key, prefix)] = state_dict.pop(key)


def _add_module_prefix(module: nn.Module, state_dict: dict[str, Any], prefix: str,
                       *args: Any) -> None:
    module.__dict__["_face_loaded_at"] = prefix  # for the keys it reports (_named_as_saved)
    for key in [k for k in state_dict if k.startswith(prefix)]:
        value = state_dict.pop(key)
        state_dict[prefix + "module." + key[len(prefix):]] = value
        if key == prefix + _EXTRA_STATE_KEY_SUFFIX:  # asked of this module too (the model's
            state_dict[key] = value                  # class says it has some): both keys


def _named_as_saved(module: nn.Module, incompatible: Any) -> None:
    """The keys a load reports missing or unexpected, named as ``state_dict()`` names them
    (``lm_head.weight``, not ``module.lm_head.weight``): also the strict error's names."""
    prefix = module.__dict__.pop("_face_loaded_at", "")
    for keys in (incompatible.missing_keys, incompatible.unexpected_keys):
        keys[:] = [_model_name(k, prefix) for k in keys]


def _model_name(name: str, prefix: str) -> str:
    inner = prefix + "module."
    return prefix + name[len(inner):] if name.startswith(inner) else name


def _rebuild(cls: type) -> Any:
    """An empty instance of ``cls`` for pickle to fill with ``__setstate__``."""
    return cls.__new__(cls)


class SignedForward:
    """``forward`` as a method whose signature is the model's (``self._face_signature``), so
    ``inspect.signature(cm.forward)`` lists the model's arguments, not ``*args, **kwargs``.
    A non-data descriptor: assigning ``cm.forward = ...`` (Accelerate's autocast wrapper)
    still shadows it per instance."""

    def __init__(self, fn: Any) -> None:
        self.fn = fn
        self.__doc__ = fn.__doc__
        self.__name__ = getattr(fn, "__name__", "forward")

    def __get__(self, obj: Any, owner: type | None = None) -> Any:
        if obj is None:
            return self.fn
        return _BoundForward(self.fn, obj)


class _BoundForward:
    __slots__ = ("__func__", "__self__")

    def __init__(self, fn: Any, obj: Any) -> None:
        self.__func__, self.__self__ = fn, obj

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        return self.__func__(self.__self__, *args, **kwargs)

    @property
    def __signature__(self) -> inspect.Signature:
        signature = self.__self__.__dict__.get("_face_signature")
        return signature if signature is not None else inspect.signature(self.__func__)

    def __repr__(self) -> str:
        return f"<bound forward of {type(self.__self__).__name__}>"
