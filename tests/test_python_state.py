"""Python state in forward, exact or refused (issue 35): side effects, counters, guards.

Each model is a few lines of the kind research code writes: it logs into a dict, appends
to a list, keeps the last loss, prints, counts its calls. Each is compiled on an uneven
plan (gbs 7 over 2 systems, mbs 2: microbatches 2, 2 | 2, 1) in float64 and run for three
steps with SGD against eager on a deep copy: the loss, every output, every ``.grad``, the
parameters after the optimizer step, the buffers and the Python state (the dicts, lists,
attributes and counters; the printed text) must match. What cannot be exact is refused
with the project's own error, naming the thing and the fix, and the model, its
containers included, is left as it was.
"""

from __future__ import annotations

import contextlib
import copy
import dataclasses
import enum
import io
import logging
import sys
import warnings
from collections.abc import Callable
from typing import Any

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F
from coupled_models import RMSENet
from models import TOL, plan_free, rel_err, tensor_leaves

import mbcompile

GBS, SYSTEMS, MBS = 7, 2, 2
COMPILED = {"backend": "aot_eager"}  # torch_compile without a C++ toolchain's inductor


pytestmark = pytest.mark.usefixtures("float64_default")  # conftest.py


def _batch(n: int = GBS) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(1)
    return torch.randn(n, 4, generator=g), torch.randn(n, 3, generator=g)


def _compile(model: nn.Module, batch: tuple[Any, ...], **kw: Any) -> mbcompile.CompiledModule:
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", mbcompile.MbcompileWarning)
        return mbcompile.compile(model, GBS, SYSTEMS, MBS, example_inputs=batch,
                                 **plan_free(MBS, **kw))


def _same(got: Any, want: Any, where: str) -> None:
    """Python state equal: tensors to ``TOL`` (relative), everything else ==, recursively."""
    assert type(got) is type(want), f"{where}: {type(got).__name__} vs {type(want).__name__}"
    if isinstance(want, torch.Tensor):
        assert got.shape == want.shape, f"{where}: shape {got.shape} vs {want.shape}"
        assert rel_err(got, want) <= TOL, f"{where}: {got} vs {want}"
    elif isinstance(want, (list, tuple)):
        assert len(got) == len(want), f"{where}: {len(got)} items vs {len(want)}"
        for i, (g, w) in enumerate(zip(got, want)):
            _same(g, w, f"{where}[{i}]")
    elif isinstance(want, dict):
        assert list(got) == list(want), f"{where}: keys {list(got)} vs {list(want)}"
        for k in want:
            _same(got[k], want[k], f"{where}[{k!r}]")
    else:
        assert got == want, f"{where}: {got!r} vs {want!r}"


def _three_steps(model: nn.Module, state: Callable[[nn.Module], Any], capsys: Any,
                 batch: tuple[Any, ...] | None = None, **kw: Any) -> mbcompile.CompiledModule:
    """Compile ``model``, then three SGD steps of it and of an eager deep copy (taken before
    compile), compared after each: outputs, grads, parameters, buffers, ``state(model)``
    and what each step printed."""
    batch = batch or _batch()
    ref = copy.deepcopy(model)
    cm = _compile(model, batch, **kw)
    assert capsys.readouterr().out == "", "compile printed"
    _same(state(model), state(ref), "state after compile")
    opts = [torch.optim.SGD(m.parameters(), lr=0.1) for m in (model, ref)]
    for step in range(3):
        results = []
        for module, call, opt in ((model, cm, opts[0]), (ref, ref, opts[1])):
            opt.zero_grad(set_to_none=True)
            with warnings.catch_warnings():
                warnings.simplefilter("ignore", mbcompile.MbcompileWarning)
                out = call(*batch)
            printed = capsys.readouterr().out
            leaves = tensor_leaves(out)
            leaves[0][1].backward()
            grads = {n: p.grad for n, p in module.named_parameters()}
            opt.step()
            results.append((leaves, grads, printed))
        (got, got_grads, got_text), (want, want_grads, want_text) = results
        where = f"step {step + 1}"
        assert got_text == want_text, f"{where}: printed {got_text!r}, eager {want_text!r}"
        _same([v.detach() for _, v in got], [v.detach() for _, v in want], f"{where} outputs")
        for name, g in want_grads.items():
            assert (got_grads[name] is None) == (g is None), f"{where}: grad {name}"
            if g is not None:
                _same(got_grads[name], g, f"{where}: grad {name}")
        _same([p.detach() for p in model.parameters()], [p.detach() for p in ref.parameters()],
              f"{where} parameters")
        _same(list(model.buffers()), list(ref.buffers()), f"{where} buffers")
        _same(state(model), state(ref), f"{where} Python state")
    return cm


