"""Batch rules: one table, op -> rule, registered by family.

A rule gets a ``RuleContext`` (the node, its arguments' facts, the shapes of its
value at two batch sizes) and returns the node's fact, or calls ``ctx.mix(...)``
to reject the op. Keys are:

- a module class (``nn.Linear``) for ``call_module`` nodes,
- a function (``torch.relu``, ``F.linear``, ``operator.add``, an ATen overload
  packet such as ``torch.ops.aten.linear``) for ``call_function`` nodes,
- a method name string (``"view"``) for ``call_method`` nodes.

As in JAX's ``primitive_batchers``, an op without a rule is rejected, never
guessed. Users add rules with ``register_batch_rule(op, rule)``.

Worked example, ``loss = F.cross_entropy(self.head(x).view(-1, V), y.view(-1))``:

1. ``x`` is ``Batched(0)`` (an input); ``self.head`` is ``nn.Linear``, whose rule
   ``contracts_last`` checks the batch dim is not the contracted last dim.
2. ``view(-1, V)`` merges (B, T) into B*T rows: ``reshape_rule`` sees from the
   shapes at gbs and gbs+1 that dim 0 scales as T*B, batch-major: ``Batched(0, T)``.
3. ``cross_entropy`` with ``reduction='mean'`` is a reduction over the batch:
   ``loss_rule`` returns ``Reduced`` and records a ``ReductionSpec("mean",
   cross_entropy_partial)`` so the rewrite computes (sum, count) per microbatch.
"""

from __future__ import annotations

import math
import operator
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field
from typing import Any, NoReturn

import torch
import torch.fx as fx
import torch.nn as nn
import torch.nn.functional as F

from mbcompile import partials
from mbcompile.errors import MixingError

from .facts import (
    REDUCTION,
    Batched,
    BatchSize,
    Container,
    Fact,
    Free,
    Reduced,
    ReductionSpec,
    ValueInfo,
)

__all__ = [
    "BATCH_RULES",
    "RuleContext",
    "lookup_rule",
    "register_batch_rule",
    "rule_key",
    "trust_module",
]

Rule = Callable[["RuleContext"], Fact]

#: The one table: op -> rule.
BATCH_RULES: dict[Any, Rule] = {}


class _Rejected(Exception):
    """Raised by ``RuleContext.mix``; the analysis turns it into a ``MixingError``."""

    def __init__(self, reason: str, fix: str) -> None:
        super().__init__(reason)
        self.reason = reason
        self.fix = fix


@dataclass
class RuleContext:
    """What a rule sees of one node."""

    node: fx.Node
    facts: dict[fx.Node, Fact]
    gbs: int
    module: nn.Module | None = None
    _args: tuple[Any, ...] = field(default=())
    _kwargs: dict[str, Any] = field(default_factory=dict)

    # ----------------------------------------------------------------- inputs
    def arg(self, index: int, name: str | None = None, default: Any = None) -> Any:
        """The raw argument (an fx.Node or a constant) by position or keyword."""
        if name is not None and name in self._kwargs:
            return self._kwargs[name]
        if index < len(self._args):
            return self._args[index]
        return default

    def fact(self, value: Any) -> Fact:
        """The fact of an argument; constants are batch-free."""
        if isinstance(value, fx.Node):
            return self.facts[value]
        if isinstance(value, (tuple, list)):
            return _join([self.fact(v) for v in value], self)
        return Free()

    def arg_facts(self) -> list[Fact]:
        """Facts of every argument (positional and keyword, flattened)."""
        out: list[Fact] = []
        fx.node.map_arg((self._args, self._kwargs), lambda n: out.append(self.facts[n]))
        return out

    def info(self, value: Any = None) -> Any:
        """The ``ValueInfo`` of the node's value, or of an argument node."""
        from .facts import SHAPES

        node = self.node if value is None else value
        return node.meta.get(SHAPES) if isinstance(node, fx.Node) else None

    # ---------------------------------------------------------------- verdicts
    def mix(self, reason: str, fix: str = "") -> NoReturn:
        raise _Rejected(reason, fix)

    def batched_out(self, major: bool | None = None) -> Batched:
        """The node's value as per-sample, locating the batch dim from its shapes."""
        info = self.info()
        if isinstance(info, tuple):
            self.mix("returns several values; give it a rule that names each one's batch dim")
        if not isinstance(info, ValueInfo) or not info.is_tensor:
            self.mix("produces a non-tensor value from per-sample inputs")
        dims = info.batch_dims
        if len(dims) == 0:
            self.mix("its output no longer has a batch dim: it selects, drops or combines "
                     "samples (for example indexing or slicing the batch dim)",
                     "keep the batch dim whole: index and slice only the other dims")
        if len(dims) > 1:
            self.mix(f"its output has {len(dims)} dims that grow with the batch "
                     f"(shape {tuple(info.shape_a)} at batch {self.gbs}), so it pairs "
                     "every sample with every other sample",
                     "compute the interaction per sample, or compile with mbs='none'")
        d = dims[0]
        factor = _factor(info.shape_a[d], info.shape_b[d], self.gbs)
        if factor is None:
            self.mix(f"dim {d} has {info.shape_a[d]} rows at batch {self.gbs} and "
                     f"{info.shape_b[d]} at batch {self.gbs + 1}: not a whole number of rows "
                     "per sample, so the batch size is baked in (a constant in a view, "
                     "a slice of the batch dim)",
                     "derive batch sizes from the input (x.size(0), -1) instead of constants")
        if major is None:
            major = all(f.major for f in self.arg_facts() if isinstance(f, Batched))
        return Batched(d, factor, major or factor == 1)


