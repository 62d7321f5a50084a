"""The keywords ``transformers.Trainer`` adds to a model's call besides the batch.

>>> trainer_keywords(model, {"input_ids": ids, "labels": labels})
{'num_items_in_batch': tensor(41)}

The Trainer passes ``num_items_in_batch`` (the batch's count of label tokens) on every call
with labels (training, ``evaluate()``, ``predict()``) to a model that accepts loss keywords
(``model.accepts_loss_kwargs``, or a forward that takes ``**kwargs``). The model divides
its summed loss by it instead of taking a mean: another Python path, so another graph.
``compile()`` hands these keywords to the compiled module as expected
(``Recompile.expected_keywords``): the first call that passes them compiles their graph on
the plan compile() made (nothing probed again) without a warning, from the config the
Trainer set by then (``Trainer.__init__`` sets ``config.use_cache``, which forward reads).
Capturing it inside compile() instead costs every plain call of the model a second
capture (about as long as the first) that only the Trainer uses. Nothing here imports
transformers: a model that is not one of its ``PreTrainedModel``s gets no keywords.
"""

from __future__ import annotations

import inspect
import sys
from collections.abc import Mapping
from typing import Any

import torch
import torch.nn as nn

__all__ = ["TRAINER_KEYWORDS", "trainer_keywords"]

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

