"""Variants in milliseconds (issue 34, item 3): a call compile() did not see (another batch
size, keyword set or train/eval mode) reuses the first capture and its batch analysis, and
an eval-mode or ``no_grad`` call probes nothing.

Each variant is exact against eager in float64 on an uneven plan (gbs 7 over 2 systems,
mbs 2: systems of 4 and 3 samples); reuse is asserted on counters of the capture and of
the cost model's probes (``counted``), never on time (``benchmarks/bench_variants.py``
prints the milliseconds).
"""

from __future__ import annotations

import copy
import warnings
from collections import Counter
from collections.abc import Iterator
from typing import Any

import pytest
import torch
import torch.nn as nn
from models import TOL, assert_close_errors, max_rel_err_outputs, step_errors, tiny_gpt

import mbcompile
from mbcompile import analysis
from mbcompile.models import make_tiny_gpt
from mbcompile.planning.probe import Prober

GBS, SYSTEMS, MBS = 7, 2, 2


@pytest.fixture
def counted(monkeypatch: pytest.MonkeyPatch) -> Iterator[Counter[str]]:
    """Counts of captures (fx or export) and of cost-model probes from here on."""
    counts: Counter[str] = Counter()

    def counting(name: str, fn: Any) -> Any:
        def wrapper(*args: Any, **kwargs: Any) -> Any:
            counts[name] += 1
            return fn(*args, **kwargs)
        return wrapper

    monkeypatch.setattr(analysis, "_capture", counting("capture", analysis._capture))
    monkeypatch.setattr(analysis, "_export_instead",
                        counting("capture", analysis._export_instead))
    monkeypatch.setattr(Prober, "__call__", counting("probe", Prober.__call__))
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", mbcompile.BatchSizeWarning)
        yield counts


def _gpt(**options: Any) -> tuple[nn.Module, tuple[Any, ...], Any]:
    model, batch = tiny_gpt(GBS)
    return model, batch, mbcompile.compile(model, GBS, SYSTEMS, MBS, example_inputs=batch,
                                           **options)


def _eval_errors(model: nn.Module, cm: Any, batch: tuple[Any, ...]) -> dict[str, float]:
    """Outputs of a forward-only call (eval mode, no_grad) against eager's."""
    with torch.no_grad():
        return max_rel_err_outputs(cm(*batch), model(*batch))


def test_training_batches_of_other_sizes_reuse_the_capture_and_are_exact(counted):
    model, _, cm = _gpt(cost_model=False)
    made = counted["capture"]
    for size in (3, 5, 10):  # plans 2+1 | 2, 2+1 | 2, 2+1+... over two systems
        assert_close_errors(step_errors(model, cm, tiny_gpt(size, seed=size)[1]), TOL)
        variant = cm._variants[(size, False)]
        assert variant.plan.gbs == size and variant.plan.mbs <= MBS
    assert counted["capture"] == made  # one capture served every batch size


def test_forward_only_calls_and_a_training_batch_size_probe_nothing(counted):
    model, _, cm = _gpt()  # mbs pinned, the cost model on: compile() probed
    cm.eval()
    made, probed = counted["capture"], counted["probe"]
    for size in range(1, GBS + 4):
        assert_close_errors(_eval_errors(model, cm, tiny_gpt(size, seed=size)[1]), TOL)
    assert counted["probe"] == probed  # nothing probed for eval
    assert counted["capture"] == made  # the training graph serves eval at every size
    variant = cm._variants[(GBS + 3, True)]
    assert variant.plan.mbs <= MBS and "forward-only" in variant.plan.reason
    cm.train()
    with torch.no_grad():  # training mode, no grad: forward only as well
        for size in (2, GBS + 2):
            assert_close_errors(_eval_errors(model.train(), cm, tiny_gpt(size, seed=size)[1]),
                                TOL)
    assert counted["probe"] == probed and (2, True) in cm._variants
    assert counted["capture"] == made  # the training graph is the first capture
    # Training at 9 runs 2+2+1 on a system where compile's plan ran 2+2 and 2+1: the
    # pinned cost model probed m=2 and m=1 at compile (``CostModel.pin``), so the memory
    # of the trailing microbatch beside the earlier ones' logits is exact, and the
    # variant probes nothing
    assert_close_errors(step_errors(model, cm, tiny_gpt(9, seed=9)[1]), TOL)
    assert counted["probe"] == probed
    variant, cost = cm._variants[(9, False)], cm.selection.cost
    assert variant.selection.cost is cost and variant.plan.num_microbatches == 3
    assert variant.estimate.figures.exact and cost.figures(1).exact
    assert not cost.figures(3).exact and counted["probe"] == probed  # the fit's size