def _factor(size_a: int, size_b: int, gbs: int) -> int | None:
    f = size_b - size_a
    return f if f > 0 and size_a == f * gbs else None


def _join(facts: Iterable[Fact], ctx: RuleContext) -> Fact:
    """The fact of a value computed from several facts by an op applied per sample."""
    facts = list(facts)
    if any(isinstance(f, Reduced) for f in facts):
        if any(isinstance(f, (Batched, BatchSize)) for f in facts):
            ctx.mix("it combines per-sample values with a statistic of the whole batch "
                    "(such as x - x.mean(0)): each microbatch would see only its own "
                    "statistic",
                    "use per-sample normalisation (LayerNorm, GroupNorm), or compile with "
                    "mbs='none'")
        return Reduced(count=all(f.count for f in facts if isinstance(f, Reduced)))
    if any(isinstance(f, Batched) for f in facts):
        return ctx.batched_out()
    if any(isinstance(f, BatchSize) for f in facts):
        return _int_fact(ctx)
    return Free()


def _int_fact(ctx: RuleContext) -> Fact:
    """Facts of Python ints derived from batch sizes, read off their two values."""
    info = ctx.info()
    if isinstance(info, ValueInfo) and info.is_tensor:
        return ctx.batched_out()
    if not isinstance(info, ValueInfo) or info.int_a is None:
        return Free()
    if info.int_a == info.int_b:
        return Free()
    factor = _factor(info.int_a, info.int_b, ctx.gbs)
    if factor is None:
        ctx.mix(f"it computes {info.int_a} from the batch size {ctx.gbs}, which is not a "
                "multiple of it, so it would differ per microbatch",
                "use sizes that are multiples of the batch size, or compile with mbs='none'")
    return BatchSize(factor)


# ---------------------------------------------------------------------------
# Registration
# ---------------------------------------------------------------------------

def rule_key(op: Any) -> Any:
    """The table key of an op: ATen overloads map to their packet."""
    if isinstance(op, torch._ops.OpOverload):
        return op.overloadpacket
    return op


def register_batch_rule(op: Any, rule: Rule | str) -> None:
    """Register ``rule`` for ``op`` (a module class, function, method name or ATen op).

    ``rule`` is a function ``(RuleContext) -> Fact`` or the name of a built-in
    family: ``"per_sample"`` (the op never mixes samples: the output's batch dim
    is found from its shape), ``"pointwise"``, ``"free"``.
    """
    if isinstance(rule, str):
        try:
            rule = FAMILIES[rule]
        except KeyError:
            raise ValueError(f"unknown rule family {rule!r}; one of {sorted(FAMILIES)}") from None
    BATCH_RULES[rule_key(op)] = rule


def trust_module(module_type: type[nn.Module]) -> None:
    """Trust every instance of ``module_type`` as per-sample (a leaf, never traced into).

    Use it for your own layers that you know treat samples independently; the
    capture pass keeps them as single ``call_module`` nodes.
    """
    register_batch_rule(module_type, per_sample)
    TRUSTED_MODULES.add(module_type)


TRUSTED_MODULES: set[type[nn.Module]] = set()


def _register(ops: Iterable[Any], rule: Rule) -> None:
    for op in ops:
        BATCH_RULES[rule_key(op)] = rule


def lookup_rule(node: fx.Node, module: nn.Module | None) -> Rule | None:
    if node.op == "call_module":
        for cls in type(module).__mro__:
            if cls in BATCH_RULES:
                return BATCH_RULES[cls]
        return None
    return BATCH_RULES.get(rule_key(node.target))


