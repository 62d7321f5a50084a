"""Microbatches cut by tokens (issue 34, item 2): each call's split follows its length.

A module whose sequence length is symbolic chooses each call's MBS from the call's length:
``mbs="auto"`` the largest whose modelled peak at that length fits the system's memory
(a batch padded short runs in fewer microbatches than one padded long), a token budget
``mbs={"tokens": n}`` the most samples whose tokens fit ``n``; an int MBS keeps its
meaning. Every split is exact: each test steps against eager in float64 on the tiny GPT,
gbs 7 over 2 systems (4 and 3 samples: microbatches of 2, 2 and 2, 1 at mbs 2; at mbs 1
the smaller system's fourth is empty), comparing the loss, outputs, every gradient and
buffer (``step_errors``). Refusals change nothing (``unchanged``).
"""

from __future__ import annotations

import warnings
from typing import Any

import pytest
import token_split_workers
import torch
import torch.nn as nn
from models import TOL, assert_close_errors, rel_err, step_errors
from test_dynamic_shapes import unchanged

import mbcompile
from mbcompile.errors import CostModelWarning, DoesNotFitError, InputError, PlanError
from mbcompile.models import make_tiny_gpt, token_batch
from mbcompile.planning.length_split import auto_split, tokens_split
from mbcompile.planning.mbs_policy import parse_mbs
from mbcompile.planning.plan import supported_mbs
from mbcompile.planning.systems import SystemSpec

DTYPE = torch.float64
GBS, NUM_CSX, EXAMPLE = 7, 2, 12
#: the tiny GPT's step (Adam) on 1.5 MB: one microbatch of 4 fits up to ~23 tokens per
#: sample, two of 2 up to ~32, four of 1 up to ~58 (the modelled peaks, exact on this model)
BUDGET = SystemSpec("budget", memory_bytes=1.5e6, peak_flops=1e12, peak_flops_fp32=1e12,
                    memory_bandwidth=1e11, optimizer_bytes_per_param=8)


def _gpt(mbs: Any, **options: Any) -> tuple[nn.Module, Any]:
    model, (ids, labels) = make_tiny_gpt(GBS, dtype=DTYPE, seq=64)
    cm = mbcompile.compile(model, GBS, NUM_CSX, mbs, example_inputs=(
        ids[:, :EXAMPLE], labels[:, :EXAMPLE]), **options)
    return model, cm


