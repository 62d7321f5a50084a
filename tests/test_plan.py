"""Plan arithmetic: exhaustive small cases, the documented examples, errors, properties."""

from __future__ import annotations

import dataclasses
import json
import math
import subprocess
import sys
import textwrap
import warnings
from pathlib import Path

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from mbcompile.errors import ArgumentTypeError, MbsAdjustedWarning, PlanError
from mbcompile.planning.plan import (
    DEFAULT_AUTO_MICROBATCHES,
    MbsPolicy,
    MicrobatchPlan,
    closest_supported,
    make_plan,
    parse_mbs,
    per_system_batch_sizes,
    split_evenly,
    supported_mbs,
)

PLAN_FILE = Path(__file__).resolve().parent.parent / "mbcompile" / "planning" / "plan.py"


def naive_supported(pbs: int) -> tuple[int, ...]:
    return tuple(sorted({math.ceil(pbs / k) for k in range(1, pbs + 1)}))


def check_plan(plan: MicrobatchPlan, gbs: int, num_csx: int, requested: object) -> None:
    """Every invariant a plan must satisfy, whatever the request."""
    pbs = math.ceil(gbs / num_csx)
    sizes = plan.per_system_batch_sizes
    assert (plan.gbs, plan.num_csx, plan.pbs) == (gbs, num_csx, pbs)
    # Systems: balanced, larger first, summing to gbs.
    assert len(sizes) == num_csx
    assert sum(sizes) == gbs
    assert max(sizes) - min(sizes) <= 1
    assert list(sizes) == sorted(sizes, reverse=True)
    assert min(sizes) >= 1
    # MBS: supported, and actually reached by the largest microbatch.
    assert plan.supported_mbs == naive_supported(pbs)
    assert plan.mbs in plan.supported_mbs
    assert 1 <= plan.mbs <= pbs
    assert plan.num_microbatches == math.ceil(pbs / plan.mbs)
    assert plan.max_microbatch_size == plan.mbs
    # Microbatches: same count everywhere, balanced within a system, never over mbs.
    assert len(plan.microbatch_sizes) == num_csx
    for system_size, mb in zip(sizes, plan.microbatch_sizes, strict=True):
        assert len(mb) == plan.num_microbatches
        assert sum(mb) == system_size
        assert max(mb) - min(mb) <= 1
        assert max(mb) <= plan.mbs
        assert min(mb) >= 0
    assert plan.num_nonempty_microbatches == sum(
        1 for mb in plan.microbatch_sizes for s in mb if s > 0
    )
    # Slices tile 0..gbs in order, one per microbatch, matching the sizes.
    position = 0
    for mb, slices in zip(plan.microbatch_sizes, plan.microbatch_slices, strict=True):
        assert len(slices) == len(mb)
        for size, (start, stop) in zip(mb, slices, strict=True):
            assert start == position
            assert stop - start == size
            position = stop
    assert position == gbs
    # What the request asked for.
    if isinstance(requested, int):
        assert plan.requested_mbs == requested
        expected = closest_supported(requested, plan.supported_mbs)
        assert plan.mbs == expected
        assert len(plan.warnings) == (0 if expected == requested else 1)
    elif requested == "none":
        assert (plan.mbs, plan.num_microbatches) == (pbs, 1)
    elif requested == "auto":
        assert plan.mbs == math.ceil(pbs / min(DEFAULT_AUTO_MICROBATCHES, pbs))
        assert plan.num_microbatches <= DEFAULT_AUTO_MICROBATCHES
    if requested in ("none", "auto"):
        assert plan.warnings == ()


# --------------------------------------------------------------------------- #
# Exhaustive small cases
# --------------------------------------------------------------------------- #


def test_exhaustive_small_configurations() -> None:
    count = 0
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", MbsAdjustedWarning)
        for gbs in range(1, 65):
            for num_csx in range(1, min(8, gbs) + 1):
                pbs = math.ceil(gbs / num_csx)
                for mbs in [*range(1, pbs + 1), "none", "auto"]:
                    check_plan(make_plan(gbs, num_csx, mbs), gbs, num_csx, mbs)
                    count += 1
    assert count > 5000  # the loops really ran


def test_exhaustive_supported_mbs_matches_naive() -> None:
    for pbs in range(1, 2001):
        assert supported_mbs(pbs) == naive_supported(pbs)


