"""The shared registry of test models.

Every entry of ``MODELS`` is a ``Maker``: ``make(batch, seed=0)`` returns
``(model, inputs)`` in float64, where ``inputs`` is the tuple for
``model(*inputs)`` (batch dim 0 unless the entry says otherwise). The built-in
models of ``mbcompile.models`` are re-exported with small widths; the others are
test-only models that exercise one loss form or one output structure each.

``FIRST_LAYER[name](model)`` is the first module to see the batch, for hooks that
count the rows reaching it; ``WARNS_RETAINED`` lists the models that train
without a single scalar loss inside (several losses, or no loss at all), which
``compile`` runs with every microbatch's activations kept, with a warning.

The comparison helpers at the end (``rel_err``, ``max_rel_err_outputs``,
``grad_errors``, ``buffer_errors``, ``step_errors``, ``assert_close_errors``) are
the tests' one definition of "equal to eager". Assert on a dict of errors with
``assert_close_errors``, never with ``max(errors.values()) <= tol``: Python's ``max``
keeps or drops a NaN depending on where it sits.

Test files import this as ``models`` (pytest puts ``tests/`` on ``sys.path``).
"""

from __future__ import annotations

import contextlib
import copy
import dataclasses
import math
from collections.abc import Callable, Iterable, Iterator
from typing import Any, NamedTuple

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

from mbcompile.check import relative_error
from mbcompile.models import CNN, MLP, TinyGPT, make_cnn, make_mlp, make_tiny_gpt, token_batch

__all__ = [
    "TOL",
    "plan_free",
    "CNN",
    "FIRST_LAYER",
    "MLP",
    "MODELS",
    "WARNS_RETAINED",
    "BatchNormNet",
    "DataclassOutNet",
    "DictOutNet",
    "FlagNet",
    "Maker",
    "NamedTupleOutNet",
    "Out",
    "Pair",
    "PerSampleNet",
    "TensorOutNet",
    "TimeMajorNet",
    "TinyGPT",
    "UnbatchedInputNet",
    "assert_close_errors",
    "buffer_errors",
    "grad_errors",
    "grads_of",
    "make_cnn",
    "make_mlp",
    "make_tiny_gpt",
    "max_rel_err_outputs",
    "one_intra_op_thread",
    "rel_err",
    "step_errors",
    "tensor_leaves",
    "token_batch",
]

DTYPE = torch.float64
FEATURES, HIDDEN, CLASSES = 6, 16, 4

Maker = Callable[..., tuple[nn.Module, tuple[Any, ...]]]


#: compiled vs eager in float64: the largest difference, relative to the largest value
TOL = 1e-10



def plan_free(mbs: Any, **options: Any) -> dict[str, Any]:
    """``compile()`` options for a test that checks what a step computes, not its memory
    plan: an int (or ``"none"``) MBS is planned as asked with ``cost_model=False``, which
    skips the cost model's fake-tensor probes (most of a small model's compile time)."""
    asked = mbs == "none" or (isinstance(mbs, int) and not isinstance(mbs, bool))
    if asked and not {"system", "measure"} & set(options):
        options.setdefault("cost_model", False)
    return options

def tiered(values: Iterable[Any], fast: Iterable[str],
           name: Callable[[Any], str] = lambda v: getattr(v, "stem", str(v))) -> list[Any]:
    """``values`` as ``pytest.param``s, named by ``name``, those not named in ``fast`` in the
    slow tier (``pytest.mark.slow``): ``python -m pytest`` runs the fast tier,
    ``-m "not zoo"`` both (as ``.ci/run`` does)."""
    fast = set(fast)
    return [pytest.param(v, id=name(v), marks=() if name(v) in fast else pytest.mark.slow)
            for v in values]


def _gen(seed: int) -> torch.Generator:
    return torch.Generator().manual_seed(seed + 1)


def _features(batch: int, g: torch.Generator, features: int = FEATURES) -> torch.Tensor:
    return torch.randn(batch, features, generator=g, dtype=DTYPE)


def _classes(batch: int, g: torch.Generator) -> torch.Tensor:
    return torch.randint(0, CLASSES, (batch,), generator=g)


class _Trunk(nn.Module):
    """Linear -> tanh -> Linear: the shared body of the small test models."""

    def __init__(self, out: int = CLASSES) -> None:
        super().__init__()
        self.inp = nn.Linear(FEATURES, HIDDEN)
        self.out = nn.Linear(HIDDEN, out)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.out(torch.tanh(self.inp(x)))


