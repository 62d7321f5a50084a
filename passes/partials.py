"""Per-microbatch partials of reductions over the batch.

The rewritten body calls these in place of a mean over the batch: each returns
``(sum, count)`` for its microbatch, the loop adds them up, and the mean is
divided once by the global count. That is what keeps token-level losses exact
when microbatches hold different numbers of non-padding tokens:

    eager:      loss = Σ_all l_i / N_valid
    microbatch: loss = (Σ_mb1 l_i + Σ_mb2 l_i) / (n_valid_mb1 + n_valid_mb2)   # same

A microbatch's count is a Python int when the shapes fix it, a 0-dim tensor when
the data do (targets equal to ``ignore_index`` do not count).
"""

from __future__ import annotations

import functools
import inspect
import math
from collections.abc import Callable
from typing import Any

import torch
import torch.nn as nn
import torch.nn.functional as F
from torch.nn import _reduction

__all__ = [
    "aten_binary_cross_entropy_partial",
    "aten_binary_cross_entropy_with_logits_partial",
    "aten_cosine_embedding_loss_partial",
    "aten_cross_entropy_loss_partial",
    "aten_hinge_embedding_loss_partial",
    "aten_huber_loss_partial",
    "aten_kl_div_partial",
    "aten_l1_loss_partial",
    "aten_margin_ranking_loss_partial",
    "aten_mse_loss_partial",
    "aten_multi_margin_loss_partial",
    "aten_multilabel_margin_loss_partial",
    "aten_nll_loss2d_partial",
    "aten_nll_loss_nd_partial",
    "aten_nll_loss_partial",
    "aten_poisson_nll_loss_partial",
    "aten_smooth_l1_loss_partial",
    "aten_soft_margin_loss_partial",
    "aten_triplet_margin_loss_partial",
    "binary_cross_entropy_partial",
    "binary_cross_entropy_with_logits_partial",
    "cosine_embedding_loss_partial",
    "cross_entropy_partial",
    "gaussian_nll_loss_partial",
    "hinge_embedding_loss_partial",
    "huber_loss_partial",
    "kl_div_partial",
    "l1_loss_partial",
    "loss_reduction",
    "margin_ranking_loss_partial",
    "mean_combine",
    "mean_partial",
    "module_loss_partial",
    "mse_loss_partial",
    "multi_margin_loss_partial",
    "multilabel_margin_loss_partial",
    "multilabel_soft_margin_loss_partial",
    "nll_loss_partial",
    "poisson_nll_loss_partial",
    "smooth_l1_loss_partial",
    "soft_margin_loss_partial",
    "triplet_margin_loss_partial",
    "triplet_margin_with_distance_loss_partial",
]

Count = int | torch.Tensor


def mean_partial(input: torch.Tensor, dim: Any = None, keepdim: bool = False, *,
                 dtype: torch.dtype | None = None) -> tuple[torch.Tensor, int]:
    """``x.mean(dim)`` -> ``(x.sum(dim), number of elements averaged)``."""
    if isinstance(dim, int):
        dims: Any = [dim]
    elif dim is None or len(dim) == 0:  # mean() and aten's mean.dim(x, []) average everything
        dims = range(input.dim())
    else:
        dims = dim
    count = math.prod(input.shape[d] for d in dims)
    total = input.sum(dim=tuple(dims), keepdim=keepdim, dtype=dtype)
    return total, count


def mean_combine(total: torch.Tensor, count: Count) -> torch.Tensor:
    """The global mean from the added-up partials: one division by the global count."""
    return total / count


@functools.cache
def _signature(fn: Callable[..., Any]) -> inspect.Signature:
    """``fn``'s signature, built once: building it costs more than a small microbatch's loss."""
    return inspect.signature(fn)


def _bound(fn: Callable[..., Any], args: tuple[Any, ...], kwargs: dict[str, Any]) -> dict[str, Any]:
    bound = _signature(fn).bind(*args, **kwargs)
    bound.apply_defaults()
    return dict(bound.arguments)


