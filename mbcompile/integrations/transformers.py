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
import contextvars
import inspect
import sys
from collections.abc import Iterator, Mapping
from typing import Any

import torch
import torch.nn as nn

__all__ = ["TRAINER_KEYWORDS", "as_the_trainer_sets", "called_plainly", "install_output_hooks",
           "padded_dims", "plain_calls", "trainer_keywords"]

#: the keywords the Trainer adds to a call, beside the batch's columns
TRAINER_KEYWORDS = ("num_items_in_batch",)

#: set by ``called_plainly``: compile() compiles the example's own call
_PLAIN = contextvars.ContextVar("mbcompile_plain_calls", default=False)


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


@contextlib.contextmanager
def called_plainly() -> Iterator[None]:
    """While the block runs, ``compile()`` compiles a transformers model for the example's
    own call, not the Trainer's: for a caller that never passes the Trainer's keywords
    (``mbcompile.Trainer``), whose calls would otherwise each compile their graph again.

    >>> with called_plainly():
    ...     cm = mbcompile.compile(model, 8, 2, example_kwargs=batch)
    """
    token = _PLAIN.set(True)
    try:
        yield
    finally:
        _PLAIN.reset(token)


def plain_calls() -> bool:
    """Whether ``compile()`` runs inside ``called_plainly``."""
    return _PLAIN.get()


def install_output_hooks(model: nn.Module, example: Mapping[str, Any]) -> None:
    """What eager's first call does to a transformers model that is asked, by keyword or by
    its config, for outputs its layers' hooks record (``output_hidden_states``,
    ``output_attentions``, ``output_router_logits``): transformers installs those hooks on
    that call, for good, and marks the model. Done here for real, before the capture, so
    that the trace finds them installed and the model is as eager's first call leaves it
    (a trace that installed them would put them back and keep the mark: refused,
    ``passes/side_effects.rewiring_refused``). A call it does not foresee (a keyword that
    only a later call passes) is a variant, captured through here too."""
    transformers = sys.modules.get("transformers")
    if transformers is None:  # not a transformers model: importing it would cost seconds
        return
    try:
        from transformers.utils import output_capturing
    except ImportError:  # transformers 4: outputs are returned without hooks
        return
    registry = getattr(output_capturing, "_CAN_RECORD_REGISTRY", None)
    install = getattr(output_capturing, "maybe_install_capturing_hooks", None)
    if registry is None or install is None:
        return
    for module in model.modules():
        if not (isinstance(module, transformers.PreTrainedModel)
                and _captures_outputs(type(module).forward)):
            continue
        flags = registry.get(module)
        config = getattr(module, "config", None)

        def asked(name: str, config: Any = config) -> bool:  # a keyword left None: config's
            value = example.get(name)
            return bool(getattr(config, name, False) if value is None else value)

        # cross and mask-decoder attentions are asked for by ``output_attentions`` too
        if any(asked(f"output_{k}") for k in flags) or (asked("output_attentions") and {
                "cross_attentions", "mask_decoder_attentions"} & set(flags)):
            install(module)


def _captures_outputs(forward: Any) -> bool:
    """Whether ``forward`` is wrapped by transformers' ``capture_outputs`` (the module whose
    call installs the hooks: the base model, not the head around it), through any other
    decorators (``functools.wraps`` keeps the inner name; the wrapper's code has its own)."""
    while forward is not None:
        code = getattr(forward, "__code__", None)
        if code is not None and "capture_outputs" in getattr(code, "co_qualname", ""):
            return True
        forward = getattr(forward, "__wrapped__", None)
    return False
