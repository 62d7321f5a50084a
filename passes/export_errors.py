"""Why ``torch.export`` failed, in the user's terms (``export_capture``'s refusal).

>>> raise export_error(model, exc, fx_error, in_dims) from exc
"""

from __future__ import annotations

import os
import re
import traceback
from collections.abc import Mapping

import torch

from .errors import CaptureError
from .export_shapes import length_baked_in
from .sources import is_library, user_frame

__all__ = ["SPECIALISED", "export_error"]

SPECIALISED = re.compile(r"specialized it to be a constant \((\d+)\)")
#: export's guard that not every batch size satisfies (``chunk(2)`` of a symbolic size)
GUARD = re.compile(r"Not all values of \w+ = [^\n]*? satisfy the generated guard ([^\n]+)")


def _in_hook(model: torch.nn.Module, exc: BaseException) -> str:
    """A line naming the forward hook (or pre-hook) of one of ``model``'s modules that export
    failed in, if it failed in one: the graph traces a hook as part of forward, so one
    registered after compile (transformers' NEFTune noise) is captured with the rest."""
    code, tb = None, exc.__traceback__
    while tb is not None:  # the innermost frame outside torch and mbcompile
        if not is_library(os.path.abspath(tb.tb_frame.f_code.co_filename)):
            code = tb.tb_frame.f_code
        tb = tb.tb_next
    if code is None:
        return ""
    for name, module in model.named_modules():
        for kind, table in (("forward hook", module._forward_hooks),
                            ("forward pre-hook", module._forward_pre_hooks)):
            for hook in table.values():
                fn = getattr(hook, "__wrapped__", hook)
                if getattr(fn, "__code__", None) is code:
                    return (f"  it failed in the {kind} {fn.__qualname__!r} of "
                            f"{name or 'the model'!r}, which the graph traces with forward: "
                            "make it work for any batch and length, or remove it while "
                            "training with mbcompile (transformers' NEFTune: "
                            "neftune_noise_alpha=None)\n")
    return ""


def export_error(model: torch.nn.Module, exc: BaseException,
                  fx_error: BaseException | None,
                  in_dims: Mapping[str, int | None] | None = None) -> CaptureError:
    """A ``CaptureError`` that says why export failed in the user's terms."""
    text = str(exc)
    tried = f"  torch.fx.symbolic_trace failed first: {fx_error}\n" if fx_error else ""
    lines = [line.strip() for line in text.strip().splitlines() if line.strip()]
    # the first line, and what it introduces ("Found the following conflicts ...:")
    first = " ".join(lines[:2] if lines and lines[0].endswith(":") else lines[:1])
    baked = SPECIALISED.search(text)
    length = length_baked_in(model, text, in_dims or {})
    if length is not None:
        return length
    if baked:
        n = baked.group(1)
        why = (f"  the batch size is baked in: the code only works for a batch of {n} (a "
               f"constant in a view or reshape, such as x.view({n}, -1), a branch on the batch "
               "size, or a Python loop over the samples: for b in range(len(x)), x.unbind(0), "
               "zip over a batched tensor), so it cannot run on microbatches of other sizes "
               "(torch.export does not say where; capture='fx' names the line).\n"
               "  Fix: derive batch sizes from the input (x.view(x.size(0), -1), x.flatten(1), "
               "or -1), or do per-sample work with batched ops (or torch.vmap) instead of a "
               "loop.")
    elif GUARD.search(text):  # a size the code cuts or regroups (export names no line)
        guards = "".join(f"    {re.split(r'[.](?=[A-Z])', g)[0].strip()}\n"  # (its own line)
                         for g in GUARD.findall(text)[:3])
        why = ("  the code holds only for some batch sizes; torch.export's guard on them:\n"
               f"{guards}  Such a guard comes from an op that cuts or regroups the batch dim "
               "(x.chunk(2) of a concatenated pair, x.view(-1, G) of groups, torch.split of "
               "the flattened batch) or a Python number made from a size (int(N * k / E)); "
               "capture='fx' names the line. Fix: keep per-sample work batched (r[:B], r[B:] "
               "with B taken from an input's size), or compute it after the model, on its "
               "outputs.")
    else:
        where = user_frame(traceback.extract_tb(exc.__traceback__))
        at = f"  at {where}\n" if not where.startswith("<") else ""
        why = (f"  torch.export: {type(exc).__name__}: {first}\n{at}{_in_hook(model, exc)}"
               "  Export needs shapes that do not depend on tensor values and code that works "
               "for any batch size. Fix: remove data-dependent Python (branches on tensor "
               "values, .item(), boolean-mask indexing), derive batch sizes from x.size(0) "
               "instead of constants, or pass an already captured torch.fx.GraphModule.")
    return CaptureError(f"torch.export could not capture {type(model).__name__}.forward with "
                        f"a dynamic batch dimension\n{tried}{why}")

