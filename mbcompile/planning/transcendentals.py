"""How many transcendental values (exp, log, tanh, erf, ...) an ATen op computes.

FLOP counters count matmuls and convolutions; an elementwise op is priced by the bytes it
moves. That is right for an add, and wrong by 4-6x on a CPU for an op that evaluates a
polynomial per element: ``log_softmax`` over GPT-2's 50257 logits ran at about 1 ns per
element on one core, an add at 0.24 ns. The probe records this count per op
(``Probe.transcendental``) and the time model charges it at the system's
``transcendental_rate`` beside the FLOP and bandwidth terms.

>>> x = torch.randn(4, 10)
>>> count(torch.ops.aten._log_softmax.default, (x, -1, False), {}, None)
40
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

__all__ = ["TRANSCENDENTAL", "count"]

aten = torch.ops.aten


def _numel(args: tuple[Any, ...], kwargs: dict[str, Any], out: Any) -> int:
    # one value per element of the first tensor argument (the input, or the gradient)
    return args[0].numel() if args and isinstance(args[0], torch.Tensor) else 0


def _n_scores(q: torch.Tensor, k: torch.Tensor, causal: bool) -> int:
    # attention: one exp per score (batch x heads x queries x keys), half of them causal
    n = q.shape[:-1].numel() * k.shape[-2]
    return n // 2 if causal else n


def _scores(args: tuple[Any, ...], kwargs: dict[str, Any], out: Any) -> int:
    # (query, key, value, dropout_p, is_causal)
    return _n_scores(args[0], args[1], kwargs.get("is_causal", args[4] if len(args) > 4
                                                  else False))


def _scores_backward(args: tuple[Any, ...], kwargs: dict[str, Any], out: Any) -> int:
    # (grad_out, query, key, value, out, logsumexp, dropout_p, is_causal): the
    # probabilities are recomputed from the log-sum-exp, one exp per score
    return _n_scores(args[1], args[2], kwargs.get("is_causal", args[7] if len(args) > 7
                                                  else False))


def _pow(args: tuple[Any, ...], kwargs: dict[str, Any], out: Any) -> int:
    # x ** 2 is a multiply; x ** 0.5 or x ** 1.7 goes through exp and log
    exponent = args[1] if len(args) > 1 else kwargs.get("exponent")
    if isinstance(exponent, (int, float)) and float(exponent).is_integer():
        return 0
    return out.numel() if isinstance(out, torch.Tensor) else 0


#: op -> how many transcendental values it computes (one line per op group)
TRANSCENDENTAL: dict[Any, Callable[..., int]] = {}
for _group, _fn in (
    # one exp, log, tanh, erf or sine per element of the input
    (("exp", "exp2", "expm1", "log", "log2", "log10", "log1p", "sin", "cos", "tan", "tanh",
      "sinh", "cosh", "asin", "acos", "atan", "erf", "erfc", "erfinv", "sigmoid",
      "logit", "lgamma", "digamma"), _numel),
    # activations built on exp, erf or tanh, forward and backward (which recomputes it)
    (("silu", "silu_backward", "gelu", "gelu_backward", "elu", "elu_backward", "softplus",
      "softplus_backward", "mish", "mish_backward", "log_sigmoid_forward",
      "log_sigmoid_backward"), _numel),
    # softmax: an exp per element (the log of log_softmax is one per row); log_softmax's
    # backward exponentiates its output again; softmax's backward computes none
    (("_softmax", "_log_softmax", "_log_softmax_backward_data", "_safe_softmax"), _numel),
    (("pow",), _pow),  # a non-integer power
    (("_scaled_dot_product_flash_attention_for_cpu",), _scores),
    (("_scaled_dot_product_flash_attention_for_cpu_backward",), _scores_backward),
):
    for _name in _group:
        if hasattr(aten, _name):
            TRANSCENDENTAL[getattr(aten, _name)] = _fn


def count(func: Any, args: tuple[Any, ...], kwargs: dict[str, Any], out: Any) -> int:
    """Transcendental values ``func`` computes on ``args`` (0 for any op not in the table)."""
    fn = TRANSCENDENTAL.get(getattr(func, "overloadpacket", func))
    return int(fn(args, kwargs, out)) if fn is not None else 0
