"""Choosing the MBS: auto against explore, the memory checks, reports, measured timing.

The last section drives the same machinery through ``mbcompile.compile``
(``system=``, ``compile_only=``, ``validate_only=``, ``measure=``).
"""

from __future__ import annotations

import json
import warnings
from dataclasses import replace
from typing import Any

import pytest
import torch
import torch.nn as nn

import mbcompile
from mbcompile.errors import (
    CompileOnlyError,
    CostModelError,
    CostModelWarning,
    DoesNotFitError,
    PlanError,
)
from mbcompile.models import make_cnn, make_mlp, make_tiny_gpt
from mbcompile.planning.cost import CostModel
from mbcompile.planning.cost_analysis import analyse_cost
from mbcompile.planning.mbs_policy import parse_mbs
from mbcompile.planning.measure import HostTimer
from mbcompile.planning.plan import (
    check_policy,
    make_plan,
    supported_mbs,
)
from mbcompile.planning.plan import per_system_batch_sizes as split
from mbcompile.planning.search import AUTO_TIME_TOLERANCE, Selector, select_plan
from mbcompile.planning.systems import SystemSpec, get_system
from mbcompile.reports.exploration import plot, table
from mbcompile.reports.report import Report, Validation

MAKERS = {"mlp": make_mlp, "cnn": make_cnn, "tiny_gpt": make_tiny_gpt}


def captured(model: nn.Module, batch: tuple[Any, ...], gbs: int) -> Any:
    return mbcompile.compile(model, gbs, 1, "none", example_inputs=batch).analysis


@pytest.fixture(scope="module")
def costs() -> dict[str, tuple[CostModel, nn.Module, tuple[Any, ...]]]:
    """One cost model per model, fitted for per-system batches up to 1000."""
    out = {}
    for name, make in MAKERS.items():
        model, batch = make(8)
        gm = captured(model, batch, 8)
        out[name] = (analyse_cost(gm, batch, (0, 0), pbs=1000), model, batch)
    return out


def tight(cost: CostModel, gbs: int, num_csx: int, fits_up_to: int) -> SystemSpec:
    """The host with just enough memory for ``fits_up_to`` samples per microbatch."""
    host = get_system("host")
    peak = cost.estimate(gbs, num_csx, fits_up_to, host).memory.peak
    return replace(host, name=f"tight-{fits_up_to}", memory_bytes=peak * 1.0001,
                   source="test: memory binds")


#: (model, gbs, num_csx, system or ("tight", mbs that just fits))
SUITE = [
    ("mlp", 64, 1, "host"),
    ("mlp", 96, 4, "a100-80gb"),
    ("mlp", 200, 2, ("tight", 34)),  # at smaller MBS the optimizer update sets the peak
    ("cnn", 64, 2, "host"),
    ("cnn", 200, 4, "a100-40gb"),
    ("cnn", 120, 3, ("tight", 9)),
    ("tiny_gpt", 64, 1, "host"),
    ("tiny_gpt", 512, 4, "wafer-sim"),
    ("tiny_gpt", 1000, 8, "h100-80gb"),
    ("tiny_gpt", 96, 2, ("tight", 11)),
    ("tiny_gpt", 999, 1, ("tight", 100)),
]


def spec_for(cost: CostModel, gbs: int, num_csx: int, system: Any) -> SystemSpec:
    return tight(cost, gbs, num_csx, system[1]) if isinstance(system, tuple) else \
        get_system(system)


@pytest.mark.parametrize("name,gbs,num_csx,system", SUITE,
                         ids=[f"{c[0]}-gbs{c[1]}-csx{c[2]}-{c[3]}" for c in SUITE])
