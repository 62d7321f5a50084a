"""The forward fuzzer's tests (the fuzzer itself: ``tests/fuzz/``, whose docstring says what it
generates, the oracle, and how to run it longer)."""

from __future__ import annotations

import math
import os
from typing import Any

import pytest
from fuzz import CONSTRUCTS, EXTRAS, Spec, assert_ok, build, make_inputs, step_errors
from fuzz.base import Construct
from fuzz.oracle import _sgd
from hypothesis import HealthCheck, Phase, given, settings
from hypothesis import strategies as st

# 25 random combinations in CI (derandomized: the same ones every run), reported as found:
# shrinking a failure costs minutes here, and the per-construct tests below already give
# the small cases. MBCOMPILE_FUZZ_EXAMPLES=500 searches longer, with random seeds, shrinking,
# and torch_compile cases among the combinations.
_EXAMPLES = int(os.environ.get("MBCOMPILE_FUZZ_EXAMPLES", "25"))
_LONG = _EXAMPLES > 25
FUZZ = settings(max_examples=_EXAMPLES, deadline=None, derandomize=not _LONG, database=None,
                phases=(Phase.explicit, Phase.generate, Phase.shrink) if _LONG
                else (Phase.explicit, Phase.generate),
                suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])

# Constructs raise UserWarnings on purpose (deprecated legacy spectral_norm, recompiles):
# the oracle is the comparison, not the warnings.
pytestmark = pytest.mark.filterwarnings("ignore")


# --------------------------------------------------------------------------- #
# Tests
# --------------------------------------------------------------------------- #

#: each construct under: an uneven split (7 over 2 systems, MBS 2: microbatches of 2, 2 | 2, 1),
#: the same with a coupled term (a two-phase step), and recompute=True (which checkpoints
#: repeated blocks only, so the construct is followed by a second block; 9 over 2, MBS 3)
COMBINATIONS = {
    "split": lambda name: Spec((name,)),
    "two_phase": lambda name: Spec((name,), coupled=True),
    "recompute": lambda name: Spec((name, "plain"), recompute=True, gbs=9, mbs=3, loss="ce"),
}
#: recompute=True in CI for the constructs whose recomputation in backward can differ from
#: their forward (state they write, draws, hooks, grad and autocast modes, power iterations);
#: every construct with MBCOMPILE_FUZZ_EXAMPLES set (the time budget of the default run)
RECOMPUTED = list(CONSTRUCTS) if _LONG else [
    "plain", "no_grad_teacher", "inference_mode", "enable_grad_nested", "autocast_bf16",
    "tensor_hook_linear", "tensor_hook_clamp", "forward_hook_inner", "attr_beta",
    "buffer_counter", "buffer_counter_read", "ema_center_before", "ema_param_loop",
    "ema_param_attr", "input_write", "generator_noise", "generator_shared", "spectral_norm",
    "spectral_norm_legacy", "global_rand", "generator_randperm", "generator_twice",
    "param_hook_linear", "generator_in_place", "global_in_place", "private_counter",
    "logs_stats", "global_counter", "global_log", "helper_writes", "global_generator",
    "closure_factor"]
CASES = [(name, combination) for name in CONSTRUCTS for combination in COMBINATIONS
         if combination != "recompute" or name in RECOMPUTED]

#: What this fuzzer found that is still open (issue 35), each a strict xfail: it must start
#: passing when fixed, and then its line goes. The random combinations leave these out.
OPEN: dict[str, str] = {
}
OPEN_CASES: dict[tuple[str, str], str] = {}


def _case(name: str, combination: str) -> Any:
    why = OPEN_CASES.get((name, combination), OPEN.get(name))
    marks = [pytest.mark.xfail(strict=True, reason=why)] if why else []
    return pytest.param(name, combination, marks=marks, id=f"{name}-{combination}")


@pytest.mark.parametrize(("construct", "combination"), [_case(n, c) for n, c in CASES])
def test_each_construct_is_exact_or_refused(construct, combination):
    outcome = assert_ok(COMBINATIONS[combination](construct))
    # a fuzz that refuses everything checks nothing: the control must be compared
    assert construct != "plain" or outcome.status == "compared", outcome


@pytest.mark.parametrize("coupled", [False, True], ids=["split", "two_phase"])
@pytest.mark.parametrize("extra", list(EXTRAS))
def test_each_extra_output_is_exact_or_refused(extra, coupled):
    """Compiled from an example batch of 3, run on 7 over 3 systems, MBS 1."""
    assert_ok(Spec(("plain",), extras=(extra,), coupled=coupled, num_csx=3, mbs=1,
                   example_batch=3))


MUTATING = [n for n, c in CONSTRUCTS.items()
            if c.mutate is not Construct.mutate and not c.mutation_only_observes]


@pytest.mark.parametrize("construct", MUTATING)
def test_each_mutation_changes_what_eager_computes(construct):
    """The fuzzer's own check: a state change that eager ignores would test no guard. Two
    identical eager models take a step; one is mutated; their second steps must differ by
    far more than the comparison's tolerance."""
    spec = Spec((construct,))
    model, ref = build(spec), build(spec)
    inputs = make_inputs(spec)
    step_errors(model, model, ref, inputs, seed=1)
    for m in (model, ref):
        _sgd(m)
    for block in model.blocks:
        block.mutate(model)
    errors = step_errors(model, model, ref, inputs, seed=2)
    largest = max(errors.values())
    assert largest > 10 * spec.rel, f"mutating {construct} changed nothing eager computes"