def test_a_training_batch_size_of_a_recomputing_plan_probes_nothing(counted):
    """recompute=True: the variant's plan is costed with the checkpointed graph's model the
    first plan was chosen with (``selection._Context.prior_recomputed``), not probed again."""
    model, _, cm = _gpt(recompute=True)
    probed = counted["probe"]
    assert_close_errors(step_errors(model, cm, tiny_gpt(3, seed=3)[1]), TOL)
    variant = cm._variants[(3, False)]
    assert counted["probe"] == probed and cm.plan.recompute and variant.plan.recompute
    assert variant.selection.cost is cm.selection.cost


def test_a_train_eval_switch_reuses_the_first_capture(counted):
    """No layer's batch facts read the mode and forward reads no ``training``: the training
    capture serves eval as it is, only what a step keeps is decided anew."""
    model, batch, cm = _gpt()
    made, probed = counted["capture"], counted["probe"]
    small = tiny_gpt(3, seed=3)[1]
    cm.eval()
    assert_close_errors(_eval_errors(model, cm, batch), TOL)
    assert cm.original_graph_module is cm.train().original_graph_module  # one graph
    cm.eval()
    assert_close_errors(_eval_errors(model, cm, small), TOL)
    cm.train()
    assert_close_errors(step_errors(model, cm, small), TOL)  # training at 3: the first capture
    cm.eval()
    assert_close_errors(_eval_errors(model, cm, small), TOL)
    assert counted["capture"] == made and counted["probe"] == probed


def test_a_batch_norm_switch_keeps_the_graph_and_finds_each_modes_facts(counted):
    """BatchNorm couples samples in training only (a two-phase step), and is per-sample in
    eval: the same graph, its facts found again per mode on a copy, each mode exact; the
    running statistics a two-phase variant writes are eager's."""
    from models import MODELS

    model, batch = MODELS["batch_norm"](GBS)
    cm = mbcompile.compile(model, GBS, SYSTEMS, MBS, example_inputs=batch, cost_model=False)
    made = counted["capture"]
    assert cm.analysis.two_phase
    cm.eval()
    assert cm.analysis.rejected is None  # eval's facts: a plain split
    assert_close_errors(_eval_errors(model, cm, batch), TOL)
    assert_close_errors(_eval_errors(model, cm, MODELS["batch_norm"](3, seed=3)[1]), TOL)
    cm.train()
    assert cm.analysis.two_phase  # the training graph's facts are its own still
    errors = step_errors(model, cm, MODELS["batch_norm"](5, seed=5)[1], floor=1e-4)
    assert_close_errors(errors, TOL)  # inp.bias: zero up to rounding, hence the floor
    assert counted["capture"] == made