# --------------------------------------------------------------------------- side effects


class Logging(nn.Module):
    """Every logging habit of issue 35 in one forward."""

    def __init__(self, kind: str) -> None:
        super().__init__()
        self.a, self.kind = nn.Linear(4, 3), kind
        self.stats: dict[str, Any] = {"seen": []}
        self.history: list[torch.Tensor] = []
        self.last: torch.Tensor | None = None

    def forward(self, x: torch.Tensor, y: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        o = self.a(x)
        loss = F.mse_loss(o, y)
        if self.kind in ("dict", "all"):
            self.stats["loss"] = loss.detach()
            self.stats["seen"].append(o.detach().mean(0))  # a list inside a dict
        if self.kind in ("list", "all"):
            self.history.append(o.detach())  # per-sample: the full batch's rows, in order
        if self.kind in ("attr", "all"):
            self.last = loss.detach()
            self.returned = loss  # the very tensor forward returns
        if self.kind in ("print", "all"):
            print("loss", loss.detach(), "rows", o.detach()[:2])
        if self.kind in ("shape", "all"):  # a size, a dtype: fx made their node after output
            print("batch", x.shape, x.size(), o.shape[1:], o.dtype)
        return loss, o


def _logged(m: nn.Module) -> Any:
    return m.stats, m.history, m.last, vars(m).get("returned", None)


@pytest.mark.parametrize("kind,capture", [
    *((k, "auto") for k in ("dict", "list", "attr", "print", "shape", "all")),
    # torch.export put an assigned tensor attribute back (the step ran, ``self.last`` kept
    # None), and refused the others: the written tensors are now outputs of its trace too
    *((k, "export") for k in ("dict", "list", "attr", "print"))])
def test_logging_in_forward_is_replayed_once_per_step_with_full_batch_values(kind, capture,
                                                                           capsys):
    torch.manual_seed(0)
    model = Logging(kind)
    cm = _three_steps(model, _logged, capsys, capture=capture)
    if kind == "attr":
        out = cm(*_batch())
        assert model.returned is out[0]  # the returned tensor itself, as in eager


def test_a_printed_shape_is_the_calls_full_batch_at_every_batch_size(capsys):
    """``print(x.shape)`` (a MixingError about a node fx made after the output, before) is
    replayed with each call's full batch, at gbs and at other batch sizes."""
    torch.manual_seed(0)
    model = Logging("shape")
    ref = copy.deepcopy(model)
    cm = _compile(model, _batch())
    for n in (GBS, 5, 9):
        for call in (cm, ref):
            with warnings.catch_warnings():
                warnings.simplefilter("ignore", mbcompile.MbcompileWarning)
                call(*_batch(n))
        got, want = capsys.readouterr().out.splitlines()
        assert got == want == f"batch torch.Size([{n}, 4]) torch.Size([{n}, 4]) " \
            "torch.Size([3]) torch.float64", (n, got, want)


def test_a_forward_made_by_exec_compiles_and_trains_as_eager(capsys):
    """A forward defined by ``exec`` in a namespace without ``__name__`` (code generated at
    run time) has no ``__module__``: compile raised AttributeError reading it."""
    namespace: dict[str, Any] = {"F": F}
    exec("def forward(self, x, y):\n    return F.mse_loss(self.a(x), y), self.a(x)\n",
         namespace)
    model = type("Generated", (Logging,), {"forward": namespace["forward"]})("none")
    _three_steps(model, _logged, capsys)


def test_a_printed_shape_under_export_is_refused_naming_why_fx_failed():
    """Under torch.export a printed size of the batch dim is symbolic: refused (it was a
    TypeError out of torch.Size), and where fx failed first the fix does not send the user
    back to it."""
    class Iterated(Logging):
        def forward(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
            print("batch", tuple(x.shape))  # fx cannot iterate a traced size
            return F.mse_loss(self.a(x), y)

    for capture, fix in (("export", "compile with capture='fx'"),
                         ("auto", "failed first on this forward")):
        model = Iterated("shape")
        before = copy.deepcopy(model.state_dict())
        with pytest.raises(mbcompile.CaptureError, match="size read off an input") as err:
            _compile(model, _batch(), capture=capture)
        assert fix in str(err.value), (capture, str(err.value))
        assert all(torch.equal(v, before[k]) for k, v in model.state_dict().items())


@pytest.mark.parametrize("kw", [{"recompute": True}, {"torch_compile": COMPILED},
                                {"outputs": "loss"}], ids=["recompute", "compiled", "loss_only"])
def test_logging_with_recompute_torch_compile_and_loss_only_outputs(kw, capsys):
    torch.manual_seed(0)
    model = Logging("all")
    if "outputs" in kw:  # the logged per-sample rows are kept although the logits are not
        ref = copy.deepcopy(model)
        cm = _compile(model, _batch(), **kw)
        cm(*_batch())
        ref(*_batch())
        capsys.readouterr()
        _same(_logged(model)[:3], _logged(ref)[:3], "after one step")
        return
    _three_steps(model, _logged, capsys, **kw)


class CoupledLogging(RMSENet):
    """A loss that couples samples (``mse.sqrt()``): a two-phase step; forward logs."""

    def __init__(self) -> None:
        super().__init__()
        self.log: dict[str, Any] = {}
        self.feats: list[torch.Tensor] = []

    def forward(self, x: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
        z = self.encoder(x)
        loss = F.mse_loss(z, target).sqrt()
        self.log["rmse"] = loss.detach()
        self.feats.append(z.detach())
        return loss


def test_logging_in_a_two_phase_step(capsys):
    torch.manual_seed(0)
    g = torch.Generator().manual_seed(1)
    batch = (torch.randn(GBS, 6, generator=g), torch.randn(GBS, 2, generator=g))
    model = CoupledLogging().double()
    cm = _three_steps(model, lambda m: (m.log, m.feats), capsys, batch=batch)
    assert cm.analysis.two_phase


class DictCounter(nn.Module):
    """A counter kept in a dict: read and written as a Python number."""

    def __init__(self) -> None:
        super().__init__()
        self.a = nn.Linear(4, 3)
        self.stats: dict[str, Any] = {}

    def forward(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        self.stats["calls"] = self.stats.get("calls", 0) + 1
        self.stats["mode"] = "train"
        return F.mse_loss(self.a(x), y)


def test_a_counter_in_a_dict_moves_once_per_step(capsys):
    torch.manual_seed(0)
    model = DictCounter()
    _three_steps(model, lambda m: m.stats, capsys)
    assert model.stats == {"calls": 3, "mode": "train"}


# --------------------------------------------------------------------------- refusals


def _picture(model: nn.Module) -> Any:
    """The model's Python state, deep, by value, and the identity of its containers."""
    own = {k: v for k, v in vars(model).items() if not k.startswith("_") and k != "training"}
    return copy.deepcopy(own), {k: id(v) for k, v in own.items()}


class Refused(nn.Module):
    def __init__(self, kind: str) -> None:
        super().__init__()
        self.a, self.kind = nn.Linear(4, 3), kind
        self.history: list[Any] = [1.0]
        self.queue: list[Any] = [1, 2]
        self.box: dict[str, Any] = {"seen": []}
        self.register_buffer("calls", torch.zeros(()))

    def forward(self, x: torch.Tensor, y: torch.Tensor, opts: dict | None = None
                ) -> torch.Tensor:
        loss = F.mse_loss(self.a(x), y)
        if self.kind == "item":
            self.history.append(loss.item())
        elif self.kind == "pop":
            self.queue.pop(0)
            self.history.append(loss.detach())
        elif self.kind == "fstring":
            print(f"loss {loss.detach()}")
        elif self.kind == "list read":  # eager weighs by 1, 2, 3, ... as the list grows
            self.history.append(loss.detach())
            return loss * len(self.history)
        elif self.kind == "nested list read":
            self.box["seen"].append(loss.detach())
            return loss * len(self.box["seen"])
        elif self.kind == "global nested list read":
            BOXES["seen"].append(loss.detach())
            return loss * len(BOXES["seen"])
        elif self.kind == "global list read":
            SEEN.append(loss.detach())
            return loss * len(SEEN)
        elif self.kind == "print container":  # eager shows [1.0] first, then what it grew to
            print("history", self.history, len(self.history))
            self.history.append(loss.detach())
        elif self.kind == "argument":
            opts["loss"] = loss.detach()
        elif self.kind == "buffer +=":  # in place in eager; fx's value runs it as `= +`
            self.calls += 1
        return loss


@pytest.mark.parametrize("kind, names", [
    ("item", ["self.history", ".item()", "loss.detach()"]),
    ("pop", ["self.queue", "append"]),
    ("fstring", ["print", "its own argument"]),
    ("list read", ["reads self.history, a list it also appends to", "self.seen += 1"]),
    ("global list read", ["the global SEEN, a list it also appends to"]),
    ("nested list read", ["self.box['seen'], a list it also appends to"]),
    ("global nested list read", ["the global BOXES['seen'], a list it also appends to"]),
    ("print container", ["prints a container or object it also changes",
                         "print the values themselves"]),
    ("argument", ["'opts'", "return the value"]),
    ("buffer +=", ["'calls'", "self.calls += 1", "capture='auto'", "self.calls.add_(...)"]),
])
def test_a_side_effect_that_cannot_be_exact_is_refused_and_changes_nothing(kind, names):
    torch.manual_seed(0)
    model = Refused(kind)
    before, ids = _picture(model)
    opts: dict[str, Any] = {}
    batch = (*_batch(), opts) if kind == "argument" else _batch()
    with pytest.raises(mbcompile.CaptureError) as err:
        _compile(model, batch, capture="fx")
    for name in names:
        assert name in str(err.value), (name, str(err.value))
    after, after_ids = _picture(model)
    assert after_ids == ids and after == before and opts == {}
    assert SEEN == [] and BOXES == {"seen": []} and float(model.calls) == 0


SEEN: list[Any] = []  # a global list forward appends to
BOXES: dict[str, list[Any]] = {"seen": []}  # and one inside a global dict


# --------------------------------------------------------------------------- counters


class Counters(nn.Module):
    """Counters of any name, a schedule read from one, a running mean kept as a number
    that becomes a tensor after the first call."""

    def __init__(self, kind: str) -> None:
        super().__init__()
        self.a, self.kind = nn.Linear(4, 3), kind
        self._step, self.calls, self.ema = 0, 0, 0.0

    def forward(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        loss = F.mse_loss(self.a(x), y)
        if self.kind == "private":
            self._step += 1
        elif self.kind == "public":
            self.calls = self.calls + 1
        elif self.kind == "schedule":  # a warm-up read from the counter
            loss = loss * min(1.0, (self._step + 1) / 2)
            self._step += 1
        elif self.kind == "ema":
            self.ema = 0.5 * self.ema + 0.5 * loss.detach()
        return loss


@pytest.mark.parametrize("kind", ["private", "public", "schedule", "ema"])
def test_a_counter_moves_once_per_step_as_in_eager(kind, capsys):
    torch.manual_seed(0)
    model = Counters(kind)
    _three_steps(model, lambda m: (m._step, m.calls, m.ema), capsys)
    if kind in ("private", "public", "schedule"):
        assert model._step + model.calls == 3


# --------------------------------------------------------------------------- guard cache


class Annealed(nn.Module):
    """A temperature the training loop anneals every step, and a flag read in a branch."""

    def __init__(self) -> None:
        super().__init__()
        self.a = nn.Linear(4, 3)
        self.temp, self.hard = 1.0, False

    def forward(self, x: torch.Tensor, y: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        o = self.a(x) / self.temp
        if self.hard:
            o = o.clamp(-0.5, 0.5)
        return F.mse_loss(o, y) * self.temp, o


def _compiles(cm: mbcompile.CompiledModule) -> int:
    return sum(len(entries) for entries in cm._cache.values())


def test_a_number_changed_every_step_becomes_a_graph_input(capsys):
    """20 steps of an annealed temperature: at most 3 compiles, each step exact."""
    torch.manual_seed(0)
    model = Annealed()
    ref = copy.deepcopy(model)
    cm = _compile(model, _batch())
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always", mbcompile.RecompileWarning)
        for step in range(20):
            model.temp = ref.temp = 1.0 - 0.04 * step
            got, want = cm(*_batch()), ref(*_batch())
            _same([t.detach() for t in got], [t.detach() for t in want], f"step {step}")
    recompiles = [w for w in caught if issubclass(w.category, mbcompile.RecompileWarning)]
    assert len(recompiles) == 2 and "temp was" in str(recompiles[0].message)
    assert _compiles(cm) == 3


def test_going_back_to_an_earlier_value_costs_no_compile():
    torch.manual_seed(0)
    model = Annealed()
    ref = copy.deepcopy(model)
    cm = _compile(model, _batch())
    with pytest.warns(mbcompile.RecompileWarning, match="hard was False, now True"):
        model.hard = True
        cm(*_batch())
    with warnings.catch_warnings():
        warnings.simplefilter("error", mbcompile.RecompileWarning)
        for hard in (False, True, False):
            model.hard = ref.hard = hard
            _same([t.detach() for t in cm(*_batch())], [t.detach() for t in ref(*_batch())],
                  f"hard={hard}")
    assert _compiles(cm) == 2


def test_a_number_used_in_python_control_flow_stays_guarded():
    """A value read in an ``if`` cannot be a graph input: each value compiles once."""

    class Branchy(Annealed):
        def forward(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
            o = self.a(x)
            if self.temp < 0.5:
                o = o * 2
            return F.mse_loss(o, y)

    torch.manual_seed(0)
    model = Branchy()
    ref = copy.deepcopy(model)
    cm = _compile(model, _batch())
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", mbcompile.RecompileWarning)
        for temp in (0.9, 0.8, 0.3, 0.2, 0.9):
            model.temp = ref.temp = temp
            _same(cm(*_batch()).detach(), ref(*_batch()).detach(), f"temp={temp}")


# --------------------------------------------------------------------------- what guards see


SHIFT = 0.0  # a module-level constant forward reads


class Kind(enum.Enum):
    SOFT = "soft"
    HARD = "hard"


@dataclasses.dataclass
class Cfg:
    beta: float = 1.0


class ReadsEverything(nn.Module):
    """A flag in a dict, an enum, a config object's field, a private number, a global and a
    helper method: each baked into the graph by the trace, each changed after compile."""

    def __init__(self) -> None:
        super().__init__()
        self.a = nn.Linear(4, 3)
        self.flags = {"hard": False}
        self.kind, self.cfg, self._gain = Kind.SOFT, Cfg(), 1.0

    def head(self, o: torch.Tensor) -> torch.Tensor:
        return o

    def forward(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        o = self.head(self.a(x)) * self._gain + SHIFT
        if self.flags["hard"] or self.kind is Kind.HARD:
            o = o.clamp(-0.2, 0.2)
        return F.mse_loss(o, y) * self.cfg.beta


def _set_shift(value: float) -> None:
    global SHIFT
    SHIFT = value


CHANGES: dict[str, Callable[[nn.Module], None]] = {
    "dict item": lambda m: m.flags.__setitem__("hard", True),
    "enum": lambda m: setattr(m, "kind", Kind.HARD),
    "object attribute": lambda m: setattr(m.cfg, "beta", 0.25),
    "private number": lambda m: setattr(m, "_gain", 3.0),
    "global": lambda m: _set_shift(0.5),
    "method": lambda m: setattr(m, "head", lambda o: o * 2),
}


@pytest.mark.parametrize("change", list(CHANGES))
def test_every_python_value_forward_reads_is_guarded(change):
    torch.manual_seed(0)
    model = ReadsEverything()
    cm = _compile(model, _batch(), capture="fx")
    try:
        CHANGES[change](model)
        with pytest.warns(mbcompile.RecompileWarning, match="which forward reads"):
            got = cm(*_batch())
        _same(got.detach(), model(*_batch()).detach(), change)
    finally:
        _set_shift(0.0)


class Logged(nn.Module):
    """Logs through ``logging``, with a traced value as an argument."""

    def __init__(self) -> None:
        super().__init__()
        self.a = nn.Linear(4, 3)

    def forward(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        loss = F.mse_loss(self.a(x), y)
        LOGGER.info("loss %.6f on %d rows", loss.detach(), x.shape[0])
        return loss


LOGGER = logging.getLogger("mbcompile.tests.python_state")


def test_a_logging_call_in_forward_logs_once_per_step(capsys, caplog):
    torch.manual_seed(0)
    model = Logged()
    with caplog.at_level(logging.INFO, logger=LOGGER.name):
        cm = _compile(model, _batch())
        assert not caplog.records, "compile logged"
        for call in (cm, copy.deepcopy(model)):
            call(*_batch())
    got, want = (r.getMessage() for r in caplog.records)
    assert got == want and "on 7 rows" in got


def test_a_logging_call_follows_the_logger_level_and_keeps_its_line(caplog):
    """Compiled with the logger at WARNING, ``LOGGER.info`` in forward logs nothing; set to
    INFO afterwards, the next call compiles again (the level is guarded) and logs each step
    as eager does, its record at forward's file and line; back at WARNING it logs nothing,
    as eager, with no compile (that state is cached)."""
    torch.manual_seed(0)
    model = Logged()
    ref = copy.deepcopy(model)
    LOGGER.setLevel(logging.WARNING)
    try:
        cm = _compile(model, _batch())
        records = []
        for level in (logging.INFO, logging.INFO, logging.WARNING):
            LOGGER.setLevel(level)
            caplog.clear()
            with caplog.at_level(level, logger=LOGGER.name), warnings.catch_warnings():
                warnings.simplefilter("ignore", mbcompile.MbcompileWarning)
                cm(*_batch())
                ref(*_batch())
            records.append([(r.getMessage(), r.pathname, r.lineno, r.funcName)
                            for r in caplog.records])
    finally:
        LOGGER.setLevel(logging.NOTSET)
    for got in records[:2]:
        assert len(got) == 2 and got[0] == got[1], got  # compiled, then eager
        assert got[0][1] == __file__ and got[0][3] == "forward"
    assert records[2] == []


class Settings:
    """A plain object forward writes one attribute of and reads another."""

    def __init__(self) -> None:
        self.temp, self.last = 2.0, None


class HalfWritten(nn.Module):
    """Writes one key of a dict and one attribute of an object, reads the others."""

    def __init__(self) -> None:
        super().__init__()
        self.a = nn.Linear(4, 3)
        self.stats: dict[str, Any] = {"scale": 2.0}
        self.settings = Settings()
        self.box: dict[str, Any] = {"seen": [], "shift": 0.0}  # a list appended, beside

    def forward(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        loss = F.mse_loss(self.a(x), y)
        self.stats["loss"] = loss.detach()
        self.settings.last = loss.detach()
        self.box["seen"].append(loss.detach())
        return loss * self.stats["scale"] / self.settings.temp + self.box["shift"]


def test_what_forward_reads_beside_what_it_writes_is_guarded():
    """``stats["scale"]`` and ``settings.temp``, read beside the key and attribute forward
    writes, and ``box["shift"]`` beside a list it appends to: a change after compile
    compiles again (a warning naming it), the list growing does not; exact against eager
    over five steps, the written values replayed."""
    torch.manual_seed(0)
    model = HalfWritten()
    ref = copy.deepcopy(model)
    cm = _compile(model, _batch())
    changes = [(2.0, 2.0, 0.0, None), (3.0, 2.0, 0.0, "scale"), (3.0, 0.5, 0.0, "temp"),
               (3.0, 0.5, 0.0, None), (3.0, 0.5, 1.0, "box")]
    for step, (scale, temp, shift, named) in enumerate(changes):
        for net in (model, ref):
            net.stats["scale"], net.settings.temp, net.box["shift"] = scale, temp, shift
            net.zero_grad(set_to_none=True)
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always", mbcompile.RecompileWarning)
            got = cm(*_batch())
        recompiled = [str(w.message) for w in caught
                      if issubclass(w.category, mbcompile.RecompileWarning)]
        assert (named in recompiled[0]) if named else recompiled == [], (step, recompiled)
        want = ref(*_batch())
        got.backward()
        want.backward()
        _same(got.detach(), want.detach(), f"step {step + 1} loss")
        _same([p.grad for p in model.parameters()], [p.grad for p in ref.parameters()],
              f"step {step + 1} grads")
        _same(model.stats, ref.stats, f"step {step + 1} stats")
        _same(model.settings.last, ref.settings.last, f"step {step + 1} settings.last")
        _same(model.box, ref.box, f"step {step + 1} box")


class _Settings:
    def __init__(self) -> None:
        self.seen: list[int] = []
        self.scale = 1.0


class _SettingsNet(nn.Module):
    """Forward reads an object's numbers and appends to its list, and reads a dict with a
    tuple key."""

    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(4, 1)
        self.cfg, self.table = _Settings(), {(0, 1): 1.0, "k": 0.5}

    def forward(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        self.cfg.seen.append(1)
        scale = self.cfg.scale * self.table[(0, 1)] * self.table.get("k", 1.0)
        return F.mse_loss(self.lin(x), y) * scale


@pytest.mark.parametrize("change, said", [
    (lambda m: setattr(m.cfg, "scale", 2.0), "cfg changed, now .scale = 2.0,"),
    (lambda m: m.table.pop("k"), "table changed, now ['k'] deleted,"),
    (lambda m: m.table.__setitem__((0, 1), 3.0), "table changed, now [(0, 1)] = 3.0,"),
], ids=["attribute", "deleted", "tuple_key"])
def test_a_recompile_names_what_changed_in_an_object_not_its_whole_repr(change, said):
    """An object or dict changed in place is named by the part that changed (a
    transformers config's whole repr is a page), never by a list forward appends to."""
    torch.manual_seed(0)
    model = _SettingsNet()
    x, y = torch.randn(8, 4), torch.randn(8, 1)
    cm = mbcompile.compile(model, 8, 1, 2, example_inputs=(x, y), cost_model=False)
    cm(x, y).backward()
    change(model)
    with pytest.warns(mbcompile.RecompileWarning) as seen:
        cm(x, y).backward()
    assert said in str(seen[0].message) and ".seen" not in str(seen[0].message)


@dataclasses.dataclass(slots=True)
class _SlotsConfig:
    scale: float = 2.0


class _SlotsPlain:
    __slots__ = ("scale",)

    def __init__(self) -> None:
        self.scale = 2.0


class _SlotsBesideDict:
    """A ``__dict__`` and slots (as pydantic keeps its private attributes)."""

    __slots__ = ("__dict__", "_scale")

    def __init__(self) -> None:
        self.name, self._scale = "cfg", 2.0

    @property
    def scale(self) -> float:
        return self._scale

    @scale.setter
    def scale(self, value: float) -> None:
        self._scale = value


@pytest.mark.parametrize("kind", [_SlotsConfig, _SlotsPlain, _SlotsBesideDict],
                         ids=["dataclass", "plain", "beside_dict"])
def test_a_config_with_slots_changed_after_compile_compiles_again(kind):
    """A config object without ``__dict__`` (``dataclass(slots=True)``, a ``__slots__``
    class) was not guarded at all, and one with slots beside its ``__dict__`` (pydantic's
    private attributes) was guarded by its ``__dict__`` only: its value changed after
    compile, the compiled step kept the old one (4.18 against eager's 6.26), silently."""
    class Scaled(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.a, self.cfg = nn.Linear(4, 3), kind()

        def forward(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
            return F.mse_loss(self.a(x), y) * self.cfg.scale

    torch.manual_seed(0)
    model = Scaled()
    cm = _compile(model, _batch())
    cm(*_batch())
    model.cfg.scale = 3.0
    with pytest.warns(mbcompile.RecompileWarning, match="cfg changed"):
        got = cm(*_batch())
    assert rel_err(got, copy.deepcopy(model)(*_batch())) <= TOL


class ParameterKept(nn.Module):
    """Keeps a parameter under a second name in forward: nn.Module registers it."""

    def __init__(self) -> None:
        super().__init__()
        self.a = nn.Linear(4, 3)

    def forward(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        self.used = self.a.weight
        return F.mse_loss(self.a(x), y)


@pytest.mark.parametrize("capture", ["fx", "export"])
def test_a_parameter_assigned_in_forward_is_refused_as_rewiring(capture):
    """Under fx the first step registered it, as eager does, and the next compile failed
    with an unrelated tracing error ('cannot assign Proxy as parameter')."""
    model = ParameterKept()
    with pytest.raises(mbcompile.CaptureError,
                       match=r"rewires modules while it runs: used \(adds a parameter\)"):
        _compile(model, _batch(), capture=capture)
    assert [n for n, _ in model.named_parameters()] == ["a.weight", "a.bias"]


def _recording(capture: str | None) -> tuple[nn.Module, Any]:
    """A net whose layer's hook records into the net's own dict through a closure over the
    net, and its compiled module (None: eager)."""
    torch.manual_seed(0)
    model = Counters("none")
    model.acts, model.a = {}, nn.Sequential(model.a)  # a module fx traces into
    model.a.register_forward_hook(
        lambda mod, args, out: model.acts.__setitem__("a", out.detach()))
    return model, (model if capture is None else _compile(model, _batch(), capture=capture))


@pytest.mark.parametrize("capture", ["fx", "export"])
def test_a_hook_recording_through_a_closure_over_the_model_is_replayed(capture):
    """``model.a.register_forward_hook(lambda m, i, o: model.acts.__setitem__(...))`` was
    refused: the closure's module was taken for one outside the model."""
    (model, cm), (eager, _) = _recording(capture), _recording(None)
    for n in (GBS, 5):
        for call in (cm, eager):
            call(*_batch(n)).backward()
        assert model.acts["a"].shape == (n, 3)
        _same(model.acts, eager.acts, f"batch {n}")
        _same([p.grad for p in model.parameters()], [p.grad for p in eager.parameters()], "")


class ToStderr(Counters):
    def forward(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        loss = F.mse_loss(self.a(x), y)
        print("loss", loss.detach(), file=sys.stderr)
        return loss


@pytest.mark.parametrize("capture", ["fx", "export"])
def test_a_print_to_stderr_follows_a_redirect_made_after_compile(capture):
    """The replay printed to the stream sys.stderr was at compile time."""
    torch.manual_seed(0)
    model = ToStderr("none")
    cm = _compile(model, _batch(), capture=capture)
    for call in (cm, copy.deepcopy(model)):
        with contextlib.redirect_stderr(io.StringIO()) as caught:
            call(*_batch())
        assert caught.getvalue().startswith("loss tensor(")