def loss_reduction(fn: Callable[..., Any], args: tuple[Any, ...], kwargs: dict[str, Any]) -> str:
    """The effective ``reduction`` of a functional loss call, legacy arguments included."""
    a = _bound(fn, args, kwargs)
    if a.get("size_average") is not None or a.get("reduce") is not None:
        return _reduction.legacy_get_string(a.get("size_average"), a.get("reduce"))
    return a.get("reduction", "mean")


def _summed(fn: Callable[..., Any], args: tuple[Any, ...], kwargs: dict[str, Any]
            ) -> tuple[torch.Tensor, dict[str, Any]]:
    a = _bound(fn, args, kwargs)
    for legacy in ("size_average", "reduce"):  # already folded into the reduction
        if legacy in a:
            a[legacy] = None
    a["reduction"] = "sum"
    return fn(**a), a


def _class_count(a: dict[str, Any]) -> Count:
    """Denominator of a 'mean' class loss: Σ weight[target] over non-ignored targets."""
    input, target, weight = a["input"], a["target"], a.get("weight")
    if target.is_floating_point():  # class probabilities: one count per sample position
        return input.numel() // input.shape[1] if input.dim() > 1 else 1
    valid = target != a.get("ignore_index", -100)
    if weight is None:
        return valid.sum()
    return weight[target.masked_fill(~valid, 0)].masked_fill(~valid, 0).sum()


def _elementwise_count(a: dict[str, Any]) -> int:
    return math.prod(torch.broadcast_shapes(a["input"].shape, a["target"].shape))


def _partial(fn: Callable[..., Any], count: Callable[[dict[str, Any]], Count]
             ) -> Callable[..., tuple[torch.Tensor, Count]]:
    def partial(*args: Any, **kwargs: Any) -> tuple[torch.Tensor, Count]:
        total, a = _summed(fn, args, kwargs)
        return total, count(a)

    partial.__name__ = f"{fn.__name__}_partial"
    partial.__qualname__ = partial.__name__
    partial.__module__ = __name__
    partial.__doc__ = f"``F.{fn.__name__}(..., reduction='mean')`` as ``(sum, count)``."
    return partial


cross_entropy_partial = _partial(F.cross_entropy, _class_count)
nll_loss_partial = _partial(F.nll_loss, _class_count)
mse_loss_partial = _partial(F.mse_loss, _elementwise_count)
l1_loss_partial = _partial(F.l1_loss, _elementwise_count)
smooth_l1_loss_partial = _partial(F.smooth_l1_loss, _elementwise_count)
huber_loss_partial = _partial(F.huber_loss, _elementwise_count)
binary_cross_entropy_partial = _partial(F.binary_cross_entropy, _elementwise_count)
binary_cross_entropy_with_logits_partial = _partial(
    F.binary_cross_entropy_with_logits, _elementwise_count)


def _none_partial(fn: Callable[..., Any]) -> Callable[..., tuple[torch.Tensor, Count]]:
    """A loss whose 'mean' is the mean of its reduction='none' values: (sum, numel)."""

    def partial(*args: Any, **kwargs: Any) -> tuple[torch.Tensor, Count]:
        a = _bound(fn, args, kwargs)
        for legacy in ("size_average", "reduce"):
            if legacy in a:
                a[legacy] = None
        a["reduction"] = "none"
        values = fn(**a)
        return values.sum(), values.numel()

    partial.__name__ = f"{fn.__name__}_partial"
    partial.__qualname__ = partial.__name__
    partial.__module__ = __name__
    partial.__doc__ = f"``F.{fn.__name__}(..., reduction='mean')`` as ``(sum, count)``."
    return partial