def test_auto_is_within_5_percent_of_explore_and_evaluates_few(costs, name, gbs, num_csx,
                                                                system) -> None:
    cost, _, _ = costs[name]
    spec = spec_for(cost, gbs, num_csx, system)
    auto = Selector(cost, spec, split(gbs, num_csx))
    plan = make_plan(gbs, num_csx, "auto", chooser=auto.auto)
    explore = Selector(cost, spec, split(gbs, num_csx))
    best = make_plan(gbs, num_csx, "explore", explorer=explore.explore).mbs
    explored = explore.exploration
    assert explored is not None and len(explored.candidates) == len(plan.supported_mbs)
    chosen = auto.evaluate(plan.mbs)
    assert chosen.fits and explore.evaluate(best).fits
    assert chosen.step_s <= 1.05 * explore.evaluate(best).step_s
    assert chosen.step_s <= (1 + AUTO_TIME_TOLERANCE) * explore.evaluate(best).step_s + 1e-12
    assert all(c.fits for c in explored.candidates if c.mbs <= best)
    n, evaluated = len(plan.supported_mbs), len(auto.exploration.candidates)
    assert evaluated <= 3 * n.bit_length() + 4 and (n <= 32 or evaluated < n / 2)
    assert "auto on" in plan.reason and f"{evaluated} of {n} supported values" in plan.reason
    largest = max(c.mbs for c in explored.candidates if c.fits)
    assert plan.mbs <= largest
    if isinstance(system, tuple):  # memory binds: some candidates do not fit
        assert not all(c.fits for c in explored.candidates)


def test_auto_trades_a_little_time_for_headroom(costs) -> None:
    cost, _, _ = costs["tiny_gpt"]
    flat = SystemSpec("flat", memory_bytes=1e12, peak_flops=1e11, peak_flops_fp32=1e11,
                      memory_bandwidth=1e12, microbatch_overhead_s=0, kernel_overhead_s=0,
                      optimizer_bytes_per_param=0)  # compute-bound: step time barely moves
    sel = Selector(cost, flat, split(4096, 1))
    plan = make_plan(4096, 1, "auto", chooser=sel.auto)
    assert plan.mbs < plan.pbs
    assert "the smallest within 2% of it" in plan.reason and "free" in plan.reason
    assert sel.estimate(plan.mbs).memory.peak < sel.estimate(plan.pbs).memory.peak


# --------------------------------------------------------------------------- #
# Fitting in memory
# --------------------------------------------------------------------------- #


def test_none_that_does_not_fit_fails_with_the_numbers(costs) -> None:
    cost, _, _ = costs["cnn"]
    spec = tight(cost, 64, 1, 8)
    with pytest.raises(DoesNotFitError) as info:
        select_plan(split(64, 1), parse_mbs("none"), cost, spec)
    message = str(info.value)
    for word in ("mbs='none'", "does not fit", "tight-8", "needs", "but the system has",
                 "parameters", "activations", "use mbs=8"):
        assert word in message, message
    assert info.value.mbs == 64 and info.value.needed > info.value.available
    assert isinstance(info.value, PlanError) and isinstance(info.value, ValueError)


def test_an_int_that_does_not_fit_fails_and_names_the_largest_that_does(costs) -> None:
    cost, _, _ = costs["cnn"]
    with pytest.raises(DoesNotFitError) as info:
        select_plan(split(64, 1), parse_mbs(16), cost, tight(cost, 64, 1, 8))
    assert "mbs=16 does not fit" in str(info.value) and "use mbs=8" in str(info.value)
    assert select_plan(split(64, 1), parse_mbs(8), cost, tight(cost, 64, 1, 8)).plan.mbs == 8


@pytest.mark.parametrize("mbs", ["auto", "explore", {"explore": {"min": 2}}, 4, "none"])
def test_every_mode_fails_with_the_numbers_when_mbs_1_does_not_fit(costs, mbs) -> None:
    cost, _, _ = costs["tiny_gpt"]
    small = SystemSpec("tiny-card", memory_bytes=1e5, peak_flops=1e12, peak_flops_fp32=1e12,
                       memory_bandwidth=1e11)
    with pytest.raises(DoesNotFitError) as info:
        select_plan(split(32, 2), parse_mbs(mbs), cost, small)
    message = str(info.value)
    assert "even mbs=1 does not fit" in message and "tiny-card" in message
    assert "100.00 kB" in message and "optimizer state" in message
    assert info.value.mbs == 1