def test_supported_mbs_is_fast_for_large_pbs() -> None:
    # O(sqrt): about 2 * sqrt(1e6) values, computed without a loop to 1e6.
    result = supported_mbs(10**6)
    assert result == naive_supported(10**6)
    assert len(result) < 2 * 1000 + 1


# --------------------------------------------------------------------------- #
# The documented examples
# --------------------------------------------------------------------------- #


def test_gbs10_over_3_systems_mbs2() -> None:
    plan = make_plan(10, 3, 2)
    assert plan.per_system_batch_sizes == (4, 3, 3)
    assert (plan.pbs, plan.mbs, plan.num_microbatches) == (4, 2, 2)
    assert plan.microbatch_sizes == ((2, 2), (2, 1), (2, 1))
    assert plan.microbatch_slices == (
        ((0, 2), (2, 4)),
        ((4, 6), (6, 7)),
        ((7, 9), (9, 10)),
    )
    assert plan.warnings == ()


def test_gbs673_mbs168_is_adjusted_to_169_with_a_warning() -> None:
    with pytest.warns(MbsAdjustedWarning) as record:
        plan = make_plan(673, 2, 168)
    assert (plan.pbs, plan.mbs, plan.num_microbatches) == (337, 169, 2)
    assert plan.requested_mbs == 168
    assert plan.microbatch_sizes == ((169, 168), (168, 168))
    assert len(record) == 1
    message = str(record[0].message)
    assert plan.warnings == (message,)
    assert "mbs=168" in message
    assert "mbs=169" in message
    assert "113" in message
    assert "337" in message
    # The warning points at the caller, not at mbcompile's internals.
    assert record[0].filename == __file__


def test_gbs240_mbs121_is_an_error_naming_the_limit() -> None:
    with pytest.raises(PlanError) as excinfo:
        make_plan(240, 2, 121)
    message = str(excinfo.value)
    assert "mbs=121 must be at most the per-system batch size 120" in message
    assert "gbs 240 over 2 systems" in message
    assert "mbs=120" in message  # the fix


def test_gbs5_over_4_systems_has_empty_microbatches() -> None:
    plan = make_plan(5, 4, 1)
    assert plan.pbs == 2
    assert plan.per_system_batch_sizes == (2, 1, 1, 1)
    assert plan.microbatch_sizes == ((1, 1), (1, 0), (1, 0), (1, 0))
    assert plan.num_nonempty_microbatches == 5
    assert plan.microbatch_slices == (
        ((0, 1), (1, 2)),
        ((2, 3), (3, 3)),
        ((3, 4), (4, 4)),
        ((4, 5), (5, 5)),
    )


def test_supported_mbs_of_10() -> None:
    # ceil(10/k) for k = 1, 2, 3, 4, 5..9, 10; 3 is in (k = 4: sizes 3, 3, 2, 2).
    assert supported_mbs(10) == (1, 2, 3, 4, 5, 10)
    assert make_plan(10, 1, 3).microbatch_sizes == ((3, 3, 2, 2),)


def test_closest_supported_ties_go_to_the_smaller() -> None:
    assert closest_supported(4, (1, 2, 3, 5, 9)) == 3
    assert closest_supported(3, (2, 4)) == 2
    assert closest_supported(3, (4, 2)) == 2  # order of the input does not matter
    assert closest_supported(7, (1, 2, 3, 5, 9)) == 5
    assert closest_supported(8, (1, 2, 3, 5, 9)) == 9
    assert closest_supported(5, (1, 2, 3, 5, 9)) == 5


def test_split_evenly() -> None:
    assert split_evenly(10, 3) == (4, 3, 3)
    assert split_evenly(1, 3) == (1, 0, 0)
    assert split_evenly(0, 2) == (0, 0)
    assert split_evenly(6, 3) == (2, 2, 2)


def test_per_system_batch_sizes() -> None:
    assert per_system_batch_sizes(10, 3) == (4, 3, 3)
    assert per_system_batch_sizes(3, 3) == (1, 1, 1)
    assert per_system_batch_sizes(7, 1) == (7,)


# --------------------------------------------------------------------------- #
# Modes, chooser and explorer
# --------------------------------------------------------------------------- #


def test_none_is_one_microbatch_per_system() -> None:
    plan = make_plan(10, 3, "none")
    assert (plan.mbs, plan.num_microbatches) == (4, 1)
    assert plan.microbatch_sizes == ((4,), (3,), (3,))
    assert plan.requested_mbs == "none"


