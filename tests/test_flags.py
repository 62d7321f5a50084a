"""Flags: both key spellings, scopes that do not leak, restore after an exception."""

from __future__ import annotations

import pytest

from mbcompile.errors import MbcompileError
from mbcompile.training.flags import (
    FlagError,
    Flags,
    GlobalFlags,
    ScopedTrainFlags,
    ScopedValidateFlags,
    normalize_flags,
)

PATH = "csx.performance.micro_batch_size"


@pytest.mark.parametrize("values", [
    {"micro_batch_size": 4},
    {PATH: 4},
    {"csx": {"performance": {"micro_batch_size": 4}}},  # the path nested, as YAML writes it
    {"micro_batch_size": 4, PATH: 4},  # both spellings, same value
])
def test_both_spellings_mean_the_same_flag(values):
    assert normalize_flags(values) == {"micro_batch_size": 4}


@pytest.mark.parametrize("cls", [GlobalFlags, ScopedTrainFlags, ScopedValidateFlags])
def test_callbacks_take_keywords_or_a_mapping(cls):
    assert cls(micro_batch_size="auto").flags == {"micro_batch_size": "auto"}
    assert cls({PATH: 2}).flags == {"micro_batch_size": 2}
    assert cls(**{PATH: "none"}).flags == {"micro_batch_size": "none"}
    assert cls(micro_batch_size={"explore": {"min": 2}}).flags["micro_batch_size"] == \
        {"explore": {"min": 2}}


@pytest.mark.parametrize("values, message", [
    ({"micro_batch_sise": 4}, "did you mean 'micro_batch_size'"),
    ({"csx.performance.micro_batch_sze": 4}, f"did you mean '{PATH}'"),
    ({"micro_batch_size": 4, PATH: 8}, "given twice with different values"),
    ({"micro_batch_size": "atuo"}, "unknown mbs 'atuo'"),
    ({"micro_batch_size": 0}, "positive int"),
    ({"micro_batch_size": 2.5}, "must be a positive int"),
])
def test_bad_flags_are_rejected_with_the_way_out(values, message):
    with pytest.raises(FlagError, match=message):
        normalize_flags(values)
    with pytest.raises(MbcompileError):  # also at construction, before any run
        GlobalFlags(values)


def test_scopes_override_globals_and_restore():
    flags = Flags()
    assert flags.micro_batch_size == "auto"  # the default
    flags.set_global({PATH: 2})
    with flags.scope({"micro_batch_size": 4}):
        assert flags.micro_batch_size == 4
        assert flags[PATH] == 4
        with flags.scope():  # a nested phase starts from the globals, not from its parent
            assert flags.micro_batch_size == 2
            flags.update_scope({"micro_batch_size": 8})
            assert flags.micro_batch_size == 8
        assert flags.micro_batch_size == 4
    assert flags.micro_batch_size == 2
    assert flags.depth == 0


def test_scope_is_restored_when_the_phase_raises():
    flags = Flags()
    flags.set_global({"micro_batch_size": 2})
    with pytest.raises(RuntimeError, match="boom"):
        with flags.scope({"micro_batch_size": 4}):
            with flags.scope({"micro_batch_size": 8}):
                raise RuntimeError("boom")
    assert flags.snapshot() == {"micro_batch_size": 2}
    assert flags.depth == 0


def test_scoped_flags_need_an_open_phase():
    with pytest.raises(FlagError, match="open phase"):
        Flags().update_scope({"micro_batch_size": 4})


def test_repr_names_the_values():
    assert repr(ScopedTrainFlags(micro_batch_size=4)) == "ScopedTrainFlags(micro_batch_size=4)"