# ---------------------------------------------------------------------------
# Rule families
# ---------------------------------------------------------------------------

def free(ctx: RuleContext) -> Fact:
    """Creation ops (``torch.zeros(3)``): batch-free unless shaped by the batch."""
    return _join(ctx.arg_facts(), ctx)


def pointwise(ctx: RuleContext) -> Fact:
    """Elementwise / broadcasting op: samples stay independent."""
    facts = ctx.arg_facts()
    if any(isinstance(f, Reduced) for f in facts) and not any(
            isinstance(f, (Batched, BatchSize)) for f in facts):
        ctx.mix("it applies a non-linear function to a reduction over the batch (such as "
                "loss.sqrt()); reductions are combined across microbatches linearly",
                "apply non-linear functions per sample before reducing, or compile with "
                "mbs='none'")
    return _join(facts, ctx)


def linear(ctx: RuleContext) -> Fact:
    """Ops linear in each argument: a reduction may be scaled by batch-free values."""
    return _join(ctx.arg_facts(), ctx)


def _linear_arith(op: str) -> Rule:
    """+, -: linear in both. *: linear if one side is batch-free. /: if the divisor is."""

    def rule(ctx: RuleContext) -> Fact:
        a, b = ctx.fact(ctx.arg(0)), ctx.fact(ctx.arg(1))
        reduced = [f for f in (a, b) if isinstance(f, Reduced)]
        if not reduced or op in ("add", "sub"):
            return _join((a, b), ctx)
        if isinstance(a, Reduced) and isinstance(b, Reduced):
            if op == "div" and b.count:
                return Reduced(count=a.count)  # sum / count: a mean, exact on totals
            ctx.mix("it multiplies or divides two reductions over the batch, which is not "
                    "linear in the samples",
                    "divide only by counts computed from the inputs (mask.sum()), or "
                    "compile with mbs='none'")
        if op == "div" and isinstance(b, Reduced):
            ctx.mix("it divides by a reduction over the batch that depends on parameters",
                    "divide by counts computed from the inputs only")
        other = b if isinstance(a, Reduced) else a
        if isinstance(other, BatchSize) and op in ("div", "mul"):
            return Reduced(count=a.count if isinstance(a, Reduced) else False)  # sum / B
        return _join((a, b), ctx)

    return rule


def per_sample(ctx: RuleContext) -> Fact:
    """The op never mixes samples (its batch dim is found from the output's shape)."""
    facts = ctx.arg_facts()
    if any(isinstance(f, Reduced) for f in facts):
        return pointwise(ctx)
    return _join(facts, ctx)


def _check_batch_not_in(ctx: RuleContext, value: Any, dims: Sequence[int], what: str,
                        fix: str = "") -> None:
    fact = ctx.fact(value)
    if not isinstance(fact, Batched):
        return
    info = ctx.info(value)
    ndim = info.ndim if isinstance(info, ValueInfo) else 0
    if fact.dim in {d % ndim for d in dims} if ndim else False:
        ctx.mix(f"it {what} along dim {fact.dim}, which is the batch dim",
                fix or f"make it {what} along a non-batch dim, or compile with mbs='none'")


def along(get_dims: Callable[[RuleContext], Sequence[int]], what: str, fix: str = "",
          input_index: int = 0, input_name: str = "input") -> Rule:
    """The op couples elements along some dims of its input: fine unless the batch dim."""

    def rule(ctx: RuleContext) -> Fact:
        _check_batch_not_in(ctx, ctx.arg(input_index, input_name), get_dims(ctx), what, fix)
        return per_sample(ctx)

    return rule


def _dim_arg(index: int = 1, name: str = "dim", default: Any = None) -> Callable[[RuleContext], list[int]]:
    def get(ctx: RuleContext) -> list[int]:
        d = ctx.arg(index, name, default)
        if d is None:
            info = ctx.info(ctx.arg(0, "input"))
            return list(range(info.ndim)) if isinstance(info, ValueInfo) else []
        return list(d) if isinstance(d, (tuple, list)) else [d]

    return get


def _last(k: int) -> Callable[[RuleContext], list[int]]:
    return lambda ctx: list(range(-k, 0))


def _from(start: int) -> Callable[[RuleContext], list[int]]:
    """Every dim from ``start`` on: conv, pooling and GroupNorm need the batch at dim 0."""

    def get(ctx: RuleContext) -> list[int]:
        info = ctx.info(ctx.arg(0, "input"))
        return list(range(start, info.ndim)) if isinstance(info, ValueInfo) else []

    return get


