"""Inputs of another kind than the example's dense strided tensors (found by a hunt:
.scratch/hunt-kinds, findings 1, 2, 3 and 6), exact or refused by name.

- A call with another dtype than the example's under torch.export ran the example's: a
  branch on ``x.dtype`` was held (loss 8.24 against eager's 483.50), and a cast that was a
  no-op for the example replaced every use of ``x`` (an output came back float64 where
  eager's is float32). Now such a call compiles a variant once, with a RecompileWarning;
  under torch.fx dtypes follow the call, as before, without one.
- A training step inside ``torch.autograd.forward_ad.dual_level()`` returned the loss and
  outputs without tangents. Now refused by name; a forward-only call keeps them, exact.
- A tensor subclass with its own ``__torch_function__`` ran as a plain tensor under
  export, and per microbatch slice under fx (both silently wrong for an override that
  is not per sample). Now refused by name, at compile and at a call.
- Nested (strided and jagged) and sparse (COO, CSR) inputs crashed inside torch or inside
  mbcompile ("please report"). Now refused by name with the fix.

Float64 where the case allows, gbs 7 over 2 systems at MBS 2 (systems of 4 and 3 samples),
against eager on a deep copy made before compile.
"""

from __future__ import annotations

import copy
import timeit
import warnings
from typing import Any

import pytest
import torch
import torch.autograd.forward_ad as fwAD
import torch.nn as nn
import torch.nn.functional as F
from models import TOL, plan_free, rel_err

import mbcompile
from mbcompile.inputs import InputDtypeError, Inputs, batch_size, check_layout, input_layout

GBS, SYSTEMS, MBS = 7, 2, 2
F64, F32 = torch.float64, torch.float32


