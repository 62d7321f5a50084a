"""Per-microbatch partials of reductions over the batch, and the losses they come from.

The rewritten body calls these in place of a mean over the batch: each returns
``(sum, count)`` for its microbatch, the loop adds them up, and the mean is
divided once by the global count. That is what keeps token-level losses exact
when microbatches hold different numbers of non-padding tokens:

    eager:      loss = Σ_all l_i / N_valid
    microbatch: loss = (Σ_mb1 l_i + Σ_mb2 l_i) / (n_valid_mb1 + n_valid_mb2)   # same

A microbatch's count is a Python int when the shapes fix it, a 0-dim tensor when
the data do (targets equal to ``ignore_index`` do not count).

Every loss is declared once, in ``LOSSES``: its functional, its module, its ATen
spellings and its ``LossKind`` (what its 'mean' divides by). That one line yields
the loss's partials here (``Loss.partial`` for ``F.<loss>``, ``module_loss_partial``
for the module, ``Loss.aten_partials`` for export graphs) and its batch rule in
``rules`` (``loss_rule``). ``F.mse_loss(x, y)`` with ``reduction='mean'``
becomes ``mse_loss_partial(x, y) == (F.mse_loss(x, y, reduction='sum'), x.numel())``.
"""

from __future__ import annotations

import enum
import functools
import inspect
import math
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn as nn
import torch.nn.functional as F
from torch.nn import _reduction

__all__ = [
    "LOSSES",
    "PARTIALS",
    "Count",
    "Loss",
    "LossKind",
    "loss_for",
    "loss_reduction",
    "mean_combine",
    "mean_partial",
    "module_loss_partial",
]

Count = int | torch.Tensor

_LEGACY = ("size_average", "reduce")  # old spellings of reduction=, folded into it
_SUM, _NONE = 2, 0  # ATen's reduction enum: 0 none, 1 mean, 2 sum


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


def mean_combine(total: torch.Tensor, count: Count, dtype: torch.dtype | None = None
                 ) -> torch.Tensor:
    """The global mean from the added-up partials: one division by the global count; a
    mean of half-precision values (``dtype``), whose partials the body sums in float32
    (``HALF``), rounded once to it, as eager's mean rounds."""
    mean = total / count
    return mean if dtype is None else mean.to(dtype)


#: the dtypes whose means a microbatch sums in float32, and the step adds up in float32:
#: eager's mean accumulates in float32 and rounds once, where float16 partial sums
#: overflowed (4 microbatches of an autoencoder's ``mse_loss``: inf, eager 0.88)
HALF = (torch.float16, torch.bfloat16)


def _summed(values: torch.Tensor, dtype: torch.dtype | None) -> torch.Tensor:
    """A loss's ``reduction='none'`` values summed, in ``dtype`` where given."""
    return values.sum() if dtype is None else values.sum(dtype=dtype)


# ---------------------------------------------------------------------------
# Losses: what a 'mean' divides by
# ---------------------------------------------------------------------------

class LossKind(enum.Enum):
    """What one sample is to a loss: it fixes the count its 'mean' divides by, and
    whether the batch must be dim 0 (the N of ``(N, C, ...)`` inputs)."""

    CLASSES = "Σ over targets / Σ weight[target] of targets ≠ ignore_index; (N, C, ...) scores"
    ELEMENTS = "reduction='sum' / elements of input and target broadcast; any batch dim"
    VALUES = "Σ of the reduction='none' values / their number; any batch dim"
    ROWS = "Σ of the reduction='none' values (one per row) / their number; (N, ...) inputs"
    BATCHMEAN = "reduction='sum' / elements, or / N for reduction='batchmean'; (N, ...) inputs"
    LENGTHS = "Σ of the reduction='none' values, each / its target length (≥ 1) / their number"

    @property
    def n_first(self) -> bool:
        """The loss reads (N, ...) inputs row by row, so the batch must be dim 0."""
        return self in (LossKind.CLASSES, LossKind.ROWS, LossKind.BATCHMEAN)

    @property
    def from_values(self) -> bool:
        """The partial sums the loss's reduction='none' values (else it asks for 'sum')."""
        return self in (LossKind.VALUES, LossKind.ROWS, LossKind.LENGTHS)