def reduction(kind: str, partial: Callable[..., Any] | None, other: str = "",
              index: int = 0, name: str = "input") -> Rule:
    """Sum/mean-style reductions: over the batch dim they become a ``ReductionSpec``.

    ``other`` names a non-linear reduction (max, var, ...) that is rejected over the
    batch dim.
    """

    def rule(ctx: RuleContext) -> Fact:
        x = ctx.arg(index, name)
        fact = ctx.fact(x)
        dims = _dim_arg(1, "dim")(ctx)
        if isinstance(fact, Reduced):
            if other:
                ctx.mix(f"it takes the {other} of a reduction over the batch, which is not "
                        "linear in the samples", "reduce per sample first")
            return fact  # summing / averaging the remaining dims is linear
        if not isinstance(fact, Batched):
            return _join(ctx.arg_facts(), ctx)
        ndim = ctx.info(x).ndim
        if fact.dim not in {d % ndim for d in dims}:
            return per_sample(ctx)
        if other:
            ctx.mix(f"it takes the {other} over the batch dim, which couples samples "
                    "non-linearly",
                    "take it over non-batch dims, or compile with mbs='none'")
        ctx.node.meta[REDUCTION] = ReductionSpec(kind, partial)
        return Reduced(count=not ctx.node.meta.get("mbcompile.params", True))

    return rule


def loss(fn: Callable[..., Any], partial: Callable[..., Any], batch_at_zero: bool) -> Rule:
    """Loss functions: per-sample with reduction='none', else a reduction over the batch."""

    def rule(ctx: RuleContext) -> Fact:
        if ctx.module is not None:
            reduction_mode = ctx.module.reduction
        else:
            reduction_mode = partials.loss_reduction(fn, ctx._args, ctx._kwargs)
        facts = ctx.arg_facts()
        if any(isinstance(f, Reduced) for f in facts):
            return pointwise(ctx)
        batched = [f for f in facts if isinstance(f, Batched)]
        if not batched:
            return _join(facts, ctx)
        if batch_at_zero and any(f.dim != 0 for f in batched):
            ctx.mix("its batch dim is not dim 0 (the N of (N, C, ...)), so the loss "
                    "would treat samples as classes",
                    "move the batch dim to dim 0 (x.transpose / movedim) before the loss")
        if reduction_mode == "none":
            return ctx.batched_out()
        if reduction_mode == "sum":
            ctx.node.meta[REDUCTION] = ReductionSpec("sum", None)
        else:
            ctx.node.meta[REDUCTION] = ReductionSpec(
                "mean", partials.module_loss_partial if ctx.module is not None else partial)
        return Reduced()

    return rule


def reshape_rule(ctx: RuleContext) -> Fact:
    """view/reshape/flatten: the batch dim must stay a batch-major (or B-innermost) block."""
    x = ctx.arg(0, "input")
    fact = ctx.fact(x)
    if not isinstance(fact, Batched):
        return per_sample(ctx)
    info_in, info_out = ctx.info(x), ctx.info()
    out = ctx.batched_out(major=True)
    for batch, shape_in, shape_out in ((ctx.gbs, info_in.shape_a, info_out.shape_a),
                                       (ctx.gbs + 1, info_in.shape_b, info_out.shape_b)):
        outer_in = math.prod(shape_in[:fact.dim]) * (1 if fact.major else fact.factor)
        outer_out = math.prod(shape_out[:out.dim])
        if outer_out == outer_in:
            major = True
        elif outer_out * out.factor == outer_in:
            major = False
        else:
            ctx.mix(f"it reshapes {tuple(info_in.shape_a)} to {tuple(info_out.shape_a)} at "
                    f"batch {ctx.gbs}, mixing rows of different samples (or baking in the "
                    "batch size)",
                    "keep the batch dim leading, e.g. x.view(x.size(0), -1), and use -1 or "
                    "x.size(0) instead of a constant batch size")
    return Batched(out.dim, out.factor, major or out.factor == 1)


def getitem_rule(ctx: RuleContext) -> Fact:
    """``x[i]`` on tuples picks a fact; on tensors the batch dim must stay whole."""
    container, index = ctx.arg(0), ctx.arg(1)
    fact = ctx.fact(container)
    if isinstance(fact, Container):
        return fact.get(index)
    info_in = ctx.info(container)
    if isinstance(info_in, tuple):  # a tuple-valued op (chunk, split, ...): same fact
        return fact
    if isinstance(info_in, ValueInfo) and not info_in.is_tensor:
        return _int_fact(ctx)  # x.shape[0], size()[1]
    return per_sample(ctx)