class _ModeBranch(nn.Module):
    """Forward reads ``self.training``: a trace holds one branch, so each mode captures."""

    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(4, 3)

    def forward(self, x: torch.Tensor, y: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        h = self.lin(x)
        h = h * 2 if self.training else h - 1
        return ((h - y) ** 2).mean(), h


def test_a_forward_that_reads_the_mode_is_captured_once_per_mode(counted):
    torch.manual_seed(0)
    model = _ModeBranch().double()

    def batch(n: int) -> tuple[torch.Tensor, torch.Tensor]:
        return torch.randn(n, 4, dtype=torch.float64), torch.randn(n, 3, dtype=torch.float64)

    cm = mbcompile.compile(model, GBS, SYSTEMS, MBS, example_inputs=batch(GBS),
                           cost_model=False)
    made = counted["capture"]
    cm.eval()
    assert_close_errors(_eval_errors(model, cm, batch(GBS)), TOL)  # eval's branch
    assert counted["capture"] == made + 1
    cm.train()
    assert_close_errors(step_errors(model, cm, batch(3)), TOL)
    cm.eval()
    assert_close_errors(_eval_errors(model, cm, batch(5)), TOL)
    assert counted["capture"] == made + 1


def test_a_batch_size_the_loss_reads_takes_the_variants_value(counted):
    """``sq.sum() / x.size(0)``: after the loop the size is a number, the variant's batch."""
    from models import size_normalised

    model, batch = size_normalised(GBS)
    cm = mbcompile.compile(model, GBS, SYSTEMS, MBS, example_inputs=batch)
    made = counted["capture"]
    for size in (3, 10):
        assert_close_errors(step_errors(model, cm, size_normalised(size, seed=size)[1]), TOL)
    assert counted["capture"] == made


class _Squeezed(nn.Module):
    """``squeeze()`` of a (B, 1, C) value: at batch 1 eager drops the batch dim too."""

    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(4, 3)

    def forward(self, x: torch.Tensor, y: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        h = self.lin(x).squeeze()
        return ((h - y.squeeze()) ** 2).sum(), h


def test_a_node_specialised_for_the_full_batch_is_captured_again_for_one_sample(counted):
    torch.manual_seed(0)
    model = _Squeezed().double()

    def batch(n: int) -> tuple[torch.Tensor, torch.Tensor]:
        return torch.randn(n, 1, 4, dtype=torch.float64), torch.randn(n, 3, dtype=torch.float64)

    cm = mbcompile.compile(model, GBS, SYSTEMS, MBS, example_inputs=batch(GBS),
                           cost_model=False)
    made = counted["capture"]
    assert_close_errors(step_errors(model, cm, batch(3)), TOL)  # the same capture
    assert counted["capture"] == made
    one = batch(1)
    assert cm(*one)[1].shape == model(*one)[1].shape == (3,)  # eager's squeeze: a capture
    assert_close_errors(step_errors(model, cm, one), TOL)
    assert counted["capture"] == made + 1


class _Kw(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(4, 3)

    def forward(self, x: torch.Tensor, y: torch.Tensor, **kwargs: Any) -> torch.Tensor:
        err = ((self.lin(x) - y) ** 2).sum(1)
        if "num_items_in_batch" in kwargs:
            return err.sum() / kwargs["num_items_in_batch"]
        return err.mean()


def test_a_keyword_variant_keeps_the_plan_and_names_the_users_example(counted):
    torch.manual_seed(0)
    model = _Kw().double()
    x, y = torch.randn(GBS, 4, dtype=torch.float64), torch.randn(GBS, 3, dtype=torch.float64)
    # dynamic=False: a width that differs is an error naming the example, not a symbolic dim
    cm = mbcompile.compile(model, GBS, SYSTEMS, MBS, example_inputs=(x, y), dynamic=False)
    probed = counted["probe"]
    n = torch.tensor(5.0, dtype=torch.float64)
    with pytest.raises(mbcompile.InputError, match=r"the example had \('B', 4\)"):
        cm(torch.randn(GBS, 5, dtype=torch.float64), y, num_items_in_batch=n)
    assert not cm._variants  # refused: nothing compiled
    with pytest.warns(mbcompile.RecompileWarning, match="num_items_in_batch"):
        assert_close_errors(step_errors(model, cm, (x, y), {"num_items_in_batch": n}), TOL)
    variant = cm._variants[frozenset({"num_items_in_batch"})]
    assert variant.selection is cm.selection and counted["probe"] == probed  # the same plan


def test_a_pickled_module_captures_again_and_runs_its_variants():
    model, batch = make_tiny_gpt(GBS, dtype=torch.float64)
    cm = mbcompile.compile(model, GBS, SYSTEMS, MBS, example_inputs=batch, cost_model=False)
    copied = copy.deepcopy(cm)
    with pytest.warns(mbcompile.BatchSizeWarning):
        loss, _ = copied(*make_tiny_gpt(3, seed=3, dtype=torch.float64)[1])
    assert loss.isfinite()


class _Labelled(nn.Module):
    """Logits without ``labels`` (a call for predictions), the loss and logits with them;
    an optional per-sample ``mask``."""

    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(4, 3)

    def forward(self, x: torch.Tensor, labels: torch.Tensor | None = None,
                mask: torch.Tensor | None = None) -> Any:
        logits = self.lin(x).tanh()
        if mask is not None:
            logits = logits * mask[:, None]
        if labels is None:
            return logits
        return ((logits - labels) ** 2).sum(1).mean(), logits


def test_a_call_that_leaves_out_an_input_compiles_it_once_and_is_eagers(counted):
    """A call without ``labels`` (logits for predictions) or with a ``mask`` the example
    left out is another graph: compiled once from that call, with a warning naming what
    changed (it was an ``InputError`` before); the example's own kind of call still runs
    the first graph."""
    torch.manual_seed(0)
    model = _Labelled().double()

    def batch(n: int, seed: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        g = torch.Generator().manual_seed(seed)
        return tuple(torch.randn(n, k, generator=g, dtype=torch.float64)  # type: ignore[return-value]
                     for k in (4, 3, 1))

    x, labels, _ = batch(GBS, 0)
    cm = mbcompile.compile(model, GBS, SYSTEMS, MBS, example_inputs=(x, labels))
    made = counted["capture"]
    for size, seed in ((GBS, 1), (3, 2)):  # another batch size: the variant's own variant
        xs = batch(size, seed)[0]
        with warnings.catch_warnings(record=True) as seen:
            warnings.simplefilter("always", mbcompile.RecompileWarning)
            got = cm(xs)
        said = [str(w.message) for w in seen if w.category is mbcompile.RecompileWarning]
        assert said == (["a call passes None for 'labels' where the example passed a tensor"
                         ": planned and compiled once" + said[0].split("compiled once", 1)[1]]
                        if seed == 1 else [])
        assert_close_errors(max_rel_err_outputs(got, model(xs)), TOL)
    assert counted["capture"] == made + 1  # one capture for the calls without labels
    assert_close_errors(step_errors(model, cm, batch(GBS, 3)[:2]), TOL)  # the first graph
    x, labels, mask = batch(GBS, 4)
    with pytest.warns(mbcompile.RecompileWarning, match="a tensor for 'mask' where the "
                      "example passed None"):
        assert_close_errors(step_errors(model, cm, (x, labels), {"mask": mask[:, 0]}), TOL)
    with pytest.raises(mbcompile.InputError, match=r"the example had \('B', 3\)"):
        cm(x, labels[:, None], mask=mask[:, 0])  # checked against the user's example first


class _Masked(nn.Module):
    """A loss over rows weighted by a mask laid out (features, batch): its batch dim is 1."""

    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(4, 3)

    def forward(self, x: torch.Tensor, labels: torch.Tensor,
                mask: torch.Tensor | None = None, scale: float = 1.0) -> torch.Tensor:
        err = (self.lin(x).tanh() - labels) ** 2 * scale
        return (err * mask.T).mean() if mask is not None else err.mean()


def test_an_input_the_example_left_out_takes_its_in_dims_and_no_other_change(counted):
    """A mask the example left out, passed later, is split on the batch dim ``in_dims``
    names for it (it was split on dim 0: a batch-size error); a call that also changes
    a non-tensor argument is refused naming it, as without the mask (it compiled the
    new value into the mask's graph)."""
    torch.manual_seed(0)
    model = _Masked().double()
    g = torch.Generator().manual_seed(0)
    x, labels, mask = (torch.randn(*shape, generator=g, dtype=torch.float64)
                       for shape in ((GBS, 4), (GBS, 3), (3, GBS)))
    cm = mbcompile.compile(model, GBS, SYSTEMS, MBS, example_inputs=(x, labels),
                           example_kwargs={"scale": 0.5},
                           in_dims={"x": 0, "labels": 0, "mask": 1})
    with pytest.raises(mbcompile.InputError, match="'scale' was 0.5 at compile time and is "
                       "0.7 now"):
        cm(x, labels, mask=mask, scale=0.7)
    assert not cm._variants
    with pytest.warns(mbcompile.RecompileWarning, match="a tensor for 'mask'"):
        assert_close_errors(step_errors(model, cm, (x, labels), {"mask": mask, "scale": 0.5}),
                            TOL)
    assert cm._variants[("absent", frozenset(), frozenset())]._inputs.in_dims[2] == 1


class _KwLabelled(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(4, 3)

    def forward(self, x: torch.Tensor, labels: torch.Tensor | None = None,
                **kwargs: Any) -> Any:
        h = self.lin(x).tanh() * kwargs.get("scale", 1.0)
        return h if labels is None else ((h - labels) ** 2).sum(1).mean()


@pytest.fixture
def one_rank(tmp_path: Any) -> Iterator[None]:
    """A one-process gloo group: the module runs on rank 0 of torch.distributed."""
    dist = torch.distributed
    if dist.is_initialized():
        pytest.skip("a process group of the test run's own is up")
    dist.init_process_group("gloo", init_method=f"file://{tmp_path / 'store'}", rank=0,
                            world_size=1)
    try:
        yield
    finally:
        dist.destroy_process_group()


def test_on_ranks_a_call_without_labels_is_refused_and_compiles_nothing(one_rank):
    """Each rank would compile a variant alone: refused, with or without a keyword through
    ``**kwargs`` (with one, the keyword variant was compiled from the unlabelled call and
    then refused the labelled calls it was kept for)."""
    torch.manual_seed(0)
    model = _KwLabelled().double()
    x, labels = torch.randn(4, 4, dtype=torch.float64), torch.randn(4, 3, dtype=torch.float64)
    cm = mbcompile.compile(model, 4, 1, 2, example_inputs=(x, labels),
                           backend="torch.distributed")
    scale = torch.tensor(2.0, dtype=torch.float64)
    for kwargs in ({}, {"scale": scale}):
        with torch.no_grad(), pytest.raises(mbcompile.InputError, match="labels is None where"):
            cm(x, **kwargs)
    assert not cm._variants
    with pytest.warns(mbcompile.RecompileWarning, match="'scale'"):
        assert_close_errors(step_errors(model, cm, (x, labels), {"scale": scale}), TOL)


def test_a_compiled_module_is_freed_when_its_last_reference_goes():
    """What a module shares with its variants names the module weakly: dropped, it is
    freed at once with its graphs (a cycle through it waited for the cycle collector)."""
    import gc
    import weakref

    model, batch = make_tiny_gpt(GBS, dtype=torch.float64)
    cm = mbcompile.compile(model, GBS, SYSTEMS, MBS, example_inputs=batch, cost_model=False)
    cm(*batch)[0].backward()
    held = weakref.ref(cm)
    gc.collect()
    gc.disable()
    try:
        del cm
        assert held() is None
    finally:
        gc.enable()