CLASSES = LossKind.CLASSES
ELEMENTS = LossKind.ELEMENTS
VALUES = LossKind.VALUES
ROWS = LossKind.ROWS
BATCHMEAN = LossKind.BATCHMEAN
LENGTHS = LossKind.LENGTHS


@dataclass(frozen=True)
class Loss:
    """One loss, declared once: every spelling, and how its 'mean' splits into (sum, count).

    ``reduction`` is read the way PyTorch reads it: the functional's ``reduction=``
    (or the legacy ``size_average``/``reduce``), the module's ``.reduction``, ATen's
    int (0 none, 1 mean, 2 sum). The module calls ``fn`` with its own settings of
    the same name (``nn.CrossEntropyLoss().ignore_index``): ``settings``.
    """

    fn: Callable[..., torch.Tensor]  # F.cross_entropy
    module: type[nn.Module]  # nn.CrossEntropyLoss
    kind: LossKind
    aten_names: tuple[str, ...] | None = None  # None: fn's own name, where ATen has one

    @functools.cached_property
    def aten(self) -> tuple[Any, ...]:
        """The ATen overload packets of export graphs (``torch.ops.aten.cross_entropy_loss``)."""
        names = self.aten_names if self.aten_names is not None else (self.fn.__name__,)
        return tuple(p for p in map(_aten_packet, names) if p is not None)

    @property
    def spellings(self) -> tuple[Any, ...]:
        """Every op a graph may call it by: functional, module class, ATen packets."""
        return (self.fn, self.module, *self.aten)

    @functools.cached_property
    def settings(self) -> tuple[str, ...]:
        """The module's attributes its ``forward`` passes on to ``fn`` (weight, margin, ...)."""
        init = inspect.signature(self.module.__init__).parameters
        call = _signature(self.fn).parameters
        return tuple(p for p in init if p in call and p not in (*_LEGACY, "reduction"))

    @functools.cached_property
    def partial(self) -> Callable[..., tuple[torch.Tensor, Count]]:
        """``fn(..., reduction='mean')`` as ``(sum, count)``, ``fn``'s own signature."""
        return _partial(self.fn, self.kind)

    @functools.cached_property
    def aten_partials(self) -> dict[Any, Callable[..., tuple[torch.Tensor, Count]]]:
        """``aten.<name>(..., reduction=1)`` as ``(sum, count)``, per ATen packet."""
        return {packet: _aten_partial(packet, self.kind) for packet in self.aten}


# The losses. Columns: functional, module, what its 'mean' divides by (LossKind above),
# ATen spellings where they are not the functional's own name.
LOSSES: tuple[Loss, ...] = (
    Loss(F.cross_entropy, nn.CrossEntropyLoss, CLASSES, ("cross_entropy_loss",)),
    Loss(F.nll_loss, nn.NLLLoss, CLASSES, ("nll_loss", "nll_loss_nd", "nll_loss2d")),
    Loss(F.mse_loss, nn.MSELoss, ELEMENTS),
    Loss(F.l1_loss, nn.L1Loss, ELEMENTS),
    Loss(F.smooth_l1_loss, nn.SmoothL1Loss, ELEMENTS),
    Loss(F.huber_loss, nn.HuberLoss, ELEMENTS),
    Loss(F.binary_cross_entropy, nn.BCELoss, ELEMENTS),
    Loss(F.binary_cross_entropy_with_logits, nn.BCEWithLogitsLoss, ELEMENTS),
    Loss(F.kl_div, nn.KLDivLoss, BATCHMEAN),
    Loss(F.soft_margin_loss, nn.SoftMarginLoss, VALUES),
    Loss(F.poisson_nll_loss, nn.PoissonNLLLoss, VALUES),
    Loss(F.gaussian_nll_loss, nn.GaussianNLLLoss, VALUES),
    Loss(F.margin_ranking_loss, nn.MarginRankingLoss, VALUES),
    Loss(F.hinge_embedding_loss, nn.HingeEmbeddingLoss, VALUES),
    Loss(F.cosine_embedding_loss, nn.CosineEmbeddingLoss, ROWS),
    Loss(F.triplet_margin_loss, nn.TripletMarginLoss, ROWS),
    Loss(F.multi_margin_loss, nn.MultiMarginLoss, ROWS),
    Loss(F.multilabel_margin_loss, nn.MultiLabelMarginLoss, ROWS),
    Loss(F.multilabel_soft_margin_loss, nn.MultiLabelSoftMarginLoss, ROWS),
    Loss(F.triplet_margin_with_distance_loss, nn.TripletMarginWithDistanceLoss, ROWS),
    Loss(F.ctc_loss, nn.CTCLoss, LENGTHS, ()),  # (T, N, C) log-probs; export cannot capture it
)