def test_auto_and_explore_never_pick_what_does_not_fit(costs) -> None:
    cost, _, _ = costs["cnn"]
    host = get_system("host")
    low, high = (cost.estimate(100, 1, m, host).memory.peak for m in (1, 100))
    for fraction in (0.0, 0.01, 0.1, 0.3, 0.7, 0.99):
        spec = replace(host, memory_bytes=low + fraction * (high - low))
        for mbs in ("auto", "explore"):
            selection = select_plan(split(100, 1), parse_mbs(mbs), cost, spec)
            assert selection.estimate.memory.fits
            assert selection.estimate.memory.peak <= spec.memory_bytes


def test_an_explore_range_where_nothing_fits_says_so(costs) -> None:
    cost, _, _ = costs["cnn"]
    with pytest.raises(DoesNotFitError, match="no MBS in the explore range fits"):
        select_plan(split(64, 1), parse_mbs({"explore": {"min": 16}}), cost,
                    tight(cost, 64, 1, 8))


# --------------------------------------------------------------------------- #
# Requests, reports, plots, progress
# --------------------------------------------------------------------------- #


def test_explore_needs_compile_only_and_says_how_to_pin() -> None:
    with pytest.raises(PlanError) as info:
        check_policy(split(64, 2), parse_mbs("explore"), False)
    for word in ("compile_only=True", "pin", "mbs=<that value>"):
        assert word in str(info.value)
    check_policy(split(64, 2), parse_mbs("explore"), True)
    with pytest.raises(PlanError, match="explore range"):  # the range is checked first
        check_policy(split(64, 2), parse_mbs({"explore": {"min": 20, "max": 21}}),
                     False)
    with pytest.raises(PlanError, match="at most the per-system batch size 32"):
        check_policy(split(64, 2), parse_mbs(33), False)


def test_single_microbatch_requests() -> None:
    def single(gbs: int, num_csx: int, mbs: object) -> bool:
        return check_policy(split(gbs, num_csx), parse_mbs(mbs), False).single

    assert single(10, 1, "none")
    assert single(10, 1, 10)
    # the closest supported value to 9 is 10
    assert single(10, 1, 9)
    assert not single(10, 2, "none")
    assert not single(10, 1, 5)
    assert not single(10, 1, "auto")
    # one sample: nothing to split
    assert single(1, 1, "auto")


def test_choices_are_what_the_policy_allows() -> None:
    choices = check_policy(split(20, 2), parse_mbs(7), False)  # pbs 10: 7 is not supported
    assert (choices.allowed, choices.pinned) == ((5,), 5)
    assert choices.counts == {1: 10, 2: 5, 3: 4, 4: 3, 5: 2, 10: 1}
    auto = check_policy(split(20, 2), parse_mbs("auto"), False)
    assert (auto.allowed, auto.pinned) == ((1, 2, 3, 4, 5, 10), None)
    ranged = check_policy(split(20, 2), parse_mbs({"explore": {"min": 3, "max": 9}}), True)
    assert ranged.allowed == (3, 4, 5)
    assert check_policy(split(20, 2), parse_mbs("none"), False).pinned == 10


def test_exploration_reports_a_table_json_and_a_plot(costs, tmp_path) -> None:
    cost, _, _ = costs["tiny_gpt"]
    sel = Selector(cost, get_system("a100-80gb"), split(64, 2))
    plan = make_plan(64, 2, {"explore": {"min": 2, "max": 16}}, explorer=sel.explore)
    x = sel.exploration
    assert [c.mbs for c in x.candidates] == [m for m in supported_mbs(32) if 2 <= m <= 16]
    assert x.best == plan.mbs and f"pin it with mbs={plan.mbs}" in plan.reason
    rows = table(x).splitlines()
    assert len(rows) == 2 + len(x.candidates) + 1
    assert rows[0].split()[:3] == ["mbs", "micro", "step"]
    assert sum(row.endswith("*") for row in rows) == 1
    json.dumps(x.to_dict())
    png = plot(x, tmp_path / "explore.png")
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and png.stat().st_size > 10_000