soft_margin_loss_partial = _none_partial(F.soft_margin_loss)
poisson_nll_loss_partial = _none_partial(F.poisson_nll_loss)
gaussian_nll_loss_partial = _none_partial(F.gaussian_nll_loss)
margin_ranking_loss_partial = _none_partial(F.margin_ranking_loss)
hinge_embedding_loss_partial = _none_partial(F.hinge_embedding_loss)
cosine_embedding_loss_partial = _none_partial(F.cosine_embedding_loss)
triplet_margin_loss_partial = _none_partial(F.triplet_margin_loss)
multi_margin_loss_partial = _none_partial(F.multi_margin_loss)
multilabel_margin_loss_partial = _none_partial(F.multilabel_margin_loss)
multilabel_soft_margin_loss_partial = _none_partial(F.multilabel_soft_margin_loss)
triplet_margin_with_distance_loss_partial = _none_partial(F.triplet_margin_with_distance_loss)


def _schema_call(packet: Any, args: tuple[Any, ...], kwargs: dict[str, Any],
                 **override: Any) -> tuple[Any, dict[str, Any]]:
    """Call ``packet.default`` with ``args``/``kwargs`` bound by its schema, some replaced."""
    op = packet.default
    bound: dict[str, Any] = {}
    positional: list[Any] = []
    keyword: dict[str, Any] = {}
    for i, arg in enumerate(op._schema.arguments):
        if i < len(args) and not arg.kwarg_only:
            value = args[i]
        elif arg.name in kwargs:
            value = kwargs[arg.name]
        elif arg.has_default_value():
            value = arg.default_value
        else:
            raise TypeError(f"{op} is missing argument {arg.name!r}")
        value = override.get(arg.name, value)
        bound[arg.name] = value
        (keyword.__setitem__(arg.name, value) if arg.kwarg_only else positional.append(value))
    return op(*positional, **keyword), bound


_SUM, _NONE = 2, 0  # ATen's reduction enum: 0 none, 1 mean, 2 sum


def _aten_partial(name: str, classes: bool) -> Callable[..., tuple[torch.Tensor, Count]]:
    """``aten.<name>(..., reduction=1)`` as ``(sum, count)``: the export graphs' spelling.

    Class losses (cross-entropy, NLL) count non-ignored targets, weighted as
    PyTorch weighs their mean; the others count the elements of their
    reduction='none' values.
    """
    packet = getattr(torch.ops.aten, name)

    def partial(*args: Any, **kwargs: Any) -> tuple[torch.Tensor, Count]:
        if classes:
            total, a = _schema_call(packet, args, kwargs, reduction=_SUM)
            return total, _class_count({"input": a["self"], "target": a["target"],
                                        "weight": a.get("weight"),
                                        "ignore_index": a.get("ignore_index", -100)})
        values, _ = _schema_call(packet, args, kwargs, reduction=_NONE)
        return values.sum(), values.numel()

    partial.__name__ = f"aten_{name}_partial"
    partial.__qualname__ = partial.__name__
    partial.__module__ = __name__
    partial.__doc__ = f"``aten.{name}(..., reduction=mean)`` as ``(sum, count)``."
    return partial


aten_cross_entropy_loss_partial = _aten_partial("cross_entropy_loss", True)
aten_nll_loss_partial = _aten_partial("nll_loss", True)
aten_nll_loss_nd_partial = _aten_partial("nll_loss_nd", True)
aten_nll_loss2d_partial = _aten_partial("nll_loss2d", True)
aten_mse_loss_partial = _aten_partial("mse_loss", False)
aten_l1_loss_partial = _aten_partial("l1_loss", False)
aten_smooth_l1_loss_partial = _aten_partial("smooth_l1_loss", False)
aten_huber_loss_partial = _aten_partial("huber_loss", False)
aten_binary_cross_entropy_partial = _aten_partial("binary_cross_entropy", False)
aten_binary_cross_entropy_with_logits_partial = _aten_partial(
    "binary_cross_entropy_with_logits", False)