# ---------------------------------------------------------------------------
# How a declaration becomes its partials
# ---------------------------------------------------------------------------

@functools.cache
def _signature(fn: Callable[..., Any]) -> inspect.Signature:
    """``fn``'s signature, built once: building it costs more than a small microbatch's loss."""
    return inspect.signature(fn)


def _aten_packet(name: str) -> Any:
    """``torch.ops.aten.<name>``, or None where this torch has no such op."""
    try:
        return getattr(torch.ops.aten, name)
    except (AttributeError, RuntimeError):
        return None


def _bound(fn: Callable[..., Any], args: tuple[Any, ...], kwargs: dict[str, Any]) -> dict[str, Any]:
    """``fn``'s arguments by name, defaults included (``Signature.bind`` without inspect at
    run time: the names come from :func:`_layout`, a constant to torch.compile)."""
    names, defaults = _layout(fn, len(args), tuple(kwargs))
    bound = dict(defaults)
    bound.update(zip(names, args))
    bound.update(kwargs)
    return bound


def _layout(fn: Callable[..., Any], n_args: int, keys: tuple[str, ...]
            ) -> tuple[tuple[str, ...], tuple[tuple[str, Any], ...]]:
    """The names of ``fn``'s first ``n_args`` parameters, and the defaults of the others
    not in ``keys``; a call that does not fit the signature raises as ``bind`` would."""
    return _layout_of(fn, n_args, keys)


# torch.compile traces _layout as its value (dynamo cannot trace inspect): what
# @torch._dynamo.assume_constant_result sets, without importing dynamo here (1 s of every
# process's start); tests/test_layering.py checks that the decorator still sets only this.
_layout._dynamo_marked_constant = True  # type: ignore[attr-defined]


@functools.cache  # one call shape per loss call site: bound once, not once per microbatch
def _layout_of(fn: Callable[..., Any], n_args: int, keys: tuple[str, ...]
               ) -> tuple[tuple[str, ...], tuple[tuple[str, Any], ...]]:
    sig = _signature(fn)
    sig.bind(*range(n_args), **dict.fromkeys(keys))  # the same TypeError for a bad call
    params = list(sig.parameters.values())
    names = tuple(p.name for p in params[:n_args])
    defaults = tuple((p.name, p.default) for p in params[n_args:]
                     if p.name not in keys and p.default is not inspect.Parameter.empty)
    return names, defaults


def _reduction_of(a: dict[str, Any]) -> str:
    if a.get("size_average") is not None or a.get("reduce") is not None:
        return _reduction.legacy_get_string(a.get("size_average"), a.get("reduce"))
    return a.get("reduction", "mean")


def loss_reduction(fn: Callable[..., Any], args: tuple[Any, ...], kwargs: dict[str, Any]) -> str:
    """The effective ``reduction`` of a functional loss call, legacy arguments included."""
    return _reduction_of(_bound(fn, args, kwargs))


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


def _named(partial: Callable[..., Any], name: str, doc: str) -> Callable[..., Any]:
    """Name a partial as this module's attribute, so fx prints (and pickles) it by name."""
    partial.__name__ = partial.__qualname__ = name
    partial.__module__ = __name__
    partial.__doc__ = doc
    return partial