# --------------------------------------------------------------------------- #
# Loss forms
# --------------------------------------------------------------------------- #


class SumLossNet(nn.Module):
    """Cross-entropy with reduction='sum' (a plain sum over the batch)."""

    def __init__(self) -> None:
        super().__init__()
        self.trunk = _Trunk()
        self.loss = nn.CrossEntropyLoss(reduction="sum")

    def forward(self, x: torch.Tensor, y: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        logits = self.trunk(x)
        return self.loss(logits, y), logits


class MeanOutputNet(nn.Module):
    """The loss is a mean over per-sample outputs: ``out.mean()``."""

    def __init__(self) -> None:
        super().__init__()
        self.trunk = _Trunk()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.sigmoid(self.trunk(x)).mean()


class MaskedMeanLM(nn.Module):
    """Token losses averaged by hand: ``(tok_loss * mask).sum() / mask.sum()``.

    ``mask`` picks how the mask is written, as users do: ``"bool"`` keeps the
    comparison, ``"double"`` casts with ``.double()``, ``"like"`` casts with
    ``.to(tok_loss.dtype)`` (the mask's values still come from the labels alone).
    """

    def __init__(self, mask: str = "bool", vocab: int = 32, width: int = 16) -> None:
        super().__init__()
        self.mask = mask
        self.emb = nn.Embedding(vocab, width)
        self.head = nn.Linear(width, vocab)

    def forward(self, ids: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        logits = self.head(torch.tanh(self.emb(ids)))
        tok_loss = F.cross_entropy(logits.flatten(0, 1), labels.flatten().clamp(min=0),
                                   reduction="none")
        mask = labels.flatten() != -100
        if self.mask == "double":
            mask = mask.double()
        elif self.mask == "like":
            mask = mask.to(tok_loss.dtype)
        return (tok_loss * mask).sum() / mask.sum()


class SizeNormalisedNet(nn.Module):
    """A sum divided by the batch size read off the input: ``sq.sum() / x.size(0)``."""

    def __init__(self) -> None:
        super().__init__()
        self.trunk = _Trunk(out=2)

    def forward(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        return (self.trunk(x) - y).pow(2).sum() / x.size(0)


class L2RegularisedNet(nn.Module):
    """A mean loss plus a batch-free penalty on the weights (computed once, after the loop)."""

    def __init__(self) -> None:
        super().__init__()
        self.trunk = _Trunk()

    def forward(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        penalty = self.trunk.inp.weight.pow(2).sum() + self.trunk.out.weight.pow(2).sum()
        return F.cross_entropy(self.trunk(x), y) + 0.01 * penalty


class TwoLossNet(nn.Module):
    """Two heads, two losses: ``ce + 0.1 * mse``."""

    def __init__(self) -> None:
        super().__init__()
        self.inp = nn.Linear(FEATURES, HIDDEN)
        self.cls = nn.Linear(HIDDEN, CLASSES)
        self.reg = nn.Linear(HIDDEN, 2)

    def forward(self, x: torch.Tensor, y: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
        h = torch.tanh(self.inp(x))
        return F.cross_entropy(self.cls(h), y) + 0.1 * F.mse_loss(self.reg(h), target)


class WeightedNLLNet(nn.Module):
    """nll_loss with class weights and an ignore_index: the mean is Σ w[y] l / Σ w[y]."""

    IGNORE = -1

    def __init__(self) -> None:
        super().__init__()
        self.trunk = _Trunk()
        self.register_buffer("class_weight",
                             torch.linspace(0.5, 2.0, CLASSES, dtype=DTYPE))

    def forward(self, x: torch.Tensor, y: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        logp = F.log_softmax(self.trunk(x), dim=-1)
        return F.nll_loss(logp, y, weight=self.class_weight, ignore_index=self.IGNORE), logp


class WeightedCENet(nn.Module):
    """nn.CrossEntropyLoss with class weights and label smoothing."""

    def __init__(self) -> None:
        super().__init__()
        self.trunk = _Trunk()
        self.loss = nn.CrossEntropyLoss(weight=torch.linspace(2.0, 0.5, CLASSES, dtype=DTYPE),
                                        label_smoothing=0.2)

    def forward(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        return self.loss(self.trunk(x), y)


class BCELogitsNet(nn.Module):
    """Multi-label BCEWithLogitsLoss with a pos_weight."""

    def __init__(self) -> None:
        super().__init__()
        self.trunk = _Trunk(out=3)
        self.loss = nn.BCEWithLogitsLoss(pos_weight=torch.tensor([1.0, 2.0, 0.5], dtype=DTYPE))

    def forward(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        return self.loss(self.trunk(x), y)


class SmoothL1Net(nn.Module):
    """Regression with F.smooth_l1_loss(beta=0.5)."""

    def __init__(self) -> None:
        super().__init__()
        self.trunk = _Trunk(out=2)

    def forward(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        return F.smooth_l1_loss(self.trunk(x), y, beta=0.5)


class KLDivNet(nn.Module):
    """Distillation-style nn.KLDivLoss(reduction='batchmean')."""

    def __init__(self) -> None:
        super().__init__()
        self.trunk = _Trunk()
        self.loss = nn.KLDivLoss(reduction="batchmean")

    def forward(self, x: torch.Tensor, teacher: torch.Tensor) -> torch.Tensor:
        return self.loss(F.log_softmax(self.trunk(x), dim=-1), teacher)


class PerSampleNet(nn.Module):
    """No loss inside: returns per-sample logits; training puts the loss outside."""

    def __init__(self) -> None:
        super().__init__()
        self.trunk = _Trunk()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.trunk(x)


class BatchNormNet(nn.Module):
    """Linear -> BatchNorm1d -> Linear: per-sample in eval only."""

    def __init__(self) -> None:
        super().__init__()
        self.inp = nn.Linear(FEATURES, HIDDEN)
        self.bn = nn.BatchNorm1d(HIDDEN)
        self.out = nn.Linear(HIDDEN, CLASSES)

    def forward(self, x: torch.Tensor, y: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        logits = self.out(torch.relu(self.bn(self.inp(x))))
        return F.cross_entropy(logits, y), logits


# --------------------------------------------------------------------------- #
# Output structures and argument forms
# --------------------------------------------------------------------------- #


class Pair(NamedTuple):
    loss: torch.Tensor
    logits: torch.Tensor


@dataclasses.dataclass
class Out:
    loss: torch.Tensor
    logits: torch.Tensor
    hidden: torch.Tensor


class TensorOutNet(nn.Module):
    """Returns the loss tensor alone."""

    def __init__(self) -> None:
        super().__init__()
        self.trunk = _Trunk()

    def forward(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        return F.cross_entropy(self.trunk(x), y)


class DictOutNet(nn.Module):
    """Returns ``{"loss": ..., "logits": ..., "probs": ...}``."""

    def __init__(self) -> None:
        super().__init__()
        self.trunk = _Trunk()

    def forward(self, x: torch.Tensor, y: torch.Tensor) -> dict[str, torch.Tensor]:
        logits = self.trunk(x)
        return {"loss": F.cross_entropy(logits, y), "logits": logits,
                "probs": logits.softmax(-1)}


class DataclassOutNet(nn.Module):
    """Returns a dataclass (the shape of a HuggingFace ``ModelOutput``)."""

    def __init__(self) -> None:
        super().__init__()
        self.inp = nn.Linear(FEATURES, HIDDEN)
        self.out = nn.Linear(HIDDEN, CLASSES)

    def forward(self, x: torch.Tensor, y: torch.Tensor) -> Out:
        hidden = torch.tanh(self.inp(x))
        logits = self.out(hidden)
        return Out(loss=F.cross_entropy(logits, y), logits=logits, hidden=hidden)


class NamedTupleOutNet(nn.Module):
    """Returns a NamedTuple ``Pair(loss, logits)``."""

    def __init__(self) -> None:
        super().__init__()
        self.trunk = _Trunk()

    def forward(self, x: torch.Tensor, y: torch.Tensor) -> Pair:
        logits = self.trunk(x)
        return Pair(F.cross_entropy(logits, y), logits)


class FlagNet(nn.Module):
    """Non-tensor arguments: ``double`` (a bool) and ``repeats`` (an int) shape the graph."""

    def __init__(self) -> None:
        super().__init__()
        self.trunk = _Trunk()

    def forward(self, x: torch.Tensor, y: torch.Tensor, double: bool = False,
                repeats: int = 1) -> tuple[torch.Tensor, torch.Tensor]:
        logits = self.trunk(x)
        for _ in range(repeats):
            logits = logits + torch.tanh(logits)
        if double:
            logits = 2 * logits
        return F.cross_entropy(logits, y), logits


class UnbatchedInputNet(nn.Module):
    """A second tensor input shared by all samples (``in_dims=(0, 0, None)``)."""

    def __init__(self) -> None:
        super().__init__()
        self.trunk = _Trunk()

    def forward(self, x: torch.Tensor, y: torch.Tensor, bias: torch.Tensor
                ) -> tuple[torch.Tensor, torch.Tensor]:
        logits = self.trunk(x) + bias
        return F.cross_entropy(logits, y), logits


class TanhPairNet(nn.Module):
    """Two 4-wide ``nn.Linear`` layers around a tanh, an MSE loss: layers to hang hooks on."""

    def __init__(self) -> None:
        super().__init__()
        self.a, self.b = nn.Linear(4, 4), nn.Linear(4, 4)

    def forward(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        return F.mse_loss(self.b(torch.tanh(self.a(x))), y)


class TimeMajorNet(nn.Module):
    """(T, B, F) inputs, batch dim 1 (``in_dims=1``): a per-step regression."""

    def __init__(self) -> None:
        super().__init__()
        self.inp = nn.Linear(FEATURES, HIDDEN)
        self.norm = nn.LayerNorm(HIDDEN)
        self.out = nn.Linear(HIDDEN, 2)

    def forward(self, x: torch.Tensor, y: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        pred = self.out(torch.tanh(self.norm(self.inp(x))))
        return F.mse_loss(pred, y), pred


# --------------------------------------------------------------------------- #
# Makers
# --------------------------------------------------------------------------- #


def _seeded(cls: type[nn.Module], seed: int) -> nn.Module:
    torch.manual_seed(seed)
    return cls().to(DTYPE)


def tiny_gpt(batch: int, seed: int = 0) -> tuple[nn.Module, tuple[Any, ...]]:
    """TinyGPT (width 16, seq 8) on right-padded token labels (-100)."""
    return make_tiny_gpt(batch, seed=seed, dtype=DTYPE, vocab=32, width=16, depth=2, heads=2,
                         seq=8)


def tanh_pair() -> tuple[nn.Module, tuple[torch.Tensor, torch.Tensor]]:
    """``TanhPairNet`` (seed 0) and a batch of 7 (generator seed 1), float64."""
    torch.manual_seed(0)
    g = torch.Generator().manual_seed(1)
    return TanhPairNet().double(), tuple(torch.randn(7, 4, generator=g, dtype=torch.float64)
                                         for _ in range(2))


def mlp(batch: int, seed: int = 0) -> tuple[nn.Module, tuple[Any, ...]]:
    return make_mlp(batch, seed=seed, dtype=DTYPE)


def cnn(batch: int, seed: int = 0) -> tuple[nn.Module, tuple[Any, ...]]:
    """CNN with GroupNorm and CrossEntropyLoss(label_smoothing=0.1)."""
    return make_cnn(batch, seed=seed, dtype=DTYPE)


def _classifier(cls: type[nn.Module]) -> Maker:
    def make(batch: int, seed: int = 0) -> tuple[nn.Module, tuple[Any, ...]]:
        g = _gen(seed)
        return _seeded(cls, seed), (_features(batch, g), _classes(batch, g))

    make.__name__ = cls.__name__
    return make


def weighted_nll(batch: int, seed: int = 0) -> tuple[nn.Module, tuple[Any, ...]]:
    g = _gen(seed)
    y = _classes(batch, g)
    y[torch.rand(batch, generator=g) < 0.3] = WeightedNLLNet.IGNORE
    y[0] = 1  # at least one counted target, whatever the seed
    return _seeded(WeightedNLLNet, seed), (_features(batch, g), y)


def bce_logits(batch: int, seed: int = 0) -> tuple[nn.Module, tuple[Any, ...]]:
    g = _gen(seed)
    return _seeded(BCELogitsNet, seed), (
        _features(batch, g), torch.rand(batch, 3, generator=g, dtype=DTYPE))


def smooth_l1(batch: int, seed: int = 0) -> tuple[nn.Module, tuple[Any, ...]]:
    g = _gen(seed)
    return _seeded(SmoothL1Net, seed), (
        _features(batch, g), 2 * torch.randn(batch, 2, generator=g, dtype=DTYPE))


def kl_div(batch: int, seed: int = 0) -> tuple[nn.Module, tuple[Any, ...]]:
    g = _gen(seed)
    teacher = torch.softmax(torch.randn(batch, CLASSES, generator=g, dtype=DTYPE), -1)
    return _seeded(KLDivNet, seed), (_features(batch, g), teacher)


def mean_output(batch: int, seed: int = 0) -> tuple[nn.Module, tuple[Any, ...]]:
    return _seeded(MeanOutputNet, seed), (_features(batch, _gen(seed)),)


def _masked_mean(mask: str) -> Maker:
    def make(batch: int, seed: int = 0) -> tuple[nn.Module, tuple[Any, ...]]:
        torch.manual_seed(seed)
        model = MaskedMeanLM(mask).to(DTYPE)
        return model, token_batch(batch, 8, 32, seed=seed + 1)

    return make


def two_losses(batch: int, seed: int = 0) -> tuple[nn.Module, tuple[Any, ...]]:
    g = _gen(seed)
    return _seeded(TwoLossNet, seed), (
        _features(batch, g), _classes(batch, g), torch.randn(batch, 2, generator=g, dtype=DTYPE))


def size_normalised(batch: int, seed: int = 0) -> tuple[nn.Module, tuple[Any, ...]]:
    g = _gen(seed)
    return _seeded(SizeNormalisedNet, seed), (
        _features(batch, g), torch.randn(batch, 2, generator=g, dtype=DTYPE))


def per_sample(batch: int, seed: int = 0) -> tuple[nn.Module, tuple[Any, ...]]:
    return _seeded(PerSampleNet, seed), (_features(batch, _gen(seed)),)


def time_major(batch: int, seed: int = 0, steps: int = 5) -> tuple[nn.Module, tuple[Any, ...]]:
    g = _gen(seed)
    return _seeded(TimeMajorNet, seed), (
        torch.randn(steps, batch, FEATURES, generator=g, dtype=DTYPE),
        torch.randn(steps, batch, 2, generator=g, dtype=DTYPE))


def unbatched_input(batch: int, seed: int = 0) -> tuple[nn.Module, tuple[Any, ...]]:
    g = _gen(seed)
    return _seeded(UnbatchedInputNet, seed), (
        _features(batch, g), _classes(batch, g),
        torch.randn(CLASSES, generator=g, dtype=DTYPE))


MODELS: dict[str, Maker] = {
    "tiny_gpt": tiny_gpt,
    "mlp": mlp,
    "cnn": cnn,
    "sum_loss": _classifier(SumLossNet),
    "mean_output": mean_output,
    "masked_mean_bool": _masked_mean("bool"),
    "masked_mean_double": _masked_mean("double"),
    "masked_mean_like": _masked_mean("like"),
    "two_losses": two_losses,
    "size_normalised": size_normalised,
    "l2_regularised": _classifier(L2RegularisedNet),
    "weighted_nll": weighted_nll,
    "weighted_ce": _classifier(WeightedCENet),
    "bce_logits": bce_logits,
    "smooth_l1": smooth_l1,
    "kl_div": kl_div,
    "per_sample": per_sample,
    "batch_norm": _classifier(BatchNormNet),
    "tensor_out": _classifier(TensorOutNet),
    "dict_out": _classifier(DictOutNet),
    "dataclass_out": _classifier(DataclassOutNet),
    "namedtuple_out": _classifier(NamedTupleOutNet),
    "flag": _classifier(FlagNet),
    "unbatched_input": unbatched_input,
    "time_major": time_major,
}

#: The first module each model feeds the batch into (for row-counting hooks).
FIRST_LAYER: dict[str, Callable[[Any], nn.Module]] = {
    "tiny_gpt": lambda m: m.tok,
    "mlp": lambda m: m.net[0],
    "cnn": lambda m: m.features[0],
    "sum_loss": lambda m: m.trunk.inp,
    "mean_output": lambda m: m.trunk.inp,
    "masked_mean_bool": lambda m: m.emb,
    "masked_mean_double": lambda m: m.emb,
    "masked_mean_like": lambda m: m.emb,
    "two_losses": lambda m: m.inp,
    "size_normalised": lambda m: m.trunk.inp,
    "l2_regularised": lambda m: m.trunk.inp,
    "weighted_nll": lambda m: m.trunk.inp,
    "weighted_ce": lambda m: m.trunk.inp,
    "bce_logits": lambda m: m.trunk.inp,
    "smooth_l1": lambda m: m.trunk.inp,
    "kl_div": lambda m: m.trunk.inp,
    "per_sample": lambda m: m.trunk.inp,
}

#: Models trained without one scalar loss inside: compile keeps all activations and warns.
WARNS_RETAINED = frozenset({"two_losses", "per_sample"})


# --------------------------------------------------------------------------- #
# Comparison helpers (the oracle is always eager PyTorch on the full batch)
# --------------------------------------------------------------------------- #


def tensor_leaves(value: Any, path: str = "out") -> list[tuple[str, torch.Tensor]]:
    """``(path, tensor)`` for every tensor in a nested output, in a fixed order."""
    if isinstance(value, torch.Tensor):
        return [(path, value)]
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        return [leaf for f in dataclasses.fields(value)
                for leaf in tensor_leaves(getattr(value, f.name), f"{path}.{f.name}")]
    if isinstance(value, dict):
        return [leaf for k, v in value.items() for leaf in tensor_leaves(v, f"{path}[{k!r}]")]
    if isinstance(value, (tuple, list)):
        return [leaf for i, v in enumerate(value) for leaf in tensor_leaves(v, f"{path}[{i}]")]
    return []


def rel_err(got: torch.Tensor, want: torch.Tensor, floor: float = 0.0) -> float:
    """Normwise relative error ``max|got - want| / max(max|want|, floor)`` (shapes and dtypes
    must match); any NaN or inf that ``want`` lacks is ``inf``, see ``relative_error``."""
    assert got.shape == want.shape, f"shape {tuple(got.shape)} != {tuple(want.shape)}"
    assert got.dtype == want.dtype, f"dtype {got.dtype} != {want.dtype}"
    return relative_error(got, want, floor)


def max_rel_err_outputs(got: Any, want: Any) -> dict[str, float]:
    """Relative error per output leaf; the two outputs must have the same structure."""
    a, b = tensor_leaves(got), tensor_leaves(want)
    assert [p for p, _ in a] == [p for p, _ in b], (
        f"output structure differs: {[p for p, _ in a]} vs {[p for p, _ in b]}")
    return {p: rel_err(x, y) for (p, x), (_, y) in zip(a, b)}


def grads_of(model: nn.Module) -> dict[str, torch.Tensor | None]:
    """A copy of every parameter's ``.grad`` by name."""
    return {n: None if p.grad is None else p.grad.detach().clone()
            for n, p in model.named_parameters()}


def keyword_steps(model: nn.Module, call: Callable[..., Any], batch: dict[str, Any]
                  ) -> tuple[Any, dict[str, Any], Any, dict[str, Any]]:
    """One training step of ``call(**batch)`` (compiled) and of ``model(**batch)`` (eager),
    each from zeroed gradients, backward on ``.loss``: (out, its grads, ref, ref's grads)."""
    model.zero_grad(set_to_none=True)
    out = call(**batch)
    out.loss.backward()
    got = grads_of(model)
    model.zero_grad(set_to_none=True)
    ref = model(**batch)
    ref.loss.backward()
    return out, got, ref, grads_of(model)


def grad_errors(got: dict[str, torch.Tensor | None], want: dict[str, torch.Tensor | None],
                floor: float = 0.0, scale: float = 0.0) -> dict[str, float]:
    """Relative error per parameter gradient; a gradient missing on one side only is ``inf``.

    ``floor`` is a fraction of the largest eager gradient below which no gradient's own
    scale falls: a bias that softmax or a normalisation cancels has a gradient that is
    zero up to rounding, where an elementwise relative error means nothing. ``scale`` is
    an absolute floor on every gradient's scale (for a step whose gradients all vanish).
    """
    assert got.keys() == want.keys(), f"parameters differ: {got.keys() ^ want.keys()}"
    largest = max((_finite_abs_max(w) for w in want.values() if w is not None), default=0.0)
    out = {}
    for name, w in want.items():
        g = got[name]
        if g is not None or w is not None:
            out[name] = (math.inf if g is None or w is None
                         else rel_err(g, w, max(floor * largest, scale)))
    return out


def buffer_errors(got: nn.Module, want: nn.Module, scale: float = 0.0) -> dict[str, float]:
    """Relative error per floating buffer (running statistics), each buffer's scale at least
    ``scale``; any other buffer (a counter) must be equal: error 0, else ``inf``."""
    names = [n for n, _ in want.named_buffers()]
    assert [n for n, _ in got.named_buffers()] == names, "buffers differ"
    return {f"buffer {n}": (rel_err(b, w, scale) if w.is_floating_point()
                            else 0.0 if torch.equal(b, w) else math.inf)
            for (n, b), (_, w) in zip(got.named_buffers(), want.named_buffers())}


def step_errors(model: nn.Module, call: Callable[..., Any], inputs: tuple[Any, ...] = (),
                kwargs: dict[str, Any] | None = None, floor: float = 0.0, seed: int = 0,
                loss: Callable[[Any], torch.Tensor] | None = None, scale: float = 0.0,
                after: list[torch.Tensor] | None = None) -> dict[str, float]:
    """One training step of ``call`` (a compiled module sharing ``model``'s parameters) against
    one eager full-batch step of a deep copy of ``model`` taken first: each from no gradients
    and from ``torch.manual_seed(seed)``, backward on ``loss(out)``, by default the first
    tensor output (the loss computed inside the model).

    The errors of every output leaf (an integer leaf must be equal: 0, else ``inf``), every
    gradient (``grad_errors`` with ``floor``) and every buffer (``buffer_errors``: the step's
    running statistics), each value's scale floored at ``scale`` (0: none; for values that
    cancel to rounding noise, such as the sum of a BatchNorm's outputs); assert on them with
    ``assert_close_errors``. ``after``, when given, gets torch's next draw after each run
    (the compiled one's, then eager's): a step that draws as eager's leaves them equal.
    """
    ref, kwargs = copy.deepcopy(model), kwargs or {}
    results = []
    for module, run in ((model, call), (ref, ref)):
        module.zero_grad(set_to_none=True)
        torch.manual_seed(seed)
        out = run(*inputs, **kwargs)
        if after is not None:
            after.append(torch.rand(()))
        leaves = tensor_leaves(out)
        assert leaves, "the step returned no tensor"
        (leaves[0][1] if loss is None else loss(out)).backward()
        results.append((leaves, grads_of(module)))
    (got, got_grads), (want, want_grads) = results
    assert [p for p, _ in got] == [p for p, _ in want], "output structure differs"
    errors = {p: (rel_err(g, w, scale) if w.is_floating_point()
                  else 0.0 if torch.equal(g, w) else math.inf)
              for (p, g), (_, w) in zip(got, want)}
    grads = grad_errors(got_grads, want_grads, floor, scale)
    assert grads, "no gradient reached a parameter"
    return {**errors, **{f"grad {n}": e for n, e in grads.items()},
            **buffer_errors(model, ref, scale)}


def _finite_abs_max(t: torch.Tensor) -> float:
    t = t.detach().double()
    t = t[t.isfinite()]
    return t.abs().max().item() if t.numel() else 0.0


def assert_close_errors(errors: dict[str, float], tol: float) -> None:
    """Every error is at most ``tol``; the message names each one that is not.

    NaN fails (``nan <= tol`` is false), wherever it sits in the dict; so does an empty
    dict, which would mean nothing was compared.
    """
    assert errors, "nothing was compared"
    bad = {name: err for name, err in errors.items() if not err <= tol}
    assert not bad, f"relative errors above {tol}: {bad}"


@contextlib.contextmanager
def one_intra_op_thread() -> Iterator[None]:
    """Run torch ops on one thread, then restore the setting.

    The test models are tiny: a second intra-op thread buys nothing, and on a busy
    2-core CI machine its spin-waiting made the microbatch loops (many small ops)
    up to 100x slower than eager. Test modules enter this in an autouse fixture.
    """
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        yield
    finally:
        torch.set_num_threads(before)


def allocator_peak(cm: Any, model: nn.Module, batch: tuple[Any, ...]) -> float:
    """Peak bytes of one Adam training step of ``cm`` as the allocator counts them: what
    is live before the step (parameters, batch, optimizer state) plus the step's peak."""
    from mbcompile.planning.measure import measure_peak_bytes

    opt = torch.optim.Adam(model.parameters(), foreach=False)

    def step() -> None:
        loss = cm(*batch)[0]
        loss.backward()
        opt.step()

    step()  # the optimizer state exists from now on, as in training
    opt.zero_grad(set_to_none=True)
    before = sum(t.nbytes for t in [*model.parameters(), *batch])
    before += sum(v.nbytes for s in opt.state.values() for v in s.values() if torch.is_tensor(v))
    return before + measure_peak_bytes(step)