def test_long_explorations_show_progress(costs, capsys) -> None:
    cost, _, _ = costs["mlp"]
    sel = Selector(cost, get_system("host"), split(64, 1), progress=True)
    make_plan(64, 1, "explore", explorer=sel.explore)
    err = capsys.readouterr().err
    assert "exploring 15 MBS values" in err and "15/15" in err


def test_measured_exploration_times_the_host_beside_the_model(costs) -> None:
    cost, model, batch = costs["mlp"]
    gm = captured(model, batch, 8).graph_module
    timer = HostTimer(gm, batch, (0, 0), reps=2)
    sel = Selector(cost, get_system("host"), split(16, 1), timer=timer)
    plan = make_plan(16, 1, {"explore": {"min": 4}}, explorer=sel.explore)
    x = sel.exploration
    # Structure only: which MBS the clock favours depends on the machine and its load
    # (the fake clocks below pin that down).
    assert [c.mbs for c in x.candidates] == [m for m in supported_mbs(16) if m >= 4]
    assert x.measured and all(c.measured_loop_s is not None and c.measured_loop_s > 0
                              for c in x.candidates)
    assert x.measured_best in [c.mbs for c in x.candidates if c.fits]
    assert x.to_dict()["measured_best"] == x.measured_best
    assert x.best == plan.mbs  # the plan follows the model, not the clock
    rows = table(x).splitlines()
    assert "loop (measured)" in rows[0] and len(rows) == 2 + len(x.candidates) + 1
    assert [row.split()[0] for row in rows[2:-1]] == [str(c.mbs) for c in x.candidates]
    assert all(p.grad is None for p in model.parameters())  # autograd.grad, not .backward


@pytest.mark.parametrize("clock,fastest", [
    (lambda m: 1.0, 16),    # a fixed cost per microbatch: fewest microbatches win
    (lambda m: m * m, 4),   # cost grows faster than the samples: smallest wins
])
def test_measured_best_is_what_the_clock_says_and_the_plan_what_the_model_says(
        costs, clock, fastest) -> None:
    cost, _, _ = costs["mlp"]
    modelled = Selector(cost, get_system("host"), split(16, 1))
    model_best = make_plan(16, 1, {"explore": {"min": 4}}, explorer=modelled.explore).mbs
    sel = Selector(cost, get_system("host"), split(16, 1), timer=clock)
    plan = make_plan(16, 1, {"explore": {"min": 4}}, explorer=sel.explore)
    x = sel.exploration
    # candidates 4, 6, 8, 16: the loop is 16 samples as 4x4, 6+5+5, 2x8 or 1x16
    want = {4: 4 * clock(4), 6: clock(6) + 2 * clock(5), 8: 2 * clock(8), 16: clock(16)}
    assert {c.mbs: c.measured_loop_s for c in x.candidates} == want
    assert x.measured_best == fastest
    assert plan.mbs == x.best == model_best
    assert (f"mbs={fastest} was fastest" in plan.reason) == (fastest != model_best)