def _partial(fn: Callable[..., Any], kind: LossKind) -> Callable[..., tuple[torch.Tensor, Count]]:
    def partial(*args: Any, sum_dtype: torch.dtype | None = None, **kwargs: Any
                ) -> tuple[torch.Tensor, Count]:
        a = _bound(fn, args, kwargs)
        mode = _reduction_of(a)
        for legacy in _LEGACY:  # already folded into mode
            if legacy in a:
                a[legacy] = None
        if kind.from_values:
            a["reduction"] = "none"
            values = fn(**a)
            if kind is LENGTHS:  # as ATen's ctc_loss: lengths in the values' dtype, clamped
                lengths = torch.as_tensor(a["target_lengths"], device=values.device)
                values = values / lengths.to(values.dtype).clamp_min(1)
            return _summed(values, sum_dtype), values.numel()
        a["reduction"] = "sum" if sum_dtype is None else "none"  # (the sum of 'none' is 'sum')
        total = fn(**a) if sum_dtype is None else _summed(fn(**a), sum_dtype)
        if kind is CLASSES:
            return total, _class_count(a)
        if kind is BATCHMEAN and mode == "batchmean":
            return total, a["input"].shape[0]
        return total, _elementwise_count(a)

    return _named(partial, f"{fn.__name__}_partial",
                  f"``F.{fn.__name__}(..., reduction='mean')`` as ``(sum, count)``.")


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


def _aten_partial(packet: Any, kind: LossKind) -> Callable[..., tuple[torch.Tensor, Count]]:
    """Class losses count non-ignored targets, weighted as PyTorch weighs their mean;
    the others count the elements of their reduction='none' values."""

    def partial(*args: Any, sum_dtype: torch.dtype | None = None, **kwargs: Any
                ) -> tuple[torch.Tensor, Count]:
        if kind is CLASSES:
            total, a = _schema_call(packet, args, kwargs,
                                    reduction=_SUM if sum_dtype is None else _NONE)
            return _summed(total, sum_dtype) if sum_dtype is not None else total, _class_count(
                {"input": a["self"], "target": a["target"], "weight": a.get("weight"),
                 "ignore_index": a.get("ignore_index", -100)})
        values, _ = _schema_call(packet, args, kwargs, reduction=_NONE)
        return _summed(values, sum_dtype), values.numel()

    name = packet.__name__  # torch.ops.aten.nll_loss -> "nll_loss"
    return _named(partial, f"aten_{name}_partial",
                  f"``aten.{name}(..., reduction=mean)`` as ``(sum, count)``.")


# ---------------------------------------------------------------------------
# Lookups: by spelling, by module, by name
# ---------------------------------------------------------------------------

_BY_SPELLING: dict[Any, Loss] = {s: loss for loss in LOSSES for s in loss.spellings}

#: Every loss partial by its name (``mse_loss_partial``, ``aten_nll_loss_partial``):
#: module attributes of this module too, so graphs that call them print and pickle.
PARTIALS: dict[str, Callable[..., tuple[torch.Tensor, Count]]] = {
    p.__name__: p for loss in LOSSES for p in (loss.partial, *loss.aten_partials.values())}


def loss_for(op: Any) -> Loss | None:
    """The declaration of a loss functional, ATen op, module or module class (subclasses too)."""
    if isinstance(op, torch._ops.OpOverload):
        op = op.overloadpacket
    if isinstance(op, nn.Module):
        op = type(op)
    for key in op.__mro__ if isinstance(op, type) else (op,):
        try:
            if key in _BY_SPELLING:
                return _BY_SPELLING[key]
        except TypeError:  # an unhashable target
            return None
    return None


def module_loss_partial(module: nn.Module, *inputs: Any, sum_dtype: torch.dtype | None = None
                        ) -> tuple[torch.Tensor, Count]:
    """A loss module's ``(sum, count)`` for one microbatch, from its own settings.

    ``inputs`` are what the module is called with: ``(input, target)``, or three
    tensors for ranking/triplet/Gaussian losses. ``sum_dtype``: the values summed in it
    (float32 for half precision: ``HALF``).
    """
    loss = loss_for(module)
    if loss is None:
        raise TypeError(f"no partial for loss module {type(module).__name__}")
    kwargs = {a: getattr(module, a) for a in loss.settings}
    if module.reduction == "batchmean":
        kwargs["reduction"] = "batchmean"
    return loss.partial(*inputs, sum_dtype=sum_dtype, **kwargs)


def __getattr__(name: str) -> Any:
    """``partials.mse_loss_partial``: the partials by name (PEP 562)."""
    try:
        return PARTIALS[name]
    except KeyError:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}") from None


def __dir__() -> list[str]:
    return sorted([*globals(), *PARTIALS])


__all__ += sorted(PARTIALS)