def matmul_rule(ctx: RuleContext) -> Fact:
    """a @ b: fine while the batch dim is a batch (not a contracted) dim of each side."""
    a, b = ctx.arg(0), ctx.arg(1)
    _check_batch_not_in(ctx, a, [-1], "contracts")
    info_b = ctx.info(b)
    if isinstance(info_b, ValueInfo) and info_b.ndim >= 2:
        _check_batch_not_in(ctx, b, [-2], "contracts")
    return per_sample(ctx)


def chunk_rule(ctx: RuleContext) -> Fact:
    """split/chunk/unbind along a non-batch dim: every piece keeps the batch dim."""
    x = ctx.arg(0)
    fact = ctx.fact(x)
    dim = ctx.arg(2, "dim", 0)
    if node_name(ctx.node) == "unbind":
        dim = ctx.arg(1, "dim", 0)
    _check_batch_not_in(ctx, x, [dim], "splits")
    info = ctx.info()
    if not isinstance(fact, Batched):
        return _join(ctx.arg_facts(), ctx)
    pieces = []
    for i, piece in enumerate(info):
        d = piece.batch_dims
        if len(d) != 1:
            ctx.mix("a piece loses the batch dim")
        pieces.append((i, Batched(d[0], fact.factor, fact.major)))
    return Container(tuple(pieces))


def cat_rule(ctx: RuleContext) -> Fact:
    """cat/stack: per-sample tensors joined along a non-batch dim."""
    tensors = ctx.arg(0, "tensors")
    dim = ctx.arg(1, "dim", 0)
    facts = [ctx.fact(t) for t in tensors]
    if any(isinstance(f, Batched) for f in facts):
        if any(isinstance(f, Free) for f in facts) and node_name(ctx.node) == "cat":
            pass  # a batch-free piece along a feature dim is fine; the shapes check the rest
        for t in tensors:
            if node_name(ctx.node) == "cat":
                _check_batch_not_in(ctx, t, [dim], "concatenates")
    return per_sample(ctx)


def node_name(node: fx.Node) -> str:
    t = node.target
    return t if isinstance(t, str) else getattr(t, "__name__", str(t))


def multihead_attention_rule(ctx: RuleContext) -> Fact:
    """nn.MultiheadAttention: per-sample along its batch dim (0 if batch_first else 1)."""
    mod = ctx.module
    want = 0 if getattr(mod, "batch_first", False) else 1
    for f in ctx.arg_facts():
        if isinstance(f, Batched) and f.dim != want:
            ctx.mix(f"its batch dim is {want} (batch_first={mod.batch_first}) but the input's "
                    f"batch dim is {f.dim}", "pass inputs with the batch dim where the layer "
                    "expects it")
    info = ctx.info()
    items = []
    for i, piece in enumerate(info):
        if piece is None:
            items.append((i, Free()))
        else:
            d = piece.batch_dims
            items.append((i, Batched(d[0]) if len(d) == 1 else Free()))
    return Container(tuple(items))


def rnn_rule(ctx: RuleContext) -> Fact:
    """RNN/LSTM/GRU: per sample along dim 0 (batch_first) or 1; states carry dim 1."""
    mod = ctx.module
    want = 0 if mod.batch_first else 1
    x = ctx.fact(ctx.arg(0, "input"))
    if isinstance(x, Batched) and x.dim != want:
        ctx.mix(f"its batch dim is {want} (batch_first={mod.batch_first}) but the input's "
                f"batch dim is {x.dim}", "pass inputs with the batch dim where the layer "
                "expects it")
    out_info, state_info = ctx.info()
    states = state_info if isinstance(state_info, tuple) else (state_info,)
    state_facts = tuple((i, Batched(1)) for i in range(len(states)))
    state = Container(state_facts) if isinstance(state_info, tuple) else Batched(1)
    return Container(((0, Batched(want)), (1, state)))


def batch_norm_rule(ctx: RuleContext) -> Fact:
    """BatchNorm: eval mode uses running statistics (per-sample); training mixes."""
    mod = ctx.module
    if mod is not None:
        uses_batch_stats = mod.training or not mod.track_running_stats
    else:
        uses_batch_stats = bool(ctx.arg(5, "training", False)) or ctx.arg(1, "running_mean") is None
    if uses_batch_stats and any(isinstance(f, Batched) for f in ctx.arg_facts()):
        ctx.mix("BatchNorm in training mode normalises each channel with the mean and variance "
                "of the whole batch, so every sample's output depends on every other sample",
                "replace it with GroupNorm or LayerNorm, put it in eval mode (model.eval() "
                "or module.eval() to use running statistics), or compile with mbs='none'")
    return along(_from(1), "normalises", "put the batch first: (N, C, ...)")(ctx)