def test_auto_default_rule() -> None:
    plan = make_plan(673, 2)
    assert plan.requested_mbs == "auto"
    assert (plan.mbs, plan.num_microbatches) == (85, 4)
    assert "4" in plan.reason
    assert "ceil(337 / 4)" in plan.reason
    tiny = make_plan(3, 1, "auto")
    assert (tiny.mbs, tiny.num_microbatches) == (1, 3)


def test_auto_uses_the_chooser() -> None:
    seen = []

    def chooser(pbs: int, supported: tuple[int, ...]) -> tuple[int, str]:
        seen.append((pbs, supported))
        return supported[-2], "cost model says so"

    plan = make_plan(20, 2, "auto", chooser=chooser)
    assert seen == [(10, (1, 2, 3, 4, 5, 10))]
    assert (plan.mbs, plan.reason) == (5, "cost model says so")


def test_a_chooser_returning_an_unsupported_mbs_is_an_error() -> None:
    with pytest.raises(PlanError, match="auto chooser returned mbs=6"):
        make_plan(20, 2, "auto", chooser=lambda pbs, s: (6, "bad"))


def test_explore_without_explorer_is_an_error() -> None:
    for mbs in ("explore", {"explore": {"min": 2, "max": 4}}):
        with pytest.raises(PlanError, match="compile_only"):
            make_plan(20, 2, mbs)


def test_explore_passes_the_range_restricted_to_supported_values() -> None:
    seen = []

    def explorer(pbs: int, candidates: tuple[int, ...]) -> tuple[int, str]:
        seen.append(candidates)
        return candidates[0], "fastest that fits"

    plan = make_plan(20, 2, "explore", explorer=explorer)
    assert seen[-1] == (1, 2, 3, 4, 5, 10)
    assert (plan.mbs, plan.reason) == (1, "fastest that fits")

    plan = make_plan(20, 2, {"explore": {"min": 3, "max": 9}}, explorer=explorer)
    assert seen[-1] == (3, 4, 5)
    assert plan.mbs == 3
    assert plan.requested_mbs == repr({"explore": {"min": 3, "max": 9}})
    hash(plan)  # a mapping request is stored in a hashable form

    make_plan(20, 2, {"explore": {"max": 4}}, explorer=explorer)
    assert seen[-1] == (1, 2, 3, 4)


def test_explore_range_is_clamped_to_pbs_with_a_warning() -> None:
    with pytest.warns(MbsAdjustedWarning, match="clamped"):
        plan = make_plan(20, 2, {"explore": {"min": 50}}, explorer=lambda p, c: (c[0], "x"))
    assert plan.mbs == 10
    assert len(plan.warnings) == 1


def test_explore_range_without_supported_values_is_an_error() -> None:
    with pytest.raises(PlanError, match=r"no supported mbs in the explore range \[6, 9\]"):
        make_plan(20, 2, {"explore": {"min": 6, "max": 9}}, explorer=lambda p, c: (c[0], ""))


def test_explorer_must_stay_inside_the_range() -> None:
    with pytest.raises(PlanError, match="explorer returned mbs=10"):
        make_plan(20, 2, {"explore": {"max": 5}}, explorer=lambda p, c: (10, ""))


def test_parse_mbs_valid_forms() -> None:
    assert parse_mbs(8) == MbsPolicy("int", 8)
    assert parse_mbs("auto") == MbsPolicy("auto")
    assert parse_mbs("none") == MbsPolicy("none")
    assert parse_mbs("explore") == MbsPolicy("explore")
    assert parse_mbs({"explore": {}}) == MbsPolicy("explore")
    assert parse_mbs({"explore": {"min": 2, "max": 2}}) == MbsPolicy("explore", None, 2, 2)
    assert parse_mbs({"explore": {"max": 7}}) == MbsPolicy("explore", None, None, 7)


def test_numpy_integers_are_accepted() -> None:
    np = pytest.importorskip("numpy")
    plan = make_plan(np.int64(10), np.int32(3), np.int64(2))
    assert plan.microbatch_sizes == ((2, 2), (2, 1), (2, 1))
    assert type(plan.gbs) is int
    assert type(plan.mbs) is int
    json.dumps(plan.to_dict())


# --------------------------------------------------------------------------- #
# Errors
# --------------------------------------------------------------------------- #