def test_a_deferred_cost_model_that_fails_is_planned_without() -> None:
    """The search builds the model on its first question; a build that fails plans as
    ``cost=None`` does (auto warns, compile_only refuses), a later failure is raised."""
    model, batch = make_mlp(8)
    host = get_system("host")

    def broken() -> CostModel:
        cost = analyse_cost(model, batch, (0, 0), pbs=16, lazy=True)
        assert cost.probes_run == 0  # nothing probed until asked
        cost._prober = None  # cannot probe: its build raises CostModelError
        return cost

    with pytest.warns(CostModelWarning, match="could not run.*cannot probe"):
        s = select_plan(split(32, 2), parse_mbs("auto"), broken(), host)
    assert s.cost is None and s.estimate is None and "cannot probe" in (s.cost_error or "")
    with pytest.raises(CostModelError, match="compile_only=True with mbs='auto'"):
        select_plan(split(32, 2), parse_mbs("auto"), broken(), host, compile_only=True)
    built = analyse_cost(model, batch, (0, 0), pbs=16, fit=False, lazy=True)  # m=16 only
    assert select_plan(split(32, 2), parse_mbs("none"), built, host).estimate is not None
    assert built.probes_run == 1 and built.build_error is None
    built._prober = None  # built: a question it cannot answer is an error, not a fallback
    with pytest.raises(CostModelError, match="cannot probe"):
        select_plan(split(32, 2), parse_mbs(5), built, host)


def test_without_a_cost_model_auto_warns_and_explore_fails(costs) -> None:
    host = get_system("host")
    with pytest.warns(CostModelWarning, match="could not run"):
        s = select_plan(split(32, 2), parse_mbs("auto"), None, host, cost_error="boom")
    assert s.plan.num_microbatches == 4 and "boom" in s.plan.reason
    with pytest.raises(CostModelError, match="boom"):
        select_plan(split(32, 2), parse_mbs("explore"), None, host, cost_error="boom")
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        chosen = select_plan(split(32, 2), parse_mbs(4), None, host, cost_error="boom")
        assert chosen.estimate is None


# --------------------------------------------------------------------------- #
# Through compile()
# --------------------------------------------------------------------------- #


def test_compile_only_plans_estimates_and_refuses_to_run() -> None:
    model, batch = make_tiny_gpt(8)
    cm = mbcompile.compile(model, 64, 2, "auto", system="a100-40gb", compile_only=True,
                           example_inputs=batch)
    assert cm.compile_only and cm.estimate.memory.fits and cm.system.name == "a100-40gb"
    with pytest.raises(CompileOnlyError, match="compile_only=True.*compile again"):
        cm(*make_tiny_gpt(64)[1])
    text = cm.report()
    assert isinstance(text, Report) and isinstance(text, str)
    for word in ("plan: mbs", "why: auto on a100-40gb", "memory (modelled", "time (modelled",
                 "cost model:", "candidates auto evaluated"):
        assert word in text, text
    data = json.loads(cm.report("json"))
    assert data["plan"]["mbs"] == cm.plan.mbs and data["status"] == "compile_only"
    assert data["estimate"]["memory"]["peak"] == cm.estimate.memory.peak
    assert text.to_dict() == data


def test_compile_explores_and_reports_the_value_to_pin(tmp_path) -> None:
    model, batch = make_cnn(8)
    with pytest.raises(PlanError, match="compile_only=True"):
        mbcompile.compile(model, 48, 2, "explore", example_inputs=batch)
    cm = mbcompile.compile(model, 48, 2, {"explore": {"max": 12}}, compile_only=True,
                           system=get_system("h100-80gb"), example_inputs=batch)
    assert cm.exploration.mode == "explore" and cm.plan.mbs == cm.exploration.best
    assert f"pin: compile again with mbs={cm.plan.mbs}" in cm.report()
    assert json.loads(cm.report("json"))["pin"] == cm.plan.mbs
    plot(cm.exploration, tmp_path / "x.png")


def test_compile_runs_with_the_plan_it_reports() -> None:
    model, batch = make_mlp(16)
    cm = mbcompile.compile(model, 16, 2, 4, example_inputs=batch, measure=2)
    loss, _ = cm(*batch)
    loss.backward()
    assert cm.estimate.mbs == 4 and cm.exploration.measured
    assert cm.exploration.candidate(4).measured_loop_s > 0