def instance_norm_rule(ctx: RuleContext) -> Fact:
    """InstanceNorm: per sample, but updating running stats in training averages samples."""
    mod = ctx.module
    if mod is not None and mod.training and mod.track_running_stats:
        ctx.mix("InstanceNorm with track_running_stats updates running statistics averaged "
                "over the batch", "set track_running_stats=False, use eval mode, or "
                "mbs='none'")
    return along(lambda c: [0], "normalises")(ctx)


def sdpa_rule(ctx: RuleContext) -> Fact:
    """scaled_dot_product_attention: (..., L, E) inputs; the batch must be a leading dim."""
    for i, name in enumerate(("query", "key", "value")):
        _check_batch_not_in(ctx, ctx.arg(i, name), [-1, -2], "attends")
    return per_sample(ctx)


def size_rule(ctx: RuleContext) -> Fact:
    """x.size(d) / x.shape: ints (or tuples) that may be multiples of the batch size."""
    info = ctx.info()
    if isinstance(info, tuple):
        return Container(tuple((i, _int_of(v, ctx)) for i, v in enumerate(info)))
    return _int_fact(ctx)


def _int_of(info: Any, ctx: RuleContext) -> Fact:
    if not isinstance(info, ValueInfo) or info.int_a == info.int_b:
        return Free()
    factor = _factor(info.int_a, info.int_b, ctx.gbs)
    return BatchSize(factor) if factor else Free()


def arange_rule(ctx: RuleContext) -> Fact:
    """torch.arange(B): the index of each sample within its (micro)batch."""
    facts = ctx.arg_facts()
    if any(isinstance(f, BatchSize) for f in facts):
        return ctx.batched_out(major=True)
    return _join(facts, ctx)


def size_like_rule(ctx: RuleContext) -> Fact:
    """zeros(B, ...)/x.new_zeros(B, ...)/ones_like(x): shaped by the batch, values free."""
    return _join(ctx.arg_facts(), ctx)


# ---------------------------------------------------------------------------
# The table, one family per block, one line per op or group
# ---------------------------------------------------------------------------

FAMILIES: dict[str, Rule] = {"per_sample": per_sample, "pointwise": pointwise, "free": free}

_UNARY = [  # elementwise unary: batch dim unchanged
    "relu", "relu_", "gelu", "silu", "sigmoid", "tanh", "exp", "log", "log1p", "expm1", "sqrt",
    "rsqrt", "abs", "sin", "cos", "pow", "square", "reciprocal", "sign", "floor", "ceil", "round",
    "clamp", "clamp_min", "clamp_max", "clip", "erf", "logical_not", "bitwise_not", "isnan",
    "isinf", "isfinite", "nan_to_num", "sigmoid_", "tanh_", "exp_", "trunc", "frac", "lerp",
    "maximum", "minimum", "fmod", "remainder", "eq", "ne", "lt", "le", "gt", "ge",
    "logical_and", "logical_or", "bitwise_and", "bitwise_or", "where", "masked_fill",
    "masked_fill_", "float", "double", "half", "bfloat16", "long", "int", "bool", "to", "type",
    "type_as", "contiguous", "detach", "clone", "requires_grad_", "cpu", "cuda",
]
_LINEAR_METHODS = ["neg", "__neg__", "float", "double", "half", "bfloat16", "to", "type",
                   "type_as", "contiguous", "detach", "clone", "squeeze", "unsqueeze", "view",
                   "reshape", "flatten", "permute", "transpose", "t", "expand", "expand_as",
                   "unflatten", "movedim", "view_as", "reshape_as"]

# Elementwise unary / comparison / casts on tensors: batch dim unchanged (x -> f(x)).
_register((getattr(torch, n) for n in _UNARY if hasattr(torch, n)), pointwise)
_register(_UNARY, pointwise)  # the same as Tensor methods
_register([F.relu, F.gelu, F.silu, F.mish, F.elu, F.selu, F.leaky_relu, F.hardtanh, F.relu6,
           F.softplus, F.softsign, F.tanhshrink, F.hardswish, F.hardsigmoid, F.logsigmoid,
           F.sigmoid, F.tanh, F.glu, F.dropout, F.dropout1d, F.dropout2d, F.alpha_dropout,
           F.one_hot], pointwise)  # activations, dropout (RNG: the documented exception)