@pytest.mark.parametrize("name", ["gbs", "num_csx"])
@pytest.mark.parametrize(
    ("value", "error"),
    [
        (0, PlanError),
        (-3, PlanError),
        (True, ArgumentTypeError),
        (2.0, ArgumentTypeError),
        ("8", ArgumentTypeError),
        (None, ArgumentTypeError),
    ],
)
def test_bad_gbs_or_num_csx(name: str, value: object, error: type[Exception]) -> None:
    args = {"gbs": 8, "num_csx": 2, name: value}
    for call in (
        lambda: make_plan(args["gbs"], args["num_csx"], 1),
        lambda: per_system_batch_sizes(args["gbs"], args["num_csx"]),
    ):
        with pytest.raises(error) as excinfo:
            call()
        assert isinstance(excinfo.value, ValueError if error is PlanError else TypeError)
        assert name in str(excinfo.value)
        assert repr(value) in str(excinfo.value)


def test_gbs_smaller_than_num_csx() -> None:
    with pytest.raises(PlanError) as excinfo:
        make_plan(3, 4, 1)
    message = str(excinfo.value)
    assert "gbs=3" in message
    assert "num_csx=4" in message
    assert "each system needs at least one sample" in message
    assert "gbs >= 4" in message
    assert "num_csx <= 3" in message


@pytest.mark.parametrize(
    ("mbs", "error", "fragment"),
    [
        (0, PlanError, "got 0"),
        (-2, PlanError, "got -2"),
        (2.0, ArgumentTypeError, "float"),
        (True, ArgumentTypeError, "bool"),
        (None, ArgumentTypeError, "NoneType"),
        ([4], ArgumentTypeError, "list"),
        ("bogus", PlanError, "'auto', 'explore', 'none'"),
        ("AUTO", PlanError, "did you mean 'auto'"),
        ({"explore": {"min": 5, "max": 2}}, PlanError, "min 5 is larger than max 2"),
        ({"explore": 3}, PlanError, "must be a mapping"),
        ({"bogus": 1}, PlanError, "single key 'explore'"),
        ({"explore": {"min": 0}}, PlanError, "min must be at least 1"),
        ({"explore": {"max": 2.5}}, PlanError, "max must be an int"),
        ({"explore": {"min": True}}, PlanError, "min must be an int"),
        ({"explore": {"mn": 2}}, PlanError, "unknown key"),
    ],
)
def test_bad_mbs(mbs: object, error: type[Exception], fragment: str) -> None:
    for call in (lambda: parse_mbs(mbs), lambda: make_plan(16, 2, mbs)):
        with pytest.raises(error) as excinfo:
            call()
        assert isinstance(excinfo.value, ValueError if error is PlanError else TypeError)
        message = str(excinfo.value)
        assert "mbs" in message
        assert fragment in message
        if isinstance(mbs, dict):
            assert "{'explore': {'min': a, 'max': b}}" in message  # the valid form
        if error is ArgumentTypeError:
            assert repr(mbs) in message


def test_helpers_reject_bad_types() -> None:
    with pytest.raises(ArgumentTypeError, match="pbs"):
        supported_mbs(2.0)  # type: ignore[arg-type]
    with pytest.raises(PlanError, match="pbs"):
        supported_mbs(0)
    with pytest.raises(ArgumentTypeError, match="parts"):
        split_evenly(4, 2.0)  # type: ignore[arg-type]
    with pytest.raises(PlanError, match="at least one"):
        closest_supported(3, ())


# --------------------------------------------------------------------------- #
# Output forms
# --------------------------------------------------------------------------- #


def test_str_is_a_readable_summary() -> None:
    assert str(make_plan(10, 3, 2)) == textwrap.dedent(
        """\
        MicrobatchPlan: gbs 10 over 3 systems
          per-system batch sizes: 4, 3, 3 (pbs 4)
          mbs: requested 2, effective 2
          microbatches per system: 2
            system 0: 2, 2
            systems 1-2: 2, 1
          reason: requested mbs=2
          warnings: none"""
    )


def test_str_shows_warnings_empties_and_long_runs_compactly() -> None:
    with pytest.warns(MbsAdjustedWarning):
        text = str(make_plan(673, 2, 168))
    assert "warnings:\n    - mbs=168 is not supported" in text
    text = str(make_plan(5, 4, 1))
    assert "systems 1-3: 1, 0 (1 empty, skipped)" in text
    text = str(make_plan(1000, 1, 3))  # 334 microbatches: run-length form
    assert "system 0: 334 x 3" not in text
    assert "system 0: 332 x 3 + 2 x 2" in text


