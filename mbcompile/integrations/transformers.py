"""The keywords ``transformers.Trainer`` adds to a model's call besides the batch.

>>> trainer_keywords(model, {"input_ids": ids, "labels": labels})
{'num_items_in_batch': tensor(41)}

The Trainer passes ``num_items_in_batch`` (the batch's count of label tokens) on every call
with labels (training, ``evaluate()``, ``predict()``) to a model that accepts loss keywords
(``model.accepts_loss_kwargs``, or a forward that takes ``**kwargs``). The model divides
its summed loss by it instead of taking a mean: another Python path, so another graph.
``compile()`` compiles the call as the Trainer makes it: these keywords join the example,
and the lengths a padding collator pads (``padded_dims``) are symbolic from the start
under ``dynamic="auto"``, so that the Trainer's steps run the one compile. A call without
the keywords (a plain loop) compiles its own graph once, on the same plan and without a
warning (``Recompile.expected_keywords``). It is captured from the config as the Trainer
sets it (``as_the_trainer_sets``: ``Trainer.__init__`` sets ``config.use_cache``, which
forward reads, a guard of the capture), and the user's config is put back after. Nothing
here imports transformers: a model that is not one of its ``PreTrainedModel``s gets no
keywords and no symbolic dims.
"""

from __future__ import annotations

import contextlib
import inspect
import sys
from collections.abc import Iterator, Mapping
from typing import Any

import torch
import torch.nn as nn

__all__ = ["TRAINER_KEYWORDS", "as_the_trainer_sets", "padded_dims", "trainer_keywords"]

#: the keywords the Trainer adds to a call, beside the batch's columns
TRAINER_KEYWORDS = ("num_items_in_batch",)


def trainer_keywords(model: nn.Module, example: Mapping[str, Any]) -> dict[str, Any]:
    """The keywords ``transformers.Trainer`` would add to ``example`` (bound by parameter
    name) when it calls ``model``, with example values; empty when it adds none."""
    transformers = sys.modules.get("transformers")
    labels = example.get("labels")
    if (transformers is None or not isinstance(model, transformers.PreTrainedModel)
            or not isinstance(labels, torch.Tensor) or set(TRAINER_KEYWORDS) & set(example)):
        return {}
    accepts = getattr(model, "accepts_loss_kwargs", None)
    if accepts is None:  # how the Trainer decides, in its __init__
        accepts = any(p.kind == p.VAR_KEYWORD
                      for p in inspect.signature(model.forward).parameters.values())
    return {"num_items_in_batch": labels.ne(-100).sum()} if accepts else {}



def padded_dims(model: nn.Module, example: Mapping[str, Any]) -> dict[str, list[int]]:
    """The dims a padding collator pads in a text model's call, by input: dim 1 (the
    length) of every 2-D tensor as long as the ``input_ids``; empty for a model that is not
    a transformers text model (its ``main_input_name`` is not ``input_ids``).

    >>> padded_dims(gpt2, {"input_ids": ids, "attention_mask": mask, "labels": labels})
    {'input_ids': [1], 'attention_mask': [1], 'labels': [1]}
    """
    transformers = sys.modules.get("transformers")
    ids = example.get("input_ids")
    if (transformers is None or not isinstance(model, transformers.PreTrainedModel)
            or getattr(model, "main_input_name", None) != "input_ids"
            or not isinstance(ids, torch.Tensor) or ids.dim() != 2):
        return {}
    return {name: [1] for name, value in example.items() if isinstance(value, torch.Tensor)
            and value.dim() == 2 and value.shape[1] == ids.shape[1]}


@contextlib.contextmanager
def as_the_trainer_sets(model: nn.Module) -> Iterator[None]:
    """While the block runs, ``model``'s config as ``Trainer.__init__`` sets it:
    ``config.use_cache`` is ``TrainingArguments.use_cache`` (False by default); the
    user's value is put back after."""
    config = getattr(model, "config", None)
    if config is None or not hasattr(config, "use_cache"):
        yield
        return
    before = config.use_cache
    config.use_cache = False
    try:
        yield
    finally:
        config.use_cache = before