_register([nn.ReLU, nn.GELU, nn.SiLU, nn.Mish, nn.ELU, nn.SELU, nn.LeakyReLU, nn.Tanh,
           nn.Sigmoid, nn.Hardtanh, nn.ReLU6, nn.Softplus, nn.Hardswish, nn.Hardsigmoid,
           nn.GLU, nn.Identity, nn.Dropout, nn.Dropout1d, nn.Dropout2d, nn.AlphaDropout,
           nn.LogSigmoid, nn.PReLU], pointwise)  # activation modules: x -> f(x)
# Linear arithmetic: a reduction may be added to, or scaled by, batch-free values.
_register([operator.add, operator.iadd, torch.add, "add", "add_", "__add__", "__radd__"],
          _linear_arith("add"))  # a + b
_register([operator.sub, operator.isub, torch.sub, "sub", "sub_", "__sub__", "__rsub__",
           torch.rsub], _linear_arith("sub"))  # a - b
_register([operator.mul, operator.imul, torch.mul, "mul", "mul_", "__mul__", "__rmul__"],
          _linear_arith("mul"))  # a * b: linear if one side is batch-free
_register([operator.truediv, operator.itruediv, torch.div, torch.true_divide, "div", "div_",
           "__truediv__", "true_divide"], _linear_arith("div"))  # a / b: b batch-free or a count
_register([operator.neg, torch.neg] + _LINEAR_METHODS, linear)  # -x, casts, reshapes of any fact
_register([operator.floordiv, operator.mod, operator.pow, torch.pow, operator.eq, operator.ne,
           operator.lt, operator.le, operator.gt, operator.ge, operator.and_, operator.or_,
           operator.invert, operator.xor, "__and__", "__or__", "__invert__", "__eq__",
           "__ne__", "__lt__", "__gt__", "__le__", "__ge__", "__pow__", "__rpow__",
           "__floordiv__", "__mod__"], pointwise)  # non-linear elementwise: per sample
_register([torch.where, torch.masked_fill, torch.lerp, torch.clamp], pointwise)  # masking
# Shape ops: the batch dim moves, never merges with a neighbour's samples.
_register(["view", "reshape", "flatten", "unflatten", "view_as", "reshape_as"], reshape_rule)
_register([torch.reshape, torch.flatten, torch.unflatten, nn.Flatten, nn.Unflatten],
          reshape_rule)  # (B, T, C) -> (B*T, C) batch-major is fine
_register(["permute", "transpose", "t", "squeeze", "unsqueeze", "expand", "expand_as",
           "movedim", "repeat", "contiguous", "flip", "roll", "tril", "triu", "masked_select"],
          per_sample)  # dims move; shapes locate the batch dim
_register([torch.permute, torch.transpose, torch.squeeze, torch.unsqueeze, torch.movedim,
           torch.flip, torch.roll, torch.tril, torch.triu, torch.t], per_sample)  # same
_register([operator.getitem], getitem_rule)  # x[..., :k] keeps the batch; tuples pick
_register(["chunk", "split", "unbind", torch.chunk, torch.split, torch.unbind],
          chunk_rule)  # pieces along a non-batch dim
_register([torch.cat, torch.concat, torch.stack, torch.hstack], cat_rule)  # join features
_register(["size", "dim", "numel"], size_rule)  # ints: multiples of the batch size or free
_register([getattr], size_rule)  # x.shape, x.dtype
_register([torch.arange], arange_rule)  # arange(B): per-sample index within the batch
_register([torch.zeros, torch.ones, torch.full, torch.empty, torch.zeros_like,
           torch.ones_like, torch.full_like, torch.empty_like, torch.rand_like,
           torch.randn_like, "new_zeros", "new_ones", "new_full", "new_empty",
           "zero_", "fill_", torch.tensor, torch.eye, torch.triu_indices],
          size_like_rule)  # creation: shaped by the batch at most
# Contractions: the batch dim must not be contracted.
_register([operator.matmul, torch.matmul, torch.bmm, torch.mm, "matmul", "bmm", "mm",
           "__matmul__"], matmul_rule)  # (B, n, k) @ (k, m)
_register([nn.Linear, F.linear, nn.Bilinear], along(_last(1), "contracts features",
          "put the batch dim before the feature dim"))  # (B, ..., in) -> (B, ..., out)