def test_a_plan_over_many_systems_prints_one_line_per_schedule() -> None:
    """64 systems: 17 get 17 samples and 47 get 16; with mbs 4 every system runs 5
    microbatches, the sizes spread evenly (4, 4, 3, 3, 3 of 17; 4, 3, 3, 3, 3 of 16): two
    schedule lines, and the per-system sizes in run-length form."""
    text = str(make_plan(64 * 16 + 17, 64, 4))
    assert "per-system batch sizes: 17 x 17 + 47 x 16 (pbs 17)" in text
    assert "    systems 0-16: 4, 4, 3, 3, 3\n    systems 17-63: 4, 3, 3, 3, 3\n" in text
    assert len(text.splitlines()) == 8
    assert "    system 0: 2, 1\n    systems 1-2: 1, 1\n" in str(make_plan(7, 3, 2))


def test_to_dict_is_json_serialisable_and_complete() -> None:
    plan = make_plan(10, 3, 2)
    d = json.loads(json.dumps(plan.to_dict()))
    assert d["microbatch_sizes"] == [[2, 2], [2, 1], [2, 1]]
    assert d["per_system_batch_sizes"] == [4, 3, 3]
    assert d["pbs"] == 4
    for field in dataclasses.fields(MicrobatchPlan):
        assert field.name in d


def test_plan_is_frozen_and_hashable() -> None:
    plan = make_plan(10, 3, 2)
    with pytest.raises(dataclasses.FrozenInstanceError):
        plan.mbs = 3  # type: ignore[misc]
    assert hash(plan) == hash(make_plan(10, 3, 2))
    assert plan == make_plan(10, 3, 2)


# --------------------------------------------------------------------------- #
# Properties
# --------------------------------------------------------------------------- #


@st.composite
def configurations(draw: st.DrawFn) -> tuple[int, int, object]:
    num_csx = draw(st.integers(1, 16))
    gbs = draw(st.integers(num_csx, 256))
    pbs = math.ceil(gbs / num_csx)
    mbs = draw(st.one_of(st.integers(1, pbs), st.sampled_from(["auto", "none"])))
    return gbs, num_csx, mbs


@settings(max_examples=200, deadline=None)
@given(configurations())
def test_property_plan_invariants(config: tuple[int, int, object]) -> None:
    gbs, num_csx, mbs = config
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", MbsAdjustedWarning)
        plan = make_plan(gbs, num_csx, mbs)
    check_plan(plan, gbs, num_csx, mbs)


@settings(max_examples=200, deadline=None)
@given(st.integers(1, 5000))
def test_property_supported_mbs_matches_naive(pbs: int) -> None:
    assert supported_mbs(pbs) == naive_supported(pbs)


@settings(max_examples=200, deadline=None)
@given(st.integers(1, 10**6), st.integers(1, 10**6))
def test_property_int_mbs_resolves_to_supported(pbs: int, mbs: int) -> None:
    mbs = min(mbs, pbs)
    supported = supported_mbs(pbs)
    effective = closest_supported(mbs, supported)
    # A supported mbs is reproduced exactly by splitting pbs into ceil(pbs/mbs) parts.
    assert math.ceil(pbs / math.ceil(pbs / effective)) == effective
    assert (effective == mbs) == (mbs in supported)


# --------------------------------------------------------------------------- #
# Purity
# --------------------------------------------------------------------------- #


def test_plan_module_does_not_import_torch() -> None:
    # A fresh interpreter: `import mbcompile` loads nothing eagerly, plan.py imports only
    # the torch-free error types.
    script = textwrap.dedent(
        f"""
        import sys
        from mbcompile.planning import plan
        assert plan.__file__ == {str(PLAN_FILE)!r}, plan.__file__
        assert plan.make_plan(10, 3, 2).microbatch_sizes == ((2, 2), (2, 1), (2, 1))
        leaked = sorted(m for m in sys.modules if m == "torch" or m.startswith("torch."))
        assert not leaked, leaked
        print("ok")
        """
    )
    result = subprocess.run(
        [sys.executable, "-c", script], capture_output=True, text=True, timeout=60
    )
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip() == "ok"