aten_kl_div_partial = _aten_partial("kl_div", False)
aten_soft_margin_loss_partial = _aten_partial("soft_margin_loss", False)
aten_poisson_nll_loss_partial = _aten_partial("poisson_nll_loss", False)
aten_margin_ranking_loss_partial = _aten_partial("margin_ranking_loss", False)
aten_hinge_embedding_loss_partial = _aten_partial("hinge_embedding_loss", False)
aten_cosine_embedding_loss_partial = _aten_partial("cosine_embedding_loss", False)
aten_triplet_margin_loss_partial = _aten_partial("triplet_margin_loss", False)
aten_multi_margin_loss_partial = _aten_partial("multi_margin_loss", False)
aten_multilabel_margin_loss_partial = _aten_partial("multilabel_margin_loss", False)


def kl_div_partial(*args: Any, **kwargs: Any) -> tuple[torch.Tensor, Count]:
    """``F.kl_div`` with 'mean' (count = elements) or 'batchmean' (count = samples)."""
    batchmean = loss_reduction(F.kl_div, args, kwargs) == "batchmean"
    total, a = _summed(F.kl_div, args, kwargs)
    return total, (a["input"].shape[0] if batchmean else _elementwise_count(a))


# Loss modules and the functional call (and extra keyword arguments) they make.
_MODULE_LOSSES: dict[type[nn.Module], tuple[Callable[..., Any], tuple[str, ...]]] = {
    nn.CrossEntropyLoss: (cross_entropy_partial, ("weight", "ignore_index", "label_smoothing")),
    nn.NLLLoss: (nll_loss_partial, ("weight", "ignore_index")),
    nn.MSELoss: (mse_loss_partial, ()),
    nn.L1Loss: (l1_loss_partial, ()),
    nn.SmoothL1Loss: (smooth_l1_loss_partial, ("beta",)),
    nn.HuberLoss: (huber_loss_partial, ("delta",)),
    nn.BCELoss: (binary_cross_entropy_partial, ("weight",)),
    nn.BCEWithLogitsLoss: (binary_cross_entropy_with_logits_partial, ("weight", "pos_weight")),
    nn.KLDivLoss: (kl_div_partial, ("log_target",)),
    nn.SoftMarginLoss: (soft_margin_loss_partial, ()),
    nn.PoissonNLLLoss: (poisson_nll_loss_partial, ("log_input", "full", "eps")),
    nn.GaussianNLLLoss: (gaussian_nll_loss_partial, ("full", "eps")),
    nn.MarginRankingLoss: (margin_ranking_loss_partial, ("margin",)),
    nn.HingeEmbeddingLoss: (hinge_embedding_loss_partial, ("margin",)),
    nn.CosineEmbeddingLoss: (cosine_embedding_loss_partial, ("margin",)),
    nn.TripletMarginLoss: (triplet_margin_loss_partial, ("margin", "p", "eps", "swap")),
    nn.MultiMarginLoss: (multi_margin_loss_partial, ("p", "margin", "weight")),
    nn.MultiLabelMarginLoss: (multilabel_margin_loss_partial, ()),
    nn.MultiLabelSoftMarginLoss: (multilabel_soft_margin_loss_partial, ("weight",)),
    nn.TripletMarginWithDistanceLoss: (triplet_margin_with_distance_loss_partial,
                                       ("distance_function", "margin", "swap")),
}


def module_loss_partial(module: nn.Module, *inputs: Any) -> tuple[torch.Tensor, Count]:
    """A loss module's ``(sum, count)`` for one microbatch, from its own settings.

    ``inputs`` are what the module is called with: ``(input, target)``, or three
    tensors for ranking/triplet/Gaussian losses.
    """
    for cls in type(module).__mro__:
        if cls in _MODULE_LOSSES:
            fn, attrs = _MODULE_LOSSES[cls]
            kwargs = {a: getattr(module, a) for a in attrs}
            if module.reduction == "batchmean":
                kwargs["reduction"] = "batchmean"
            return fn(*inputs, **kwargs)
    raise TypeError(f"no partial for loss module {type(module).__name__}")