def _data(n: int = GBS, seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return torch.randn(n, 5, generator=g, dtype=F64), torch.randn(n, 3, generator=g, dtype=F64)


def _compile(model: nn.Module, example: tuple[Any, ...], capture: str, **options: Any) -> Any:
    return mbcompile.compile(model, GBS, SYSTEMS, MBS, example_inputs=example,
                             **plan_free(MBS, capture=capture, **options))


def _state(model: nn.Module) -> list[Any]:
    """Parameters, their .grad (None kept) and buffers, copied."""
    return ([p.detach().clone() for p in model.parameters()]
            + [None if p.grad is None else p.grad.clone() for p in model.parameters()]
            + [b.clone() for b in model.buffers()])


def _unchanged(before: list[Any], model: nn.Module) -> bool:
    return all((a is None and b is None) or (a is not None and b is not None and torch.equal(a, b))
               for a, b in zip(before, _state(model), strict=True))


# ----------------------------------------------------------------- finding 1: dtypes
class DtypeBranch(nn.Module):
    """Reads the input's dtype in Python: torch.export holds the example's branch."""

    def __init__(self) -> None:
        super().__init__()
        self.w = nn.Parameter(torch.randn(5, 3, dtype=F64))

    def forward(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        if x.dtype == torch.float32:  # upscale low-precision inputs
            x = x * 10
        return F.mse_loss(x.to(torch.float64) @ self.w, y)


class NoOpCast(nn.Module):
    """``x.double()`` is a no-op for a float64 example: torch.export records an alias, and
    ``x * 2`` read the cast (float64) where eager's is of the call's dtype."""

    def __init__(self) -> None:
        super().__init__()
        self.a = nn.Linear(5, 3, dtype=F64)

    def forward(self, x: torch.Tensor, y: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        o = self.a(x.double())
        return F.mse_loss(o, y) + (x.double().sin() ** 2).mean(), x * 2


def _steps(cm: Any, eager: nn.Module, model: nn.Module, calls: list[tuple[Any, ...]]) -> None:
    """Train both with SGD (momentum) on ``calls``; outputs (values, dtypes), .grad and
    parameters equal eager's at every step."""
    opt_c = torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.9)
    opt_e = torch.optim.SGD(eager.parameters(), lr=0.01, momentum=0.9)
    for call in calls:
        got, want = cm(*call), eager(*call)
        got, want = (got, want) if isinstance(got, tuple) else ((got,), (want,))
        for g, w in zip(got, want, strict=True):
            assert g.dtype == w.dtype
            assert rel_err(g.detach(), w.detach()) <= TOL
        got[0].backward()
        want[0].backward()
        for p, q in zip(model.parameters(), eager.parameters(), strict=True):
            assert rel_err(p.grad, q.grad) <= TOL
        opt_c.step()
        opt_e.step()
        opt_c.zero_grad()
        opt_e.zero_grad()
        for p, q in zip(model.parameters(), eager.parameters(), strict=True):
            assert rel_err(p.detach(), q.detach()) <= TOL


@pytest.mark.parametrize("capture", ["export", "auto"])
def test_a_call_of_another_dtype_compiles_a_variant_where_export_held_the_branch(capture):
    torch.manual_seed(0)
    model = DtypeBranch()
    eager = copy.deepcopy(model)
    x, y = _data()
    cm = _compile(model, (x, y), capture)
    with pytest.warns(mbcompile.RecompileWarning, match=r"a call passes torch\.float32 for "
                      r"input 'x' where the example passed torch\.float64.*holds the "
                      r"example's dtypes.*compiled once"):
        _steps(cm, eager, model, [(x.float(), y)])
    with warnings.catch_warnings():  # compiled once: the same dtypes again, and the example's
        warnings.simplefilter("error")
        _steps(cm, eager, model, [(x.float(), y), (x, y), (_data(seed=1)[0].float(), y)])


@pytest.mark.parametrize("capture", ["export", "fx"])
def test_a_no_op_cast_of_the_example_does_not_replace_the_calls_input(capture):
    torch.manual_seed(0)
    model = NoOpCast()
    eager = copy.deepcopy(model)
    x, y = _data()
    cm = _compile(model, (x, y), capture)
    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        _steps(cm, eager, model, [(x.float(), y), (x, y)])
    recompiled = [w for w in seen if w.category is mbcompile.RecompileWarning]
    assert len(recompiled) == (1 if capture == "export" else 0)  # fx: dtype follows the call


def test_under_fx_another_dtype_runs_the_same_graph():
    torch.manual_seed(0)
    model = NoOpCast()
    eager = copy.deepcopy(model)
    x, y = _data()
    cm = _compile(model, (x, y), "fx")
    graph = cm.graph_module
    with warnings.catch_warnings():
        warnings.simplefilter("error", mbcompile.RecompileWarning)
        _steps(cm, eager, model, [(x.float(), y), (x.half(), y)])
    assert cm.graph_module is graph and not cm._variants


def test_another_dtype_and_another_batch_size_are_both_compiled_for():
    """A batch of 5 float32 samples: before, the batch-size variant reused the float64
    capture (its key held shapes only) and ran the float64 branch."""
    torch.manual_seed(0)
    model = DtypeBranch()
    eager = copy.deepcopy(model)
    x, y = _data()
    cm = _compile(model, (x, y), "export")
    x5, y5 = _data(5, seed=2)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        _steps(cm, eager, model, [(x5.float(), y5), (x5, y5), (x.float(), y)])


def test_integer_ids_of_another_width_compile_a_variant_under_export():
    torch.manual_seed(0)
    model = nn.Sequential(nn.Embedding(10, 5, dtype=F64), nn.Linear(5, 3, dtype=F64))
    eager = copy.deepcopy(model)

    class Wrap(nn.Module):
        def __init__(self, inner: nn.Module) -> None:
            super().__init__()
            self.inner = inner

        def forward(self, ids: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
            return F.mse_loss(self.inner(ids), y)

    ids = torch.randint(0, 10, (GBS,), generator=torch.Generator().manual_seed(3))
    y = _data()[1]
    wrapped, wrapped_eager = Wrap(model), Wrap(eager)
    cm = _compile(wrapped, (ids, y), "export")
    with pytest.warns(mbcompile.RecompileWarning, match="torch.int32 for input 'ids'"):
        _steps(cm, wrapped_eager, wrapped, [(ids.int(), y)])


def test_the_dtype_refusal_names_the_input_both_dtypes_and_the_fix():
    """What a call gets where no variant is made (on ranks): ``check_layout`` of a layout
    whose graph holds the dtypes; inside a dict, by its key."""
    x, y = _data()
    inputs = Inputs(("batch", "y"), (0, 0), {})
    layout = input_layout(inputs, [{"x": x}, y], fixed=True)
    with pytest.raises(InputDtypeError, match=r"input batch\['x'\] is torch\.float32 where the "
                       r"example passed torch\.float64.*torch\.export.*Fix: pass "
                       r"torch\.float64 \(\.to\(torch\.float64\)\), or compile with an "
                       "example call of these dtypes; nothing was run"):
        check_layout(inputs, [{"x": x.float()}, y], layout)
    assert check_layout(inputs, [{"x": x.float()}, y], layout, dtypes=False) == {}
    free = input_layout(inputs, [{"x": x}, y])  # torch.fx's graph: dtypes follow the call
    assert check_layout(inputs, [{"x": x.float()}, y.half()], free) == {}


# ---------------------------------------------------------- finding 2: forward-mode AD
class WithNorm(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.a, self.bn = nn.Linear(5, 3, dtype=F64), nn.BatchNorm1d(3, dtype=F64)

    def forward(self, x: torch.Tensor, y: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        o = self.bn(self.a(torch.tanh(x)))
        return F.mse_loss(o, y), o


class Tanh(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.a = nn.Linear(5, 3, dtype=F64)

    def forward(self, x: torch.Tensor, y: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        o = self.a(torch.tanh(x))
        return F.mse_loss(o, y), o


@pytest.mark.parametrize("model_class", [
    Tanh, WithNorm], ids=["one_phase", "two_phase"])
@pytest.mark.parametrize("capture", ["fx", "export"])
def test_a_training_step_inside_a_forward_ad_level_is_refused(capture, model_class):
    torch.manual_seed(0)
    model = model_class()
    x, y = _data()
    tangent = torch.randn_like(x)
    cm = _compile(model, (x, y), capture)
    before, x_before = _state(model), x.clone()
    with fwAD.dual_level():
        dual = fwAD.make_dual(x, tangent)
        with pytest.raises(mbcompile.InputError, match=r"training step was called inside "
                           r"torch\.autograd\.forward_ad\.dual_level\(\).*tangents would be "
                           r"None.*Fix: call the training step outside the dual level.*"
                           r"torch\.no_grad\(\).*nothing was changed"):
            cm(dual, y)
    assert _unchanged(before, model) and torch.equal(x, x_before)
    loss, _ = cm(x, y)  # outside the level: trains as before
    loss.backward()
    assert all(p.grad is not None for p in model.parameters())


@pytest.mark.parametrize("capture", ["fx", "export"])
def test_a_forward_only_call_inside_a_forward_ad_level_keeps_the_tangents(capture):
    torch.manual_seed(0)
    model = WithNorm()
    eager = copy.deepcopy(model)
    x, y = _data()
    tangent = torch.randn_like(x)
    cm = _compile(model, (x, y), capture)
    outs = []
    for module in (cm, eager):
        with fwAD.dual_level(), torch.no_grad():
            loss, o = module(fwAD.make_dual(x, tangent), y)
            outs.append([(fwAD.unpack_dual(v).primal.clone(), fwAD.unpack_dual(v).tangent)
                         for v in (loss, o)])
    for (primal, tan), (want_primal, want_tan) in zip(*outs, strict=True):
        assert rel_err(primal, want_primal) <= TOL
        assert tan is not None and rel_err(tan, want_tan) <= TOL
    for a, b in zip(model.buffers(), eager.buffers(), strict=True):  # BatchNorm's statistics
        assert rel_err(a.double(), b.double()) <= TOL


# ------------------------------------------------ finding 3: subclasses with an override
class Doubled(torch.Tensor):
    """Doubles ``F.linear``'s result (per sample: torch.fx happened to be exact)."""

    @classmethod
    def __torch_function__(cls, func, types, args=(), kwargs=None):  # noqa: ANN001, ANN206
        out = super().__torch_function__(func, types, args, kwargs or {})
        return out * 2 if func is F.linear else out


class SquaredLoss(torch.Tensor):
    """Squares the MSE (over the whole batch): torch.fx squared each microbatch's."""

    @classmethod
    def __torch_function__(cls, func, types, args=(), kwargs=None):  # noqa: ANN001, ANN206
        out = super().__torch_function__(func, types, args, kwargs or {})
        return out ** 2 if func is F.mse_loss else out


class Plain(torch.Tensor):
    """A subclass without an override of its own: runs torch's ops, as a Tensor does."""


class Linear(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.a = nn.Linear(5, 3, dtype=F64)

    def forward(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        return F.mse_loss(self.a(x), y)


@pytest.mark.parametrize("kind", [Doubled, SquaredLoss])
@pytest.mark.parametrize("capture", ["fx", "export", "auto"])
def test_a_subclass_with_its_own_torch_function_is_refused_at_compile(kind, capture):
    torch.manual_seed(0)
    model = Linear()
    x, y = _data()
    before, x_before = _state(model), x.clone()
    with pytest.raises(mbcompile.InputError, match=rf"input 'x' is a .*{kind.__name__}, a "
                       r"tensor subclass with a __torch_function__ of its own.*Fix: pass a "
                       r"plain tensor \(\.as_subclass\(torch\.Tensor\)\)"):
        _compile(model, (x.as_subclass(kind), y), capture)
    assert _unchanged(before, model) and torch.equal(x, x_before)


@pytest.mark.parametrize("capture", ["fx", "export"])
def test_a_subclass_with_its_own_torch_function_is_refused_at_a_call(capture):
    torch.manual_seed(0)
    model = Linear()
    x, y = _data()
    cm = _compile(model, (x, y), capture)
    before = _state(model)
    with pytest.raises(mbcompile.InputError, match=r"input 'x' is a .*Doubled.*Fix: pass a "
                       "plain tensor"):
        cm(x.as_subclass(Doubled), y)
    assert _unchanged(before, model)


@pytest.mark.parametrize("capture", ["fx", "export"])
def test_a_subclass_without_an_override_and_a_parameter_run_as_tensors(capture):
    torch.manual_seed(0)
    model = Linear()
    eager = copy.deepcopy(model)
    x, y = _data()
    cm = _compile(model, (x.as_subclass(Plain), y), capture)
    _steps(cm, eager, model, [(x.as_subclass(Plain), y), (nn.Parameter(x.clone()), y)])


# ---------------------------------------------------------- finding 6: nested, sparse
class Padded(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.a = nn.Linear(5, 3, dtype=F64)

    def forward(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        return F.mse_loss(self.a(x).to_padded_tensor(0.0).sum(1), y)


def _nested(layout: torch.layout) -> torch.Tensor:
    g = torch.Generator().manual_seed(4)
    return torch.nested.nested_tensor([torch.randn(i % 3 + 1, 5, generator=g, dtype=F64)
                                       for i in range(GBS)], layout=layout)


def _sparse(layout: torch.layout) -> torch.Tensor:
    dense = _data()[0]
    dense = dense * (dense > 0.8)
    return dense.to_sparse() if layout is torch.sparse_coo else dense.to_sparse_csr()


NESTED = r"input 'x' is a nested tensor \(torch\.nested.*Fix: pad it to a dense tensor " \
    r"\(\.to_padded_tensor\(0\.0\)\)"
SPARSE = r"is a sparse tensor \(layout torch\.sparse_c..\).*dense strided tensors only.*" \
    r"Fix: pass a dense tensor \(\.to_dense\(\)\)"


@pytest.mark.parametrize("layout", [torch.strided, torch.jagged], ids=["strided", "jagged"])
@pytest.mark.parametrize("capture", ["fx", "export"])
def test_a_nested_input_is_refused_at_compile(layout, capture):
    torch.manual_seed(0)
    model = Padded()
    before = _state(model)
    with pytest.raises(mbcompile.InputError, match=NESTED):
        _compile(model, (_nested(layout), _data()[1]), capture)
    assert _unchanged(before, model)


@pytest.mark.parametrize("layout", [torch.sparse_coo, torch.sparse_csr], ids=["coo", "csr"])
@pytest.mark.parametrize("capture", ["fx", "auto"])
def test_a_sparse_input_is_refused_at_compile(layout, capture):
    torch.manual_seed(0)
    model = Linear()
    before = _state(model)
    with pytest.raises(mbcompile.InputError, match="input 'x' " + SPARSE):
        _compile(model, (_sparse(layout), _data()[1]), capture)
    assert _unchanged(before, model)


class Keyed(nn.Module):
    """A batched dict input and an unbatched one (a weight matrix passed whole)."""

    def __init__(self) -> None:
        super().__init__()
        self.a = nn.Linear(5, 3, dtype=F64)

    def forward(self, batch: dict[str, torch.Tensor], proj: torch.Tensor) -> torch.Tensor:
        return F.mse_loss(self.a(batch["x"] @ proj), batch["y"])


@pytest.mark.parametrize("capture", ["fx", "export"])
def test_a_nested_or_sparse_input_is_refused_at_a_call(capture):
    torch.manual_seed(0)
    model = Keyed()
    x, y = _data()
    proj = torch.eye(5, dtype=F64)
    cm = mbcompile.compile(model, GBS, SYSTEMS, MBS, example_inputs=({"x": x, "y": y}, proj),
                           in_dims={"batch": 0, "proj": None}, **plan_free(MBS, capture=capture))
    before = _state(model)
    calls = [({"x": _nested(torch.strided), "y": y}, proj, r"input batch\['x'\] is a nested"),
             ({"x": _nested(torch.jagged), "y": y}, proj, r"input batch\['x'\] is a nested"),
             ({"x": _sparse(torch.sparse_coo), "y": y}, proj, r"input batch\['x'\] is a sparse"),
             ({"x": x, "y": y}, proj.to_sparse(), "input 'proj' is a sparse")]
    for batch, p, said in calls:
        with pytest.raises(mbcompile.InputError, match=said + ".*Fix: "):
            cm(batch, p)
    assert _unchanged(before, model)


# ------------------------------------------------------------------------- the cost
def test_the_kind_and_dtype_checks_cost_microseconds_a_call():
    """``batch_size`` and ``check_layout`` of a two-tensor call whose graph holds dtypes:
    the per-call checks with the kind and dtype comparisons in them."""
    x, y = _data()
    inputs = Inputs(("x", "y"), (0, 0), {})
    layout = input_layout(inputs, [x, y], fixed=True)

    def checks() -> None:
        batch_size(inputs, [x, y])
        check_layout(inputs, [x, y], layout)

    per_call = min(timeit.repeat(checks, number=2000, repeat=5)) / 2000
    assert per_call < 50e-6, f"{per_call * 1e6:.1f} µs a call"