_register([nn.Embedding, F.embedding], per_sample)  # (B, T) ids -> (B, T, D)
_register([nn.EmbeddingBag], along(_last(1), "pools a bag"))  # (B, L) -> (B, D)
_register([nn.Conv1d, nn.Conv2d, nn.Conv3d, nn.ConvTranspose1d, nn.ConvTranspose2d,
           nn.ConvTranspose3d, F.conv1d, F.conv2d, F.conv3d, nn.MaxPool1d, nn.MaxPool2d,
           nn.MaxPool3d, nn.AvgPool1d, nn.AvgPool2d, nn.AvgPool3d, nn.AdaptiveAvgPool1d,
           nn.AdaptiveAvgPool2d, nn.AdaptiveMaxPool1d, nn.AdaptiveMaxPool2d, F.max_pool1d,
           F.max_pool2d, F.avg_pool1d, F.avg_pool2d, F.adaptive_avg_pool1d,
           F.adaptive_avg_pool2d, F.interpolate, nn.Upsample, nn.PixelShuffle],
          along(_from(1), "convolves or pools",
                "put the batch first: (N, C, ...)"))  # (N, C, ...) per sample n
_register([F.pad], per_sample)  # pads trailing dims; the shapes check the batch dim
# Norms: per sample over feature dims; BatchNorm only in eval.
_register([nn.LayerNorm, nn.RMSNorm], lambda ctx: along(
    _last(len(ctx.module.normalized_shape)), "normalises")(ctx))  # over the last k dims
_register([F.layer_norm, F.rms_norm], lambda ctx: along(
    _last(len(ctx.arg(1, "normalized_shape"))), "normalises")(ctx))  # same, functional
_register([nn.GroupNorm, F.group_norm], along(_from(1), "normalises",
          "put the batch first: (N, C, ...)"))  # (N, C, ...) per sample
_register([nn.BatchNorm1d, nn.BatchNorm2d, nn.BatchNorm3d, nn.SyncBatchNorm, F.batch_norm],
          batch_norm_rule)  # eval: running stats (per sample); training: mixes
_register([nn.InstanceNorm1d, nn.InstanceNorm2d, nn.InstanceNorm3d], instance_norm_rule)
_register([F.normalize], along(_dim_arg(2, "dim", 1), "normalises"))  # x / ||x|| along dim
# Along-a-dim ops: fine unless the dim is the batch dim.
_register([torch.softmax, torch.log_softmax, F.softmax, F.log_softmax, "softmax",
           "log_softmax", torch.cumsum, "cumsum", torch.cumprod, "cumprod", torch.sort,
           "sort", torch.argsort, "argsort", torch.topk, "topk"],
          along(_dim_arg(1, "dim", -1), "normalises, sorts or accumulates"))  # along dim
_register([nn.Softmax, nn.LogSoftmax], lambda ctx: along(
    lambda c: [c.module.dim if c.module.dim is not None else -1], "normalises")(ctx))
_register([F.scaled_dot_product_attention], sdpa_rule)  # (B, H, L, E) per sample
_register([nn.MultiheadAttention], multihead_attention_rule)  # (B, L, E) or (L, B, E)
_register([nn.RNN, nn.LSTM, nn.GRU], rnn_rule)  # sequences per sample; states dim 1
_register([torch.einsum], per_sample)  # the shapes show whether the batch letter survives
# Reductions: sum/mean over the batch become partial sums; max/var over it mix.
_register([torch.sum, "sum", torch.nansum, "nansum"], reduction("sum", None))  # Σ over batch
_register([torch.mean, "mean"], reduction("mean", partials.mean_partial))  # (Σ, count)
for _name in ("amax", "amin", "max", "min", "logsumexp", "prod", "std", "var", "norm",
              "argmax", "argmin", "median", "all", "any", "count_nonzero"):
    _register([_name] + ([getattr(torch, _name)] if hasattr(torch, _name) else []),
              reduction("sum", None, other=_name))  # rejected over the batch dim
# Losses: reduction='none' per sample; 'sum' a sum; 'mean' a (sum, count) pair.
for _fn, _mod, _partial, _at_zero in (
    (F.cross_entropy, nn.CrossEntropyLoss, partials.cross_entropy_partial, True),
    (F.nll_loss, nn.NLLLoss, partials.nll_loss_partial, True),
    (F.mse_loss, nn.MSELoss, partials.mse_loss_partial, False),
    (F.l1_loss, nn.L1Loss, partials.l1_loss_partial, False),
    (F.smooth_l1_loss, nn.SmoothL1Loss, partials.smooth_l1_loss_partial, False),
    (F.huber_loss, nn.HuberLoss, partials.huber_loss_partial, False),
    (F.binary_cross_entropy, nn.BCELoss, partials.binary_cross_entropy_partial, False),
    (F.binary_cross_entropy_with_logits, nn.BCEWithLogitsLoss,
     partials.binary_cross_entropy_with_logits_partial, False),
    (F.kl_div, nn.KLDivLoss, partials.kl_div_partial, True),
):
    _register([_fn, _mod], loss(_fn, _partial, _at_zero))
