"""Keyword view: a model whose forward takes ``**kwargs``, seen with those keywords named.

``torch.export`` maps ``dynamic_shapes`` onto ``inspect.signature(forward)``; a keyword
that reaches ``**kwargs`` sits under the one name ``kwargs``, and torch 2.13 refuses any
shape spec given there ("Must provide a tree_name when there might be a mismatch"). So
the capture exports a view of the model whose forward names every keyword of the
example call, and hands the call on unchanged.

Before (``GPT2LMHeadModel.forward(input_ids, ..., labels=None, **kwargs)``)::

    model(input_ids=ids, labels=ids, num_items_in_batch=n)   # n reaches **kwargs

After (``keyword_view(model, ["input_ids", "labels", "num_items_in_batch"])``)::

    view.forward(*, input_ids, labels, num_items_in_batch)   # what export binds
    view(**call) == model(**call)                              # model.__call__, hooks and all

The view is not a wrapper around the model but the model's state under another forward:
it shares the model's parameter, buffer and submodule tables, so every name in the
exported graph (``transformer.wte.weight``) is the model's own, and nothing is copied.
With ``after``, the view returns ``(output, after())``: what ``after`` reads at the end of
the call, still inside the trace (the tensors forward wrote: ``export_writes.py``).
"""

from __future__ import annotations

import inspect
from collections.abc import Callable, Sequence
from typing import Any

import torch.nn as nn

__all__ = ["KeywordView", "keyword_view"]


class KeywordView(nn.Module):
    """``model``'s state and call under a forward whose signature names ``names``."""

    def __init__(self, model: nn.Module, names: Sequence[str],
                 after: Callable[[], Any] | None = None) -> None:
        super().__init__()
        for table in ("_parameters", "_buffers", "_modules", "_non_persistent_buffers_set"):
            self.__dict__[table] = model.__dict__[table]  # the model's own: same names
        self.__dict__["_model"] = model  # not a submodule: the view adds no name
        self.training = model.training

        def forward(**kwargs: Any) -> Any:
            out = model(**kwargs)
            return out if after is None else (out, after())

        forward.__signature__ = inspect.Signature(  # type: ignore[attr-defined]
            [inspect.Parameter(n, inspect.Parameter.KEYWORD_ONLY) for n in names])
        self.__dict__["forward"] = forward


def keyword_view(model: nn.Module, names: Sequence[str],
                 after: Callable[[], Any] | None = None) -> nn.Module:
    """``model`` itself when its forward names every one of ``names`` (nothing reaches
    ``**kwargs``) and nothing is read ``after`` it, else a ``KeywordView``."""
    params = inspect.signature(model.forward).parameters
    if after is None and all(n in params for n in names):
        return model
    return KeywordView(model, names, after)