def _step(model: nn.Module, cm: Any, length: int) -> Any:
    """One step at ``length`` against eager (every error <= TOL); the plan it ran."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # a length made symbolic warns once: its own tests
        assert_close_errors(step_errors(model, cm, token_batch(GBS, length, seed=length)), TOL)
    return cm.plan


# --------------------------------------------------------------------------- #
# mbs="auto" under a memory budget
# --------------------------------------------------------------------------- #


@pytest.mark.slow
def test_auto_cuts_each_call_by_its_length_exactly():
    model, cm = _gpt("auto", dynamic=True, system=BUDGET)
    plans, peaks = {}, {}
    for n in (8, 40, 28, 16, 24, EXAMPLE):
        plans[n] = _step(model, cm, n)
        peaks[n] = cm.estimate.memory.peak  # the figures shown are the call's length's
    # a batch padded short runs in fewer microbatches than one padded long
    assert plans[8].num_microbatches < plans[28].num_microbatches < plans[40].num_microbatches
    split, lengths = cm._split.split, cm._split.lengths
    for n, plan in plans.items():
        assert plan.mbs == split.mbs_at(n) and plan.tokens_per_sample == n
        # the largest MBS whose modelled peak at that length fits the budget
        fits = [m for m in plan.supported_mbs if lengths.at(n - EXAMPLE).memory(
            4, m, -(-4 // m), BUDGET).fits]
        assert plan.mbs == max(fits), (n, fits)
        assert peaks[n] == lengths.at(n - EXAMPLE).memory(
            4, plan.mbs, plan.num_microbatches, BUDGET).peak, n
    assert plans[24].mbs == plans[28].mbs and peaks[24] < peaks[28]  # one MBS, two lengths
    # one module per split, made once: the example's own and two others
    assert sorted(k[1] for k in cm._variants if k[0] == "split") == \
        sorted({p.mbs for p in plans.values()} - {cm._selection.plan.mbs})
    # the length model is the exact probe at another length (a module compiled there)
    model40, (ids, labels) = make_tiny_gpt(GBS, dtype=DTYPE, seq=64)
    at40 = mbcompile.compile(model40, GBS, NUM_CSX, plans[40].mbs, system=BUDGET,
                             example_inputs=token_batch(GBS, 40, seed=40))
    assert lengths.at(40 - EXAMPLE).memory(4, plans[40].mbs, plans[40].num_microbatches,
                                           BUDGET).peak == pytest.approx(
        at40.estimate.memory.peak, rel=1e-6)
    report = cm.report()
    assert "split by length" in report and f"last call: length {EXAMPLE}" in report
    assert cm.report("json") and cm.report().to_dict()["lengths"]["rows"]


def test_a_compile_only_module_models_the_lengths_when_its_report_asks():
    """``compile_only=True`` leaves the length model (its probes at other lengths: most of
    a 70B plan's time) to the report that asks for it; the table is then a running
    module's, and a pickled copy, which has no graphs to probe, gets it made first."""
    import pickle

    _, cm = _gpt("auto", dynamic=True, system=BUDGET, compile_only=True)
    assert cm._split.rule is None  # nothing probed at another length
    assert "split by length" in cm.report() and cm._split.rule is not None
    _, runs = _gpt("auto", dynamic=True, system=BUDGET)
    assert runs._split.rule is not None  # a module that runs has it from compile on
    assert cm._split.split.rows() == runs._split.split.rows()
    _, other = _gpt("auto", dynamic=True, system=BUDGET, compile_only=True)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # torch's own deprecation in pickling a treespec
        copied = pickle.loads(pickle.dumps(other))
    assert copied._split.split.rows() == runs._split.split.rows()


@pytest.mark.slow
def test_a_length_made_symbolic_on_the_way_follows_it_too():
    """dynamic='auto' (the default): the first call of another length makes it symbolic,
    and that module chooses each call's split; ``cm.plan`` shows the last call's."""
    model, cm = _gpt("auto", system=BUDGET)
    short, long = _step(model, cm, 8), _step(model, cm, 40)
    assert short.num_microbatches < long.num_microbatches
    assert cm.plan == long and "length 40" in cm.report()


@pytest.mark.slow
def test_a_call_too_long_for_any_split_is_refused_and_changes_nothing():
    model, cm = _gpt("auto", dynamic=True, system=BUDGET)
    ids, labels = token_batch(GBS, 64, seed=1)
    with unchanged(model, cm), pytest.raises(DoesNotFitError, match=r"length 64 does not "
                                             r"fit budget at any MBS.*nothing ran.*up to \d+"):
        cm(ids, labels)


# 12 s of CPU (the checkpointed graph probed at four lengths): -m zoo; CI runs the same
# length model on the plain graph (test_auto_cuts_each_call_by_its_length_exactly)
@pytest.mark.slow
@pytest.mark.zoo
def test_activation_checkpointing_follows_the_length_exactly():
    """recompute=True: the length model is probed on the checkpointed graph, and each
    call's split (with checkpointing per block) follows its length (1.2 MB: one microbatch
    of 4 up to 22 tokens, four of 1 from 31)."""
    tight = SystemSpec("tight", memory_bytes=1.2e6, peak_flops=1e12, peak_flops_fp32=1e12,
                       memory_bandwidth=1e11, optimizer_bytes_per_param=8)
    model, cm = _gpt("auto", dynamic=True, system=tight, recompute=True)
    assert cm._split.split.mode == "auto"
    short, long = _step(model, cm, 8), _step(model, cm, 40)
    assert short.recompute and long.recompute
    assert short.num_microbatches < long.num_microbatches
    lengths = cm._split.lengths
    for n, plan in ((8, short), (40, long)):  # the largest MBS that fits, checkpointed
        fits = [m for m in plan.supported_mbs if lengths.at(n - EXAMPLE).memory(
            4, m, -(-4 // m), tight).fits]
        assert plan.mbs == max(fits), (n, fits)
    ids, labels = token_batch(GBS, 64, seed=1)  # too long even checkpointed: refused
    with unchanged(model, cm), pytest.raises(DoesNotFitError, match="more memory$"):
        cm(ids, labels)
    assert "each block checkpointed" in cm.report()


@pytest.mark.slow
def test_a_plan_that_cannot_follow_the_length_says_so_and_keeps_its_split():
    """A two-phase step whose frontier grows with the length (the logits it returns) is
    planned at the example's length only: a CostModelWarning says the split cannot follow
    the length; every call runs the example's split, exactly."""
    roomy = SystemSpec("roomy", memory_bytes=1e9, peak_flops=1e12, peak_flops_fp32=1e12,
                       memory_bandwidth=1e11, optimizer_bytes_per_param=8)
    gpt, (ids, labels) = make_tiny_gpt(GBS, dtype=DTYPE, seq=64)
    model = token_split_workers.RootGPT(gpt)
    with pytest.warns(CostModelWarning, match="cannot follow the sequence length.*"
                      "two-phase step.*frontier.*grows with the length"):
        cm = mbcompile.compile(model, GBS, NUM_CSX, "auto", system=roomy, dynamic=True,
                               example_inputs=(ids[:, :EXAMPLE], labels[:, :EXAMPLE]))
    mbs = cm.plan.mbs
    assert cm._split.split.mode == "fixed"
    assert {_step(model, cm, n).mbs for n in (6, 30)} == {mbs} and not cm._variants
    assert f"the example's plan (mbs {mbs}) at every length" in cm.report()


class _RootLoss(nn.Module):
    """The tiny GPT's loss under a square root, returned alone: the frontier is the loss's
    partial sums, one size at every length."""

    def __init__(self, gpt: nn.Module) -> None:
        super().__init__()
        self.gpt = gpt

    def forward(self, ids: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        return self.gpt(ids, labels)[0].sqrt()


@pytest.mark.slow
def test_auto_cuts_a_two_phase_step_by_its_length_exactly():
    """A two-phase step whose frontier keeps one size at every length follows the length
    with "auto": P's memory fitted over lengths as a plain body's, F and C a fixed cost;
    each call's MBS the largest whose modelled two-phase peak at its length fits, exact."""
    gpt, (ids, labels) = make_tiny_gpt(GBS, dtype=DTYPE, seq=64)
    model = _RootLoss(gpt)
    cm = mbcompile.compile(model, GBS, NUM_CSX, "auto", dynamic=True, system=BUDGET,
                           example_inputs=(ids[:, :EXAMPLE], labels[:, :EXAMPLE]))
    assert cm._split.split.mode == "auto" and hasattr(cm.graph_module, "coupled")
    plans = {n: _step(model, cm, n) for n in (8, 40)}
    assert plans[8].num_microbatches < plans[40].num_microbatches
    example = cm._selection.cost
    for n, plan in plans.items():
        at = cm._split.lengths.at(n - EXAMPLE)
        fits = [m for m in plan.supported_mbs if at.memory(4, m, -(-4 // m), BUDGET).fits]
        assert plan.mbs == max(fits), (n, fits)
        memory = at.memory(4, plan.mbs, -(-4 // plan.mbs), BUDGET)  # F and C: the example's
        assert (memory.frontier, memory.coupled) == (2 * example.frontier_bytes,
                                                     example.coupled_bytes)
    assert "split by length" in cm.report()


def test_a_token_budget_cuts_a_two_phase_step_by_its_length_exactly():
    """A token budget needs no model of memory: a two-phase step follows it too, each
    split exact (the three phases run per microbatch; F is joined over them)."""
    gpt, (ids, labels) = make_tiny_gpt(GBS, dtype=DTYPE, seq=64)
    model = token_split_workers.RootGPT(gpt)
    cm = mbcompile.compile(model, GBS, NUM_CSX, {"tokens": 24}, dynamic=True, cost_model=False,
                           example_inputs=(ids[:, :EXAMPLE], labels[:, :EXAMPLE]))
    assert cm._split.split.mode == "tokens" and hasattr(cm.graph_module, "coupled")
    short, long = _step(model, cm, 6), _step(model, cm, 20)
    assert (short.mbs, long.mbs) == (4, 1) and short.num_microbatches < long.num_microbatches


# 25-55 s (an export capture, made symbolic at the first other length): -m zoo
@pytest.mark.slow
@pytest.mark.zoo
def test_a_transformers_model_follows_the_length_exactly():
    """GPT-2 through torch.export, dynamic='auto': the first call of another length makes
    it symbolic, and each call's split follows its length (1.1 MB: one microbatch of 4 up
    to 8 tokens, four of 1 from 12)."""
    transformers = pytest.importorskip("transformers")
    from test_dynamic_shapes import _hf_batch
    from test_hf_models import GRAD_FLOOR, build

    model = build(transformers, "gpt2")
    budget = SystemSpec("budget", memory_bytes=1.1e6, peak_flops=1e12, peak_flops_fp32=1e12,
                        memory_bandwidth=1e11, optimizer_bytes_per_param=8)
    cm = mbcompile.compile(model, GBS, NUM_CSX, "auto", example_kwargs=_hf_batch(8, 0),
                           system=budget)
    plans = {}
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        for n in (5, 16, 3, 8):
            assert_close_errors(step_errors(model, cm, kwargs=_hf_batch(n, n),
                                            floor=GRAD_FLOOR), TOL)
            plans[n] = cm.plan
    assert plans[5].num_microbatches < plans[16].num_microbatches
    assert "split by length" in cm.report() and "last call: length 8" in cm.report()


# "auto" runs the same per-rank mechanism with a length model probed on each rank
# (45 s on 2 shared cores): -m zoo
@pytest.mark.slow
@pytest.mark.parametrize("policy", ["tokens", pytest.param("auto", marks=pytest.mark.zoo)])
def test_each_rank_cuts_its_own_length_exactly(tmp_path, policy):
    """On ranks each rank's share comes padded to its own length and each rank chooses its
    own split: a step where rank 0's rows are short and rank 1's long runs one microbatch
    on rank 0 and three on rank 1, and equals eager's step on the whole batch (the short
    rows' labels past their length ignored: the model is causal). The gradient all-reduce
    and the loss's global count do not depend on the split. With a token budget, a two-phase
    step too, in the same ranks (``_check_two_phase_ranks``)."""
    from test_distributed import _run

    _run(token_split_workers.split_steps, 2, str(tmp_path), policy)
    saved = [torch.load(tmp_path / f"rank{r}.pt") for r in range(2)]
    ranks = [r["steps"] for r in saved]
    _check_rank_steps(ranks)
    short, long, mixed = zip(*ranks)  # per step: (rank 0's, rank 1's)
    # the same budget runs a rank's short rows in fewer microbatches than its long ones
    assert short[0]["microbatches"] < long[0]["microbatches"]
    assert [r["mbs"] for r in mixed] == [short[0]["mbs"], long[1]["mbs"]]
    assert mixed[0]["microbatches"] < mixed[1]["microbatches"]  # one step, two splits
    _check_refused(saved, policy)
    if policy == "tokens":  # a two-phase step cuts each rank's length too, in the same ranks
        _check_two_phase_ranks([r["two_phase"] for r in saved])


def _check_refused(saved: list[dict[str, Any]], policy: str) -> None:
    """A call rank 1 refuses (too long for any split under ``policy``) stops the step on
    every rank, before any gradient changed, and they step on together after it."""
    first, second = (r["refused"] for r in saved)
    error, text = {"tokens": ("PlanError", "one sample has 64 tokens"),
                   "auto": ("DoesNotFitError", "length 64 does not fit")}[policy]
    assert second["error"] == error and text in second["message"], second
    assert first["error"] == "InputError" and "rank(s) [1] refused their call" in \
        first["message"]  # told apart from a failure in the microbatches
    assert first["unchanged"] and second["unchanged"]
    for r in range(2):
        assert torch.equal(saved[r]["refused"]["loss_after"], saved[r]["steps"][0]["loss"])


def _check_rank_steps(ranks: list[list[dict[str, Any]]]) -> None:
    """Each rank's steps (``token_split_workers.LENGTHS``) against eager's step on the whole
    batch: the loss, this rank's logits at its length, every full gradient."""
    model, _ = make_tiny_gpt(GBS, dtype=DTYPE, seq=64)
    for step, lengths in enumerate(token_split_workers.LENGTHS):
        loss, logits, rows = _eager_step(model, step, lengths, ranks[0][step]["share"])
        for rank, length in enumerate(lengths):
            got = ranks[rank][step]
            mine = logits[rows] if rank else logits[~rows]
            assert rel_err(got["loss"], loss) <= TOL, (step, rank)
            assert rel_err(got["logits"], mine[:, :length]) <= TOL, (step, rank)
            for name, p in model.named_parameters():
                assert rel_err(got["grads"][name], p.grad) <= TOL, (step, rank, name)


def _eager_step(model: nn.Module, step: int, lengths: tuple[int, int], share: int) -> Any:
    """Eager's step on the whole batch of ``token_split_workers``' step ``step``, where rank
    0's ``share`` rows end at its length and rank 1's at its own (their labels past it
    ignored: the model is causal); the loss, the logits and which rows are rank 1's."""
    ids, labels = token_split_workers.step_batch(step)
    rows = torch.arange(GBS) >= share  # rank 1's rows
    labels = labels.clone()
    labels[:, lengths[0]:][~rows] = -100  # rank 0's rows end at its length
    labels[:, lengths[1]:][rows] = -100
    model.zero_grad(set_to_none=True)
    loss, logits = model(*(t[:, :max(lengths)].contiguous() for t in (ids, labels)))
    loss.backward()
    return loss, logits, rows


def _check_two_phase_ranks(saved: list[dict[str, Any]]) -> None:
    """The tiny GPT's loss under a square root (a two-phase step) on ranks whose batches are
    padded to their own lengths, under a token budget: each rank cuts its own length (rank
    0's 8 tokens in one microbatch, rank 1's 40 in three), and the frontier is gathered over
    ranks (which aborted the process group before). Returning the loss only, the frontier is
    the loss's partial sums, one shape at every length: the step is eager's on the whole
    batch. Returning the logits too, a step at two lengths has no whole batch of logits: it
    is refused on every rank, naming the fix, with no gradient made, also where one rank
    runs the module compiled at the example's length and the other the one its length made
    symbolic (``dynamic="auto"``); at one length it is eager's. A call one rank refuses (too
    long for the budget), and a rank failing in phase 1 at 40 tokens (not the example's 12),
    stop every rank, which then step on together. ``saved``: each rank's
    ``token_split_workers.two_phase_steps``."""
    model = token_split_workers.RootGPT(make_tiny_gpt(GBS, dtype=DTYPE, seq=64)[0])
    share = saved[0]["after"]["share"]
    for outputs, steps in token_split_workers.TWO_PHASE_STEPS.items():
        for k, (step, lengths) in enumerate(steps):
            loss, logits, _ = _eager_step(model, step, lengths, share)
            for rank in range(2):
                got = saved[rank][outputs][k]
                if outputs == "all" and lengths[0] != lengths[1]:  # refused on every rank
                    assert got["error"] == "InputError", got
                    assert "value 'gpt_head'" in got["message"] and "(4, 12, 64)" in \
                        got["message"] and "outputs='loss'" in got["message"]
                    assert got["unchanged"]
                    continue
                assert rel_err(got["loss"], loss) <= TOL, (step, rank)
                for name, p in model.named_parameters():
                    assert rel_err(got["grads"][name], p.grad) <= TOL, (step, rank, name)
                # the loss only, or this rank's rows of the whole batch's logits
                assert (got["logits"] is None) == (outputs == "loss")
                mine = logits[:share] if rank == 0 else logits[share:]
                assert outputs == "loss" or rel_err(got["logits"], mine) <= TOL
    mixed = [saved[r]["loss"][0] for r in range(2)]  # one step, two splits (the plan's)
    assert [(m["mbs"], m["microbatches"]) for m in mixed] == [(4, 1), (1, 4)]
    # rank 0 is told which: a refusal (the step's status, or the frontier's gather of a
    # two-phase step: "failed ..., or that rank refused its call"), or a failure
    told = {"refused": (("InputError", "rank(s) [1] refused their call"),
                        ("MicrobatchError", "or that rank refused its call")),
            "failed": (("MicrobatchError", "rank(s) [1] failed"),)}
    for stopped, error, text in (("refused", "PlanError", "one sample has 64 tokens"),
                                 ("failed", "MicrobatchError", "injected failure")):
        for outputs in ("loss", "all") if stopped == "refused" else (None,):
            got = [saved[r][outputs][stopped] if outputs else saved[r][stopped]
                   for r in range(2)]
            assert got[1]["error"] == error and text in got[1]["message"], got[1]
            assert any(got[0]["error"] == e and t in got[0]["message"]
                       for e, t in told[stopped]), got[0]
            assert got[0]["unchanged"] and got[1]["unchanged"]
    loss, logits, _ = _eager_step(model, 0, token_split_workers.LENGTHS[0], share)
    for r in range(2):
        assert rel_err(saved[r]["after"]["loss"], loss) <= TOL
        mine = logits[:share] if r == 0 else logits[share:]  # this rank's rows
        assert rel_err(saved[r]["after"]["logits"], mine) <= TOL


# --------------------------------------------------------------------------- #
# A token budget, and an int MBS
# --------------------------------------------------------------------------- #


@pytest.mark.slow
def test_a_token_budget_fits_each_microbatch_exactly():
    model, cm = _gpt({"tokens": 24}, dynamic=True, cost_model=False)
    assert cm.plan.mbs == 2 and "24" in cm.plan.reason  # 2 x 12 tokens at the example
    for n in (6, 20, 8, 24):
        plan = _step(model, cm, n)
        assert plan.max_microbatch_size * n <= 24, (n, plan.mbs)
        larger = [m for m in plan.supported_mbs if m > plan.mbs]
        assert not larger or larger[0] * n > 24  # the most the budget holds
    assert cm.plan.requested_mbs == repr({"tokens": 24})
    ids, labels = token_batch(GBS, 25, seed=2)
    with unchanged(model, cm), pytest.raises(PlanError, match="one sample has 25 tokens"):
        cm(ids, labels)


def test_an_int_mbs_keeps_its_meaning_at_every_length():
    model, cm = _gpt(2, dynamic=True, cost_model=False)
    for n in (6, 20):
        plan = _step(model, cm, n)
        assert plan.mbs == 2 and plan.tokens_per_sample == n  # the last call's shape
    assert not cm._variants and "mbs=2 is samples per microbatch" in cm.report()


@pytest.mark.parametrize("mbs, error, match", [
    ({"tokens": 0}, PlanError, "tokens must be at least 1"),
    ({"tokens": "8k"}, PlanError, "tokens must be an int"),
    ({"tokens": 1.5}, PlanError, "tokens must be an int"),
    ({"tokens": True}, PlanError, "tokens must be an int"),
    ({"tokens": 8, "explore": {}}, PlanError, "single key 'tokens'"),
    ({"tokns": 8}, PlanError, "single key 'explore' \\(or 'tokens'\\)"),
    ({"tokens": 11}, PlanError, "one sample has 12 tokens"),
])
def test_a_bad_token_budget_is_refused_before_tracing(mbs, error, match):
    model, (ids, labels) = make_tiny_gpt(GBS, dtype=DTYPE, seq=EXAMPLE)
    before = {k: v.clone() for k, v in model.state_dict().items()}
    with pytest.raises(error, match=match):
        mbcompile.compile(model, GBS, NUM_CSX, mbs, example_inputs=(ids, labels))
    assert all(torch.equal(v, model.state_dict()[k]) for k, v in before.items())


def test_a_token_budget_needs_token_ids():
    model = nn.Sequential(nn.Linear(3, 1)).to(DTYPE)
    with pytest.raises(InputError, match="counts the tokens of a \\(batch, length\\) integer"):
        mbcompile.compile(model, GBS, NUM_CSX, {"tokens": 8},
                          example_inputs=(torch.randn(GBS, 3, dtype=DTYPE),))


@pytest.mark.slow
@pytest.mark.parametrize("policy", ["tokens", "auto"])
def test_each_rank_of_an_fsdp2_model_cuts_its_own_length_exactly(tmp_path, policy):
    """The tiny GPT sharded by FSDP2, a token budget or ``"auto"`` under a memory budget (the
    length model of the sharded step: its parameters, gradients and optimizer state one
    rank's shards): as above, each rank cuts its own length (one microbatch at 8 tokens,
    four at 40), and the rank with fewer microbatches runs its last one again with weight 0,
    so both issue FSDP's collectives in step (the same all-gathers on both ranks). Every
    step equals eager's on the whole batch; a call one rank refuses stops every rank with
    the gradients as they were, and they step on."""
    from test_distributed import _run

    _run(token_split_workers.fsdp_split_steps, 2, str(tmp_path), policy)
    saved = [torch.load(tmp_path / f"rank{r}.pt") for r in range(2)]
    ranks = [r["steps"] for r in saved]
    _check_rank_steps(ranks)
    for step, (first, second) in enumerate(zip(*ranks)):
        assert first["counts"] == second["counts"], step
    short, long, mixed = zip(*ranks)
    assert short[0]["microbatches"] < long[0]["microbatches"]
    assert mixed[0]["microbatches"] < mixed[1]["microbatches"]  # one step, two splits
    if policy == "auto":  # each split the largest whose sharded peak fits at its length
        budget = token_split_workers.POLICIES["auto"]["system"].usable_bytes
        for rank in ranks:
            assert all(0 < step["peak"] <= budget for step in rank), rank
        assert short[0]["peak"] != long[0]["peak"]  # modelled at each call's length
    _check_refused(saved, policy)


# --------------------------------------------------------------------------- #
# The arithmetic alone
# --------------------------------------------------------------------------- #


def _toy(budget: float, example_mbs: int = 1, pbs: int = 16) -> Any:
    """Memory of ``m`` samples of ``n`` tokens: 100 per token, 1000 static."""
    supported = (1, 2, 3, 4, 6, 8, 16)
    return auto_split(lambda n, m: 1000 + 100 * m * n <= budget,
                      lambda n, m: 1000 + 100 * m * n, supported=supported, pbs=pbs,
                      example_mbs=example_mbs, example_length=32, shortest=2, longest=None,
                      capacity=budget, system="toy")


def test_auto_split_takes_the_largest_mbs_that_fits_each_length():
    split = _toy(1000 + 100 * 64, example_mbs=2)  # 64 tokens: memory bound at 32 already
    assert [split.mbs_at(n) for n in (4, 16, 32, 64)] == [16, 4, 2, 1]
    with pytest.raises(DoesNotFitError, match="length 65 does not fit toy"):
        split.mbs_at(65)
    rows = split.rows()
    assert rows == [(2, 4, 16, 1), (5, 8, 8, 2), (9, 10, 6, 3), (11, 16, 4, 4), (17, 21, 3, 6),
                    (22, 32, 2, 8), (33, 64, 1, 16)]
    # where memory did not bind at the example, auto's own choice (for time) stays the most
    loose = _toy(1000 + 100 * 64 * 16, example_mbs=4)
    assert loose.cap == 4 and loose.mbs_at(2) == 4 and loose.mbs_at(256) == 4
    assert loose.mbs_at(512) == 2


def test_a_token_budget_gives_the_most_samples_that_fit():
    split = tokens_split(8192, supported=supported_mbs(50), pbs=50,
                         example_mbs=16, example_length=512)
    assert [split.mbs_at(n) for n in (100, 512, 600, 8192)] == [50, 13, 13, 1]
    assert parse_mbs({"tokens": 8192}).for_tokens(600, pbs=50).value == 13
    with pytest.raises(PlanError, match="8192 tokens per microbatch, but one sample has 9000"):
        split.mbs_at(9000)
    assert split.rows()[-1][1] == 8192