def test_compile_fails_with_numbers_when_none_does_not_fit() -> None:
    model, batch = make_tiny_gpt(8)
    small = SystemSpec("small", memory_bytes=2e6, peak_flops=1e12, peak_flops_fp32=1e12,
                       memory_bandwidth=1e11)
    with pytest.raises(DoesNotFitError, match="mbs='none'.*does not fit on system 'small'"):
        mbcompile.compile(model, 64, 1, "none", system=small, example_inputs=batch)
    cm = mbcompile.compile(model, 64, 1, "auto", system=small, example_inputs=batch)
    assert cm.estimate.memory.peak <= 2e6 < cm.selection.cost.estimate(
        64, 1, 64, small).memory.peak


def test_validate_only_stops_after_analysis() -> None:
    model, batch = make_tiny_gpt(8)
    v = mbcompile.compile(model, 64, 2, "explore", validate_only=True, example_inputs=batch)
    assert isinstance(v, Validation)  # a Validation is only returned when validation passes
    assert dict(v.facts)["Batched"] > 10 and "can be microbatched" in v.report()
    assert json.loads(v.report("json"))["status"] == "validated"


def test_validate_only_still_rejects_mixing_and_accepts_an_unsplit_run() -> None:
    """With coupling='reject'; the default validates the same model as a two-phase step."""
    class SoftmaxOverBatch(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.lin = nn.Linear(4, 4)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return torch.softmax(self.lin(x), dim=0).square().mean()

    x = torch.randn(8, 4)
    with pytest.raises(mbcompile.MixingError):
        mbcompile.compile(SoftmaxOverBatch(), 8, 1, 2, validate_only=True, example_inputs=(x,),
                          coupling="reject")
    v = mbcompile.compile(SoftmaxOverBatch(), 8, 1, "none", validate_only=True,
                          example_inputs=(x,), coupling="reject")
    assert "runs unsplit" in v.report() and "one microbatch" in v.note
    # By default the mixing model validates as a two-phase step, whatever the MBS.
    v = mbcompile.compile(SoftmaxOverBatch(), 8, 1, 2, validate_only=True, example_inputs=(x,))
    assert isinstance(v, Validation) and v.two_phase and "as a two-phase step" in v.report()
    cm = mbcompile.compile(SoftmaxOverBatch(), 8, 1, "none", example_inputs=(x,))
    assert cm.plan.num_microbatches == 1 and cm.estimate is not None


# --------------------------------------------------------------------------- #
# cost_model=False: a plan without the memory model, for runs that need none
# --------------------------------------------------------------------------- #


@pytest.mark.parametrize("mbs", [4, "none"])
def test_without_the_cost_model_nothing_is_probed(monkeypatch, mbs) -> None:
    """The plan is the arithmetic one, no fake-tensor probe runs, and the module computes
    what eager does (the option drops the estimate, never exactness)."""
    from mbcompile.planning import probe

    def refuse(self: Any, m: int) -> Any:
        raise AssertionError("a probe ran with cost_model=False")

    monkeypatch.setattr(probe.Prober, "__call__", refuse)
    model, batch = make_tiny_gpt(8)
    cm = mbcompile.compile(model, 8, 2, mbs, example_inputs=batch, cost_model=False)
    assert cm.plan == replace(make_plan(8, 2, mbs), tokens_per_sample=cm.plan.tokens_per_sample)
    assert cm.estimate is None and cm.exploration is None
    assert "cost_model=False" in cm.report()
    out, ref = cm(*batch), model(*batch)
    torch.testing.assert_close(out[0], ref[0], rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("kwargs,match", [
    ({"mbs": "auto"}, "chooses the MBS"),
    ({"mbs": {"explore": {"min": 1}}, "compile_only": True}, "chooses the MBS"),
    ({"mbs": 4, "system": "host"}, "drop system="),
    ({"mbs": 4, "measure": True}, "drop measure="),
])
def test_without_the_cost_model_what_needs_it_is_refused(kwargs, match) -> None:
    model, batch = make_mlp(8)
    with pytest.raises(mbcompile.InputError, match=match):
        mbcompile.compile(model, 8, 2, example_inputs=batch, cost_model=False, **kwargs)
