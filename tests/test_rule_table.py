"""The rule table: scoped registration, its shape as a table, and the loss declarations.

1. ``with scoped():`` undoes what is registered inside it (also on error, also nested),
   and a rule registered inside really changes what ``compile`` accepts, there only;
2. the table reads as a table: every ``TABLE.add`` is one line with one comment, every
   ``Loss`` one line;
3. every loss in ``partials.LOSSES`` yields its rule and its partials, and each partial's
   ``sum / count`` is the eager mean on random data (weights, ``ignore_index``, class
   probabilities, 'batchmean'), for the functional, the module and every ATen spelling.
"""

from __future__ import annotations

import ast
import inspect
import pickle
from collections.abc import Callable, Iterator
from typing import Any

import pytest
import torch
import torch.fx
import torch.nn as nn
import torch.nn.functional as F

import mbcompile
from mbcompile import UnsupportedOpError
from mbcompile.passes import partials
from mbcompile.passes.partials import LOSSES, Loss, LossKind
from mbcompile.passes.rules import (
    BATCH_RULES,
    FAMILIES,
    GROUPED_MATMULS,
    POSITION_PRESERVING,
    TABLE,
    TRUSTED_MODULES,
    loss_rule,
    register_batch_rule,
    registry,
    rule_key,
    scoped,
    trust_module,
)
from mbcompile.passes.rules.layout import reshape_rule

GBS = 8


@pytest.fixture(autouse=True, scope="module")
def _table_left_as_found() -> Iterator[None]:
    """This module's own check of what a suite-wide one would assert: no residue."""
    before = TABLE.snapshot()
    yield
    assert TABLE.changes_since(before) == []
    assert TABLE.snapshot() == before


# --------------------------------------------------------------------------- #
# 1. Scoped registration
# --------------------------------------------------------------------------- #


def row_gain(x: torch.Tensor) -> torch.Tensor:
    """A function fx keeps as one call: mbcompile has no rule for it."""
    return x * torch.linspace(1.0, 2.0, x.shape[-1], dtype=x.dtype)


torch.fx.wrap("row_gain")


