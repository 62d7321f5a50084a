"""A transformers model's cache switched off while torch.export traces it, as eager's
training call would not miss it.

transformers builds a ``DynamicCache`` in every call of a model whose config says
``use_cache=True`` (every ``from_pretrained`` default), also in training; export cannot
flatten it, and it is inference state, so the trace runs without it (``cache_off``). One
thing eager does differs with it: transformers detects packed rows (``position_ids`` that
restart per document, no attention mask) only where there is no cache, so eager, with
its cache, attends across the documents of a row. The trace keeps eager's answer
(``_packing_unseen``): without it the compiled step masked each document apart (Llama's
loss 4.1708 against 4.1626, ``q_proj``'s gradient 75% off; found by a hunt).
"""

from __future__ import annotations

import contextlib
import sys
from collections.abc import Iterator, Mapping
from typing import Any

import torch

__all__ = ["cache_off"]


@contextlib.contextmanager
def cache_off(model: torch.nn.Module, example: Mapping[str, Any]) -> Iterator[None]:
    """``config.use_cache = False`` on every config of ``model`` while export traces it, then
    each put back exactly as it was (the user's model is left untouched).

    A forward without its own ``use_cache`` parameter (GraniteMoE, a PEFT ``PeftModel``)
    passes it on through ``**kwargs``, where the example call cannot set it; the inner
    model then reads its config (transformers' ``merge_with_config_defaults``) and builds a
    ``DynamicCache`` that export cannot flatten. The cache is inference state, not part
    of a training step: ``export_kwargs`` switches it off the same way when forward
    names ``use_cache``. A call that sets ``use_cache`` itself decides.
    """
    if example.get("use_cache") is not None:
        yield
        return
    configs: dict[int, Any] = {}
    for module in model.modules():
        config = getattr(module, "config", None)
        if getattr(config, "use_cache", None) is True:
            configs[id(config)] = config
    own = {key: "use_cache" in getattr(c, "__dict__", {}) for key, c in configs.items()}
    try:
        for config in configs.values():
            config.use_cache = False
        with _packing_unseen(bool(configs)):
            yield
    finally:
        for key, config in configs.items():
            if own[key]:
                config.use_cache = True
            else:  # it came from the class: drop the instance's copy again
                del config.use_cache


@contextlib.contextmanager
def _packing_unseen(cache_was_on: bool) -> Iterator[None]:
    """transformers' packed-row detection answers "none" while the trace runs without the
    cache eager's call builds (eager, with it, never asks); as it is otherwise."""
    masking = sys.modules.get("transformers.masking_utils")
    find = getattr(masking, "find_packed_sequence_indices", None)
    if not cache_was_on or find is None:
        yield
        return
    masking.find_packed_sequence_indices = lambda position_ids: None
    try:
        yield
    finally:
        masking.find_packed_sequence_indices = find