#: torch.compile (aot_eager) is slow (seconds per compile): one fixed case in CI, more among
#: the random combinations with MBCOMPILE_FUZZ_EXAMPLES set
TORCH_COMPILE_CASES = [
    Spec(("no_grad_teacher", "tensor_hook_linear", "forward_hook_leaf", "attr_beta"),
         torch_compile=True, coupled=True, num_csx=3, mbs=1, loss="ce"),
    Spec(("generator_noise", "global_rand", "generator_twice"), torch_compile=True, mbs=2),
    Spec(("global_log", "global_counter", "helper_global"), torch_compile=True, coupled=True),
]


@pytest.mark.slow
@pytest.mark.parametrize("spec", TORCH_COMPILE_CASES, ids=lambda s: "+".join(s.constructs))
def test_torch_compile_cases(spec):
    assert_ok(spec)


#: the random combinations draw from every construct but the open ones (their cases above),
#: and the dropouts: S8, once export captures them (fx fails on another construct), dropout
#: is aten.native_dropout, which draws a mask even at p=0 or 1 where eager draws none:
#: equal values, another global RNG stream (DESIGN.md's exception for random draws)
RANDOM_CONSTRUCTS = [n for n in CONSTRUCTS if n not in OPEN and not n.startswith("dropout")]


@st.composite
def specs(draw: Any, torch_compile: bool = _LONG) -> Spec:
    gbs = draw(st.integers(5, 9))
    num_csx = draw(st.integers(1, 3))
    pbs = math.ceil(gbs / num_csx)
    return Spec(
        # a prefix of a permutation: every construct about equally often (sampled_from favours
        # the first entries of a list), none twice
        constructs=tuple(draw(st.permutations(RANDOM_CONSTRUCTS))[:draw(st.integers(1, 4))]),
        gbs=gbs, num_csx=num_csx, mbs=draw(st.integers(1, pbs)),
        loss=draw(st.sampled_from(["mse", "ce"])),
        extras=tuple(draw(st.lists(st.sampled_from(list(EXTRAS)), max_size=2, unique=True))),
        coupled=draw(st.booleans()),
        recompute=draw(st.sampled_from(["auto", True])),
        # about one example in 12 (a middle value: hypothesis favours the ends of a range)
        torch_compile=torch_compile and draw(st.integers(0, 11)) == 6,
        example_batch=draw(st.sampled_from([None, 3])),
        seed=draw(st.integers(0, 3)),
    )


#: Found by the random combinations, each once silently wrong, now exact or refused:
#: F1, a leaf's full backward hook that centres the gradient over the batch, next to a
#: legacy spectral_norm layer; F5, a leaf's backward hook halving its input's gradient next
#: to an in-place EMA of a buffer. Both made fx fail and torch.export capture the model,
#: which traced without the backward hook (``passes/export_hooks.py`` refuses that now);
#: F8, a private counter next to a hook on the model itself, which sends the capture to
#: torch.export: export put back ``self._step`` before the snapshot saw it move, and it
#: stayed 0 (``Snapshot.unseen_assignments`` replays it now).
FOUND = {
    "F1": Spec(("spectral_norm_legacy", "backward_hook_mixing"), gbs=9, mbs=2, loss="ce",
               seed=2),
    "F5": Spec(("hook_added_leaf", "backward_hook_leaf", "ema_center_before"), gbs=8, mbs=7,
               loss="ce", extras=("view_slice", "view_t"), coupled=True, example_batch=3),
    "F8": Spec(("private_counter", "root_forward_hook"), gbs=5, num_csx=1, mbs=1),
}


#: every construct under every combination, torch_compile included (``-m zoo``: minutes)
SWEEP = {**COMBINATIONS, "torch_compile": lambda name: Spec((name,), torch_compile=True)}


@pytest.mark.slow
@pytest.mark.zoo
@pytest.mark.parametrize("combination", list(SWEEP))
@pytest.mark.parametrize("construct", list(CONSTRUCTS))
def test_every_construct_under_every_combination(construct, combination):
    assert_ok(SWEEP[combination](construct))


def test_the_fuzzer_reports_what_it_covers():
    """What it runs, printed (``-s``): constructs, and the combinations of each test."""
    counts = {"constructs": len(CONSTRUCTS), "extras": len(EXTRAS),
              "construct cases in CI": len(CASES), "extra-output cases": 2 * len(EXTRAS),
              "torch_compile cases (slow)": len(TORCH_COMPILE_CASES), "found": len(FOUND),
              "random combinations": _EXAMPLES,
              "full sweep (-m zoo)": len(CONSTRUCTS) * len(SWEEP)}
    print("forward fuzzer:", ", ".join(f"{v} {k}" for k, v in counts.items()))
    assert {n for n, _ in CASES} == set(CONSTRUCTS)  # every construct split and two-phase
    assert all((n, c) in CASES for n in CONSTRUCTS for c in ("split", "two_phase"))


@pytest.mark.parametrize("name", FOUND)
def test_found_combinations_are_exact_or_refused(name):
    assert_ok(FOUND[name])


@FUZZ
@given(spec=specs())
def test_random_combinations_are_exact_or_refused(spec):
    assert_ok(spec)