class GainNet(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(4, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return row_gain(self.lin(x)).pow(2).mean()


class RowClip(nn.Module):
    """Python control flow on values: fx cannot trace into it until it is trusted."""

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        if bool((h.abs() > 100).any()):
            h = h.clamp(-100, 100)
        return h


class ClipNet(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(4, 4)
        self.clip = RowClip()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.clip(self.lin(x)).pow(2).mean()


def validate(model: nn.Module) -> Any:
    return mbcompile.compile(model, GBS, 2, 2, example_inputs=(torch.randn(GBS, 4),),
                             capture="fx", validate_only=True)


def test_scope_undoes_a_registration() -> None:
    before = TABLE.snapshot()
    with scoped() as table:
        assert table is TABLE
        register_batch_rule(row_gain, "per_sample")
        assert BATCH_RULES[row_gain] is FAMILIES["per_sample"]
        assert TABLE.changes_since(before) == [
            f"rule for {row_gain!r}: None -> {FAMILIES['per_sample']!r}"]
    assert rule_key(row_gain) not in BATCH_RULES
    assert TABLE.snapshot() == before


def test_scope_undoes_a_registration_when_the_block_raises() -> None:
    before = TABLE.snapshot()
    with pytest.raises(RuntimeError, match="inside the scope"):
        with scoped():
            register_batch_rule(row_gain, "pointwise")
            trust_module(RowClip)
            raise RuntimeError("inside the scope")
    assert row_gain not in BATCH_RULES and RowClip not in TRUSTED_MODULES
    assert TABLE.snapshot() == before


def test_nested_scopes_restore_their_own_state() -> None:
    builtin = BATCH_RULES[torch.relu]
    with scoped():
        register_batch_rule(row_gain, "per_sample")
        outer = TABLE.snapshot()
        with scoped():
            register_batch_rule(torch.relu, "per_sample")  # overrides a built-in rule
            register_batch_rule(row_gain, "linear")
            trust_module(RowClip)
            assert BATCH_RULES[torch.relu] is FAMILIES["per_sample"]
        assert TABLE.snapshot() == outer  # the inner scope is gone, the outer one stays
        assert BATCH_RULES[row_gain] is FAMILIES["per_sample"]
        assert BATCH_RULES[torch.relu] is builtin and RowClip not in TRUSTED_MODULES
    assert row_gain not in BATCH_RULES and BATCH_RULES[torch.relu] is builtin


def test_the_public_names_are_the_tables_own_containers() -> None:
    """Code that reads BATCH_RULES (or trusts modules through capture) sees the scope."""
    assert BATCH_RULES is TABLE.rules
    assert POSITION_PRESERVING is TABLE.position_preserving
    assert TRUSTED_MODULES is TABLE.trusted
    assert mbcompile.register_batch_rule is register_batch_rule
    assert mbcompile.trust_module is trust_module


def test_restore_and_changes_since() -> None:
    with scoped():
        before = TABLE.snapshot()
        BATCH_RULES.pop(torch.relu)
        trust_module(RowClip)
        changes = TABLE.changes_since(before)
        assert any("relu" in c and "-> None" in c for c in changes)
        assert f"trusted: {RowClip!r}" in changes
        TABLE.restore(before)
        assert TABLE.changes_since(before) == [] and TABLE.snapshot() == before


def test_a_scoped_rule_changes_what_compile_accepts_inside_the_scope_only() -> None:
    with pytest.raises(UnsupportedOpError, match="row_gain"):
        validate(GainNet())
    with scoped():
        register_batch_rule(row_gain, "per_sample")
        assert validate(GainNet()).two_phase is False  # validated as a plain split
    with pytest.raises(UnsupportedOpError, match="register_batch_rule"):
        validate(GainNet())


def test_a_scoped_trusted_module_is_a_leaf_inside_the_scope_only() -> None:
    with pytest.raises(mbcompile.MbcompileError):
        validate(ClipNet())
    with scoped():
        trust_module(RowClip)
        result = validate(ClipNet())
        assert "clip" in [n.target for n in result.graph_module.graph.nodes
                          if n.op == "call_module"]
    with pytest.raises(mbcompile.MbcompileError):
        validate(ClipNet())


# --------------------------------------------------------------------------- #
# 2. The table reads as a table
# --------------------------------------------------------------------------- #


def _calls(module: Any, name: str) -> list[tuple[ast.Call, str]]:
    """Module-level calls ``<name>(...)`` (or ``X.<name>(...)``) and their source lines."""
    source = inspect.getsource(module)
    lines = source.splitlines()
    out = []
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Call) and (
                (isinstance(node.func, ast.Attribute) and node.func.attr == name) or
                (isinstance(node.func, ast.Name) and node.func.id == name)):
            out.append((node, lines[node.lineno - 1]))
    return out


def test_every_table_entry_is_one_line_with_a_comment() -> None:
    entries = [(c, line) for name in ("add", "layer") for c, line in _calls(registry, name)
               if isinstance(c.func, ast.Attribute) and isinstance(c.func.value, ast.Name)
               and c.func.value.id == "TABLE"]
    assert len(entries) > 50
    for call, line in entries:
        assert call.lineno == call.end_lineno, f"spans lines: {line}"
        assert "  # " in line[call.end_col_offset:], f"no comment: {line}"


def test_every_loss_is_declared_on_one_line() -> None:
    declarations = [(c, line) for c, line in _calls(partials, "Loss")]
    assert len(declarations) == len(LOSSES)
    for call, line in declarations:
        assert call.lineno == call.end_lineno, f"spans lines: {line}"


def test_a_token_dispatch_line_wraps_the_rule_above_it() -> None:
    """The token-dispatch section adds a meaning to an op's own line (one lookup, no second
    table): outside a dispatch, the rule it wraps decides."""
    view = BATCH_RULES["view"]
    assert view.wrapped is reshape_rule
    assert view.handles_tokens and view.handles_positions
    assert BATCH_RULES[torch.sort].wrapped is not None
    with scoped():  # a rule registered for such an op replaces the wrapped rule only
        register_batch_rule("view", "per_sample")
        assert BATCH_RULES["view"].wrapped is FAMILIES["per_sample"]
        assert BATCH_RULES["view"].handles_tokens


def test_grouped_matmuls_are_table_lines_found_by_their_qualified_name() -> None:
    places = ((0, "self"), (1, "mat2"), (2, "offs"))
    assert GROUPED_MATMULS["aten::_grouped_mm"] == GROUPED_MATMULS["torch._grouped_mm"] == places
    graph = torch.fx.Graph()
    x = graph.placeholder("x")
    for target in (torch.ops.aten._grouped_mm.default, torch._grouped_mm):
        node = graph.call_function(target, (x, x, x))
        assert TABLE.lookup(node, None) is BATCH_RULES["aten::_grouped_mm"]
    with pytest.raises(KeyError):
        GROUPED_MATMULS["view"]  # a line of the table, but no grouped matmul's
    with scoped():
        mine = ((1, "x"), (0, "w"), (2, "offs"))
        GROUPED_MATMULS["mylib::grouped_mm"] = mine
        rule = BATCH_RULES["mylib::grouped_mm"]
        GROUPED_MATMULS["mylib::grouped_mm"] = mine  # declared again: the same entry
        assert BATCH_RULES["mylib::grouped_mm"] is rule and rule.grouped_matmul == mine
        assert dict(GROUPED_MATMULS)["mylib::grouped_mm"] == mine
        del GROUPED_MATMULS["mylib::grouped_mm"]
        assert "mylib::grouped_mm" not in BATCH_RULES


def test_table_entries_are_rules() -> None:
    assert all(callable(rule) for rule in BATCH_RULES.values())
    assert POSITION_PRESERVING <= set(BATCH_RULES)
    assert set(FAMILIES) == {"per_sample", "pointwise", "linear", "free"}


# --------------------------------------------------------------------------- #
# 3. Losses: one declaration, a rule and partials that add up to the eager mean
# --------------------------------------------------------------------------- #


def _classes(n: int = GBS, c: int = 5, extra: tuple[int, ...] = ()) -> dict[str, Any]:
    g = torch.Generator().manual_seed(1)
    target = torch.randint(0, c, (n, *extra), generator=g)
    target[::3] = -1  # ignored
    return {"inputs": (torch.randn(n, c, *extra, dtype=torch.float64, generator=g), target),
            "options": {"ignore_index": -1, "weight": torch.rand(c, dtype=torch.float64,
                                                                 generator=g) + 0.5}}


def _pair(n: int = GBS, d: int = 3, lo: float = 0.0) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(2)
    x = torch.rand(n, d, dtype=torch.float64, generator=g) * 0.9 + 0.05 + lo
    y = torch.rand(n, d, dtype=torch.float64, generator=g) * 0.9 + 0.05
    return x, y


def _signs(*shape: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(3)
    return torch.randint(0, 2, shape, generator=g).to(torch.float64) * 2 - 1


def _vectors(k: int, n: int = GBS, d: int = 4) -> tuple[torch.Tensor, ...]:
    g = torch.Generator().manual_seed(4)
    return tuple(torch.randn(n, d, dtype=torch.float64, generator=g) for _ in range(k))


def _multilabel_targets(n: int = GBS, c: int = 5) -> torch.Tensor:
    t = torch.full((n, c), -1)
    for i in range(n):
        t[i, : 1 + i % 3] = torch.tensor([(i + j) % c for j in range(1 + i % 3)])
    return t


def _log_probs(n: int = GBS, c: int = 5) -> tuple[torch.Tensor, torch.Tensor]:
    x, y = _pair(n, c)
    return x.log_softmax(-1), y.softmax(-1)


def _ctc() -> tuple[torch.Tensor, ...]:
    """(T, N, C) log-probs, padded (N, S) targets, lengths (one target of length 0)."""
    g = torch.Generator().manual_seed(5)
    log_probs = torch.randn(6, GBS, 5, dtype=torch.float64, generator=g).log_softmax(-1)
    targets = torch.randint(1, 5, (GBS, 3), generator=g)
    lengths = torch.randint(0, 4, (GBS,), generator=g)
    return log_probs, targets, torch.randint(4, 7, (GBS,), generator=g), lengths


#: Sample calls per loss: positional inputs (what the module is called with) and options
#: (keyword arguments of the functional that are the module's settings too).
CASES: dict[Callable[..., Any], list[dict[str, Any]]] = {
    F.cross_entropy: [_classes(), _classes(extra=(3,)),
                      {"inputs": (_pair(d=5)[0], _pair(d=5)[1].softmax(-1)),
                       "options": {"label_smoothing": 0.1}}],
    F.nll_loss: [_classes(), _classes(extra=(2, 3))],
    F.mse_loss: [{"inputs": _pair(), "options": {}}],
    F.l1_loss: [{"inputs": _pair(), "options": {}}],
    F.smooth_l1_loss: [{"inputs": _pair(), "options": {"beta": 0.3}}],
    F.huber_loss: [{"inputs": _pair(), "options": {"delta": 0.3}}],
    F.binary_cross_entropy: [{"inputs": _pair(), "options": {"weight": _pair()[1][0]}}],
    F.binary_cross_entropy_with_logits: [
        {"inputs": _pair(), "options": {"pos_weight": _pair()[1][1] + 0.5}}],
    F.kl_div: [{"inputs": _log_probs(), "options": {}},
               {"inputs": _log_probs(), "options": {"reduction": "batchmean"}}],
    F.soft_margin_loss: [{"inputs": (_pair()[0], _signs(GBS, 3)), "options": {}}],
    F.poisson_nll_loss: [{"inputs": _pair(), "options": {"full": True}}],
    F.gaussian_nll_loss: [{"inputs": (*_pair(), _pair(lo=0.5)[0]), "options": {"eps": 1e-4}}],
    F.margin_ranking_loss: [{"inputs": (*_vectors(2, d=1), _signs(GBS, 1)),
                             "options": {"margin": 0.2}}],
    F.hinge_embedding_loss: [{"inputs": (_pair()[0], _signs(GBS, 3)),
                              "options": {"margin": 0.7}}],
    F.cosine_embedding_loss: [{"inputs": (*_vectors(2), _signs(GBS)),
                               "options": {"margin": 0.1}}],
    F.triplet_margin_loss: [{"inputs": _vectors(3), "options": {"margin": 0.5, "swap": True}}],
    F.multi_margin_loss: [{"inputs": (_pair(d=5)[0], _classes()["inputs"][1].clamp(min=0)),
                           "options": {"margin": 0.5, "weight": _classes()["options"]["weight"]}}],
    F.multilabel_margin_loss: [{"inputs": (_pair(d=5)[0], _multilabel_targets()),
                                "options": {}}],
    F.multilabel_soft_margin_loss: [{"inputs": (_pair(d=5)[0], _pair(d=5)[1].round()),
                                     "options": {"weight": _pair(d=5)[1][0]}}],
    F.triplet_margin_with_distance_loss: [{"inputs": _vectors(3), "options": {"margin": 0.5}}],
    F.ctc_loss: [{"inputs": _ctc(), "options": {"blank": 0, "zero_infinity": True}}],
}

_CASE_IDS = [(loss, i) for loss in LOSSES for i in range(len(CASES.get(loss.fn, ())))]


def _mean(total: torch.Tensor, count: Any) -> torch.Tensor:
    return partials.mean_combine(total, count)


def test_every_loss_has_a_sample_call() -> None:
    assert {loss.fn for loss in LOSSES} == set(CASES)


def test_every_aten_spelling_has_a_sample_call() -> None:
    called = {packet for loss in LOSSES for packet in loss.aten for call in CASES[loss.fn]
              if _aten_call(loss, packet, call) is not None}
    assert called == {packet for loss in LOSSES for packet in loss.aten}


@pytest.mark.parametrize("loss", LOSSES, ids=lambda loss: loss.fn.__name__)
def test_a_declaration_yields_a_rule_and_partials(loss: Loss) -> None:
    assert loss.spellings[:2] == (loss.fn, loss.module) and loss.aten == loss.spellings[2:]
    for op in loss.spellings:
        assert BATCH_RULES[rule_key(op)] is loss_rule
        assert partials.loss_for(op) is loss
    assert partials.loss_for(type("Sub", (loss.module,), {})) is loss  # subclasses too
    named = [loss.partial, *loss.aten_partials.values()]
    assert set(loss.aten_partials) == set(loss.aten)
    for p in named:  # fx prints and pickles a graph's partial by its module and name
        assert getattr(partials, p.__name__) is p and p.__module__ == partials.__name__
        assert pickle.loads(pickle.dumps(p)) is p
    for setting in loss.settings:
        assert hasattr(loss.module(), setting)


def test_the_aten_spellings_are_the_ones_export_uses() -> None:
    aten = {loss.fn.__name__: [p.__name__ for p in loss.aten] for loss in LOSSES}
    assert aten["cross_entropy"] == ["cross_entropy_loss"]
    assert aten["nll_loss"] == ["nll_loss", "nll_loss_nd", "nll_loss2d"]
    assert aten["mse_loss"] == ["mse_loss"] and aten["gaussian_nll_loss"] == []
    assert {LossKind.CLASSES, LossKind.ROWS, LossKind.BATCHMEAN} == {
        k for k in LossKind if k.n_first}


@pytest.mark.filterwarnings("ignore:reduction. 'mean' divides the total loss")  # kl_div
@pytest.mark.parametrize("loss, case", _CASE_IDS,
                         ids=[f"{loss.fn.__name__}-{i}" for loss, i in _CASE_IDS])
def test_partial_of_the_functional_and_module_is_the_eager_mean(loss: Loss, case: int) -> None:
    call = CASES[loss.fn][case]
    inputs, options = call["inputs"], call["options"]
    want = loss.fn(*inputs, **options)
    torch.testing.assert_close(_mean(*loss.partial(*inputs, **options)), want)
    module = loss.module(**options)
    torch.testing.assert_close(module(*inputs), want)
    torch.testing.assert_close(_mean(*partials.module_loss_partial(module, *inputs)), want)


def _aten_call(loss: Loss, packet: Any, call: dict[str, Any]) -> dict[str, Any] | None:
    """The functional's call spelled for ``packet`` (reduction=1, 'mean'), or None when the
    sample's shapes do not fit it (nll_loss takes 1-2 dims, nll_loss2d 4)."""
    binding = inspect.signature(loss.fn).bind(*call["inputs"], **call["options"])
    binding.apply_defaults()
    bound = binding.arguments
    if bound.get("reduction", "mean") != "mean":
        return None
    if loss.kind is LossKind.CLASSES and bound["target"].is_floating_point():
        return None
    ndim = bound["input"].dim() if "input" in bound else 2
    if (packet.__name__ == "nll_loss" and ndim > 2) or (packet.__name__ == "nll_loss2d"
                                                          and ndim != 4):
        return None
    schema = packet.default._schema.arguments
    kwargs = {a.name: bound["input" if a.name == "self" else a.name] for a in schema
              if (a.name == "self" and "input" in bound) or a.name in bound}
    return {**kwargs, "reduction": 1}


@pytest.mark.parametrize("loss, case", _CASE_IDS,
                         ids=[f"{loss.fn.__name__}-{i}" for loss, i in _CASE_IDS])
def test_partial_of_each_aten_spelling_is_the_eager_mean(loss: Loss, case: int) -> None:
    for packet, partial in loss.aten_partials.items():
        kwargs = _aten_call(loss, packet, CASES[loss.fn][case])
        if kwargs is None:
            continue
        want = packet.default(**kwargs)
        torch.testing.assert_close(_mean(*partial(**kwargs)), want)
