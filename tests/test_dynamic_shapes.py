"""Dims that vary between calls (issue 34): one compiled step for every sequence length.

``compile(..., dynamic="auto")`` (the default) compiles once more the first time a call's
non-batch dims differ from the example's, with those dims symbolic; every later size runs
that step without compiling. ``dynamic=True`` makes every non-batch dim symbolic from the
start, a dict names the dims (with bounds), ``False`` keeps shapes fixed. Each test checks
against eager in float64 on an uneven plan (gbs 7 over 2 systems, mbs 2: microbatches
2, 2 and 2, 1): the loss, every output, every gradient and buffer (``step_errors``).
Models that bake a length in are refused with the padding fix, and the refusal changes
nothing (``unchanged``).
"""

from __future__ import annotations

import sys
import warnings
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F
from models import TOL, assert_close_errors, step_errors

import mbcompile
from mbcompile.errors import CaptureError, InputError
from mbcompile.models import make_tiny_gpt, token_batch

DTYPE = torch.float64
GBS, NUM_CSX, MBS = 7, 2, 2
LENGTHS = (12, 9, 16, 5, 14)  # the example's first, then four others: one more compile
BENCHMARKS = Path(__file__).resolve().parent.parent / "benchmarks"


def _gpt(**options: Any) -> tuple[nn.Module, Any]:
    model, (ids, labels) = make_tiny_gpt(GBS, dtype=DTYPE, seq=16)
    options.setdefault("cost_model", False)  # the plan is an int MBS: no probes needed
    cm = mbcompile.compile(model, GBS, NUM_CSX, MBS, example_inputs=(ids[:, :12],
                                                                     labels[:, :12]), **options)
    return model, cm


def _steps(model: nn.Module, cm: Any, batches: list[tuple[Any, ...]] | list[dict[str, Any]],
           floor: float = 0.0) -> list[str]:
    """One step per batch against eager (every error <= TOL); the warnings the steps gave."""
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        for batch in batches:
            if isinstance(batch, dict):
                errors = step_errors(model, cm, kwargs=batch, floor=floor)
            else:
                errors = step_errors(model, cm, batch, floor=floor)
            assert_close_errors(errors, TOL)
    return [f"{type(w.message).__name__}: {w.message}" for w in caught]


def _recompiles(caught: list[str]) -> list[str]:
    return [w for w in caught if w.startswith(("RecompileWarning", "BatchSizeWarning"))]


# --------------------------------------------------------------------------- #
# "auto": one more compile at the first change, exact at every length
# --------------------------------------------------------------------------- #


def test_tiny_gpt_is_exact_at_five_lengths_with_one_more_compile():
    model, cm = _gpt()
    caught = _steps(model, cm, [token_batch(GBS, n, seed=n) for n in LENGTHS])
    assert len(_recompiles(caught)) == 1, caught
    # the warning names the user's own example shape, and what varied
    assert "'ids' dim 1" in caught[0] and "('B', 12)" in caught[0], caught[0]
    variant = next(iter(cm._variants.values()))
    assert variant._request.inputs.symbolic == {"ids": {1: (None, None)},
                                                "labels": {1: (None, None)}}
    assert not variant._variants  # every length after the first change: no compile


def test_dynamic_true_is_symbolic_from_the_start():
    model, cm = _gpt(dynamic=True)
    assert cm._request.inputs.symbolic == {"ids": {1: (None, None)}, "labels": {1: (None, None)}}
    caught = _steps(model, cm, [token_batch(GBS, n, seed=n) for n in (10, 16)])
    assert not _recompiles(caught) and not cm._variants


def test_bounds_are_checked_on_every_call():
    model, cm = _gpt(dynamic={"ids": {1: (4, 14)}, "labels": [1]})
    _steps(model, cm, [token_batch(GBS, 6, seed=1)])
    ids, labels = token_batch(GBS, 15, seed=2)
    with pytest.raises(InputError, match=r"size 15 in dim 1, outside the bounds \(4, 14\)"):
        cm(ids, labels)


@pytest.mark.parametrize("option, error, match", [
    ("yes", mbcompile.errors.ArgumentTypeError, "dynamic must be 'auto', True, False"),
    ({"idz": 1}, InputError, "not a batched tensor input.*'ids', 'labels'"),
    ({"ids": {0: None}}, InputError, "its batch dim"),
    ({"ids": {2: None}}, InputError, "its dims are 0..1"),
    ({"ids": {1: (13, 20)}}, InputError, "the example has 12 there"),
    ({"ids": {1: (1.5, 20)}}, mbcompile.errors.ArgumentTypeError, "positive ints"),
])
def test_a_bad_dynamic_option_is_refused_before_tracing(option, error, match):
    model, (ids, labels) = make_tiny_gpt(GBS, dtype=DTYPE, seq=12)
    with pytest.raises(error, match=match):
        mbcompile.compile(model, GBS, NUM_CSX, MBS, example_inputs=(ids, labels),
                          dynamic=option)


def test_dynamic_false_names_the_users_example_and_the_fixes():
    model, cm = _gpt(dynamic=False)
    ids, labels = token_batch(GBS, 9, seed=3)
    with pytest.raises(InputError) as err:
        cm(ids, labels)
    text = str(err.value)
    assert "('B', 9)" in text and "('B', 12)" in text and "dynamic=False" in text
    assert "dynamic='auto'" in text and "pad" in text


class KeywordNet(nn.Module):
    """Takes keywords through ``**kwargs`` (as transformers' models do): a call with a
    keyword the example did not pass compiles a variant for it (``Request.for_call``)."""

    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(3, 3)

    def forward(self, x: torch.Tensor, **kwargs: Any) -> torch.Tensor:
        scale = kwargs.get("scale")
        loss = (self.lin(x) ** 2).sum(-1).mean()
        return loss if scale is None else loss * scale


def test_a_keyword_variant_names_the_users_example_and_keeps_the_length_symbolic():
    torch.manual_seed(0)
    model = KeywordNet().to(DTYPE)
    cm = mbcompile.compile(model, GBS, NUM_CSX, MBS, cost_model=False, dynamic=False,
                           example_inputs=(torch.randn(GBS, 5, 3, dtype=DTYPE),))
    scale = torch.tensor(2.0, dtype=DTYPE)
    with pytest.raises(InputError, match=r"\('B', 6, 3\) but the example had \('B', 5, 3\)"):
        cm(torch.randn(GBS, 6, 3, dtype=DTYPE), scale=scale)
    auto = mbcompile.compile(model, GBS, NUM_CSX, MBS, cost_model=False,
                             example_inputs=(torch.randn(GBS, 5, 3, dtype=DTYPE),))
    batches = [{"x": torch.randn(GBS, n, 3, dtype=DTYPE), "scale": scale} for n in (6, 4)]
    caught = _steps(model, auto, batches)
    assert len(_recompiles(caught)) == 1, caught  # the keyword's variant, symbolic at once
    variant = auto._variants[frozenset({"scale"})]
    assert variant._request.inputs.symbolic == {"x": {1: (None, None)}}


def test_a_keyword_variant_keeps_the_dims_dynamic_names_symbolic():
    """The keyword variant's check against the example keeps the dims a ``dynamic`` dict
    names symbolic: a call at the example's own length was refused as 'not symbolic'
    (T5 under compile()'s Trainer keyword, whose plain call is such a variant)."""
    torch.manual_seed(0)
    model = KeywordNet().to(DTYPE)
    cm = mbcompile.compile(model, GBS, NUM_CSX, MBS, cost_model=False, dynamic={"x": [1]},
                           example_inputs=(torch.randn(GBS, 5, 3, dtype=DTYPE),))
    scale = torch.tensor(2.0, dtype=DTYPE)
    caught = _steps(model, cm, [{"x": torch.randn(GBS, n, 3, dtype=DTYPE), "scale": scale}
                                for n in (5, 6)])
    assert len(_recompiles(caught)) == 1, caught  # the keyword's variant only


# --------------------------------------------------------------------------- #
# recompute, a two-phase step, torch.compile
# --------------------------------------------------------------------------- #


def test_recompute_is_exact_at_three_lengths():
    model, cm = _gpt(recompute=True, dynamic=True)
    assert cm.plan.recompute
    _steps(model, cm, [token_batch(GBS, n, seed=n) for n in (12, 7, 15)])


class SeqCLIP(nn.Module):
    """A contrastive loss over mean-pooled sequences of two lengths: couples samples
    (a two-phase step), and its text and image lengths vary apart."""

    def __init__(self) -> None:
        super().__init__()
        self.a, self.b = nn.Linear(4, 8), nn.Linear(4, 8)

    def forward(self, text: torch.Tensor, image: torch.Tensor) -> torch.Tensor:
        za = F.normalize(self.a(text).mean(1), dim=-1)
        zb = F.normalize(self.b(image).mean(1), dim=-1)
        logits = za @ zb.T * 5
        return F.cross_entropy(logits, torch.arange(text.size(0)))


def test_a_two_phase_coupled_loss_is_exact_at_three_lengths():
    torch.manual_seed(0)
    model = SeqCLIP().to(DTYPE)
    g = torch.Generator().manual_seed(1)

    def pair(t: int, s: int) -> tuple[torch.Tensor, torch.Tensor]:
        return (torch.randn(GBS, t, 4, generator=g, dtype=DTYPE),
                torch.randn(GBS, s, 4, generator=g, dtype=DTYPE))

    cm = mbcompile.compile(model, GBS, NUM_CSX, MBS, example_inputs=pair(6, 3),
                           cost_model=False)
    caught = _steps(model, cm, [pair(6, 3), pair(4, 5), pair(9, 2)])
    assert len(_recompiles(caught)) == 1, caught
    assert next(iter(cm._variants.values())).analysis.two_phase


# 22 s alone, up to 170 s beside another worker (torch.compile's recompiles): with the
# zoo's extra entries (-m zoo), out of CI's 20 minutes
@pytest.mark.slow
@pytest.mark.zoo
def test_torch_compile_is_exact_at_three_lengths():
    model, cm = _gpt(torch_compile=True, dynamic=True)
    _steps(model, cm, [token_batch(GBS, n, seed=n) for n in (12, 8, 15)])


# --------------------------------------------------------------------------- #
# Refusals: each names the padding fix and changes nothing
# --------------------------------------------------------------------------- #


@contextmanager
def unchanged(model: nn.Module, cm: Any) -> Iterator[None]:
    """The block leaves ``model``'s parameters, buffers, gradients, Python attributes and
    ``cm``'s compiled variants as they were."""
    for p in model.parameters():
        p.grad = torch.full_like(p, 0.5)
    state = {k: v.clone() for k, v in model.state_dict().items()}
    grads = {n: p.grad.clone() for n, p in model.named_parameters()}
    attrs = {id(m): dict(vars(m)) for m in model.modules()}
    variants = dict(cm._variants)
    yield
    assert all(torch.equal(v, model.state_dict()[k]) for k, v in state.items())
    assert all(torch.equal(grads[n], p.grad) for n, p in model.named_parameters())
    for m in model.modules():
        assert {k: v for k, v in vars(m).items() if k != "_modules"}.keys() == \
            {k for k in attrs[id(m)] if k != "_modules"}
        assert all(vars(m)[k] is v for k, v in attrs[id(m)].items() if not k.startswith("_"))
    assert cm._variants == variants


class SeqNormNet(nn.Module):
    """Divides its loss by ``x.size(0) * x.size(1)`` after the batch's sum: the rewritten
    step holds that number as a constant of the example's length."""

    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(3, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return (self.lin(x) ** 2).sum() / (x.size(0) * x.size(1))


class BranchNet(nn.Module):
    """Reads the length as a Python int and branches on it: torch.export keeps the int
    symbolic, but the captured branch only holds for the lengths its guard admits."""

    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(3, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        n = int(x.shape[1])
        h = self.lin(x).reshape(-1, n * 3)
        return (h[:, : 3 * 4] ** 2).mean() if n > 4 else (h ** 2).mean()


class LoopNet(nn.Module):
    """Loops over the length in Python: the trace unrolls the loop for one size."""

    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(3, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.lin(x)
        total = h[:, 0]
        for i in range(1, x.shape[1]):
            total = total + h[:, i]
        return (total ** 2).mean()


class UnequalNet(nn.Module):
    """Branches on the length being other than 16: export's guard ``Ne(n, 16)`` is no
    range, so no bound can hold the step to it."""

    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(3, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.lin(x)
        return (h ** 2).mean() if int(x.shape[1]) != 16 else h.sum()


class PositionTableNet(nn.Module):
    """Adds a position table sliced to a fixed length: any other length fails."""

    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(3, 3)
        self.pos = nn.Parameter(torch.randn(1, 16, 3))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return ((self.lin(x) + self.pos[:, :5]) ** 2).mean()


REFUSALS: dict[str, tuple[Callable[[], nn.Module], type[Exception], str]] = {
    "a number baked in after the loop": (SeqNormNet, InputError,
                                         "not the same program at two lengths: `mul = "),
    "a Python loop over the length": (LoopNet, CaptureError,
                                      r"input 'x' dim 1 \(size 5\) symbolic.*only works"),
    "a size unequal to a constant": (UnequalNet, InputError,
                                     r"only holds where Ne\(s\d+, 16\)"),
    "a table sliced to one length": (PositionTableNet, InputError,
                                     "at another length it cannot be compiled"),
}


@pytest.mark.parametrize("kind", list(REFUSALS))
def test_a_model_that_bakes_a_length_in_is_refused_and_nothing_changes(kind):
    make, error, match = REFUSALS[kind]
    torch.manual_seed(0)
    model = make().to(DTYPE)
    x = torch.randn(GBS, 5, 3, dtype=DTYPE)
    cm = mbcompile.compile(model, GBS, NUM_CSX, MBS, example_inputs=(x,), cost_model=False)
    with unchanged(model, cm), pytest.raises(error, match=match) as err:
        cm(torch.randn(GBS, 7, 3, dtype=DTYPE))
    assert "pad_to_multiple_of=" in str(err.value) and "dynamic=False" in str(err.value)
    model.zero_grad(set_to_none=True)
    assert_close_errors(step_errors(model, cm, (x,)), TOL)  # the example's length still runs


def test_a_branch_on_the_length_bounds_the_dim_to_the_sizes_it_holds_for():
    """torch.export keeps ``int(x.shape[1])`` symbolic and guards the branch (n > 4): the
    step holds from length 5, so the dim is bounded there, checked on every call; bounds
    that ask for more are refused."""
    torch.manual_seed(0)
    model = BranchNet().to(DTYPE)
    x = torch.randn(GBS, 5, 3, dtype=DTYPE)
    cm = mbcompile.compile(model, GBS, NUM_CSX, MBS, example_inputs=(x,), cost_model=False)
    _steps(model, cm, [(torch.randn(GBS, n, 3, dtype=DTYPE),) for n in (7, 5, 9)])
    with unchanged(model, cm), pytest.raises(InputError, match=r"size 4 in dim 1, outside the "
                                             r"bounds \(5, None\)"):
        cm(torch.randn(GBS, 4, 3, dtype=DTYPE))
    with pytest.raises(InputError, match=r"only holds for sizes 5 and more of 'x' dim 1.*asks "
                                         r"for 1 to 64.*dynamic=\{'x': \{1: \(5, None\)\}\}"):
        mbcompile.compile(model, GBS, NUM_CSX, MBS, example_inputs=(x,), cost_model=False,
                          dynamic={"x": {1: (1, 64)}})


# --------------------------------------------------------------------------- #
# transformers: GPT-2 and Llama (export with the length symbolic), BERT, T5
# --------------------------------------------------------------------------- #


@pytest.fixture(scope="module")
def transformers() -> Any:
    tf = pytest.importorskip("transformers")
    tf.logging.set_verbosity_error()
    return tf


def _hf_batch(length: int, seed: int, vocab: int = 64) -> dict[str, torch.Tensor]:
    """Right-padded ids, mask and -100 labels of ``length``; the first row is full."""
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(1, vocab, (GBS, length), generator=g)
    lengths = torch.randint(1, length + 1, (GBS,), generator=g)
    lengths[0] = length
    mask = (torch.arange(length)[None, :] < lengths[:, None]).long()
    return {"input_ids": ids.masked_fill(mask == 0, 0), "attention_mask": mask,
            "labels": ids.masked_fill(mask == 0, -100)}


@pytest.mark.slow
@pytest.mark.parametrize("name", ["gpt2", "llama", "bert"])
def test_hf_model_is_exact_at_five_lengths(transformers, name, monkeypatch):
    from test_hf_models import GRAD_FLOOR, build, rms_norm_in_input_dtype

    if name == "llama":
        from transformers.models.llama import modeling_llama

        monkeypatch.setattr(modeling_llama.LlamaRMSNorm, "forward", rms_norm_in_input_dtype)
    model = build(transformers, name)
    cm = mbcompile.compile(model, GBS, NUM_CSX, MBS, example_kwargs=_hf_batch(8, 0),
                           cost_model=False)
    # compiled as the Trainer calls it (integrations/transformers.py): its keyword, the
    # padded lengths symbolic; this plain loop's call (no keyword) compiles once, silently
    assert 1 in cm._request.inputs.symbolic["input_ids"]  # bounded by the position table
    caught = _steps(model, cm, [_hf_batch(n, n) for n in (8, 5, 12, 3, 16)], GRAD_FLOOR)
    assert not _recompiles(caught), caught
    assert len(cm._variants) == 1 and not next(iter(cm._variants.values()))._variants


@pytest.mark.slow
def test_an_example_cut_from_a_longer_batch_keeps_the_length_symbolic(transformers):
    """An example sliced off a longer batch (``ids[:, :6]``: strided, not contiguous) is
    exported as its values: export traced its strides as sizes and guarded on them
    (length != stride), so the length was refused as baked in, at compile and again at
    the first call of another length."""
    from test_hf_models import GRAD_FLOOR, build

    model = build(transformers, "gpt2")
    cut = {k: v[:, :6] for k, v in _hf_batch(10, 0).items()}
    assert not cut["input_ids"].is_contiguous()
    cm = mbcompile.compile(model, GBS, NUM_CSX, MBS, example_kwargs=cut, cost_model=False)
    assert 1 in cm._request.inputs.symbolic["input_ids"]
    caught = _steps(model, cm, [cut, _hf_batch(9, 9), _hf_batch(4, 4)], GRAD_FLOOR)
    assert not _recompiles(caught), caught


def test_export_copies_a_strided_example_and_inputs_apart_but_not_views_in_one_input():
    """The copy that keeps strides out of export's guards leaves views of one tensor inside
    one input as they are (a write through one is read through the other). Another input's
    view of it is copied apart: export failed inside torch on a write into either, and
    compile() refuses such a write by name (tests/test_input_structures.py), so a graph
    that reads them apart runs only where neither is written."""
    from mbcompile.passes.export_shapes import export_kwargs

    base, other = torch.randn(4, 10), torch.randn(4, 10)
    example = {"lone": torch.randn(4, 10)[:, :6], "a": base[:, :4], "b": base[:, 4:],
               "pair": {"c": other[:, :2], "d": other[:, 2:]}}
    kwargs, _ = export_kwargs(nn.Identity(), example, dict.fromkeys(example, 0))
    assert kwargs["lone"].is_contiguous() and torch.equal(kwargs["lone"], example["lone"])
    assert kwargs["a"] is example["a"]
    assert torch.equal(kwargs["b"], example["b"])
    assert kwargs["b"].untyped_storage().data_ptr() != base.untyped_storage().data_ptr()
    assert kwargs["pair"]["c"] is example["pair"]["c"]
    assert kwargs["pair"]["d"] is example["pair"]["d"]


@pytest.mark.slow
def test_a_vit_at_another_image_size_is_refused_with_the_resize_fix(transformers):
    """ViT interpolates its position table to another image size, but at its config's
    image_size it returns the table as it is (``num_patches == num_positions``): the
    example's size took that branch, so no one step holds at every size. Refused naming
    the branch and the fix, and nothing changes; the example's size still trains."""
    cfg = transformers.ViTConfig(image_size=32, patch_size=8, num_channels=3, hidden_size=16,
                                 num_hidden_layers=1, num_attention_heads=2,
                                 intermediate_size=32, num_labels=3, hidden_dropout_prob=0.0,
                                 attention_probs_dropout_prob=0.0)
    torch.manual_seed(0)
    model = transformers.ViTForImageClassification(cfg).double()

    def batch(size: int) -> dict[str, Any]:
        g = torch.Generator().manual_seed(size)
        return {"pixel_values": torch.randn(GBS, 3, size, size, generator=g, dtype=DTYPE),
                "labels": torch.randint(0, 3, (GBS,), generator=g),
                "interpolate_pos_encoding": True}

    cm = mbcompile.compile(model, GBS, NUM_CSX, MBS, example_kwargs=batch(32),
                           cost_model=False)
    # the call without the Trainer's keyword captures its own graph, whose first guard
    # may be the branch's other side (num_patches != num_positions)
    with unchanged(model, cm), pytest.raises(InputError, match=r"(== 16, a branch taken at "
                                             r"the example's size|only holds where Ne)") as err:
        cm(**batch(48))
    assert "resize every batch to one image size" in str(err.value)
    assert "dynamic=False" in str(err.value)
    model.zero_grad(set_to_none=True)
    errors = step_errors(model, cm, (), batch(32), floor=1e-4, loss=lambda out: out.loss)
    assert_close_errors(errors, TOL)  # the key bias: zero up to rounding, hence the floor


def test_a_transformers_model_that_bakes_the_length_in_compiles_at_the_examples(
        transformers):
    """compile() tries the Trainer's call with the padded length symbolic; a model whose
    position table is sliced to one length cannot take it, so it is compiled at the
    example's length (as ``"auto"`` leaves it), the Trainer's keyword kept, and exact there
    (another length is then refused as ``REFUSALS``' position table is)."""

    class BakedConfig(transformers.PretrainedConfig):
        model_type = "baked-length"

    class BakedLM(transformers.PreTrainedModel):
        config_class = BakedConfig

        def __init__(self, config: Any) -> None:
            super().__init__(config)
            self.emb = nn.Embedding(8, 3)
            self.pos = nn.Parameter(torch.randn(1, 16, 3))

        def forward(self, input_ids: Any, labels: Any = None, **kwargs: Any) -> Any:
            return ((self.emb(input_ids) + self.pos[:, :5]).sum(-1) - labels).pow(2).mean()

    torch.manual_seed(0)
    model = BakedLM(BakedConfig()).to(DTYPE)
    batch = {"input_ids": torch.randint(0, 8, (GBS, 5)),
             "labels": torch.randn(GBS, 5, dtype=DTYPE)}
    cm = mbcompile.compile(model, GBS, NUM_CSX, MBS, example_kwargs=batch, cost_model=False)
    assert not cm._request.inputs.symbolic and cm._keywords == {"num_items_in_batch"}
    batch["num_items_in_batch"] = torch.tensor(GBS * 5)  # the Trainer's call: no compile
    assert_close_errors(step_errors(model, cm, kwargs=batch), TOL)


# 37-50 s: with the zoo's extra entries (-m zoo), out of CI's 20 minutes
@pytest.mark.slow
@pytest.mark.zoo
def test_t5_is_exact_with_encoder_and_decoder_lengths_apart(transformers):
    cfg = transformers.T5Config(vocab_size=64, d_model=32, d_kv=8, d_ff=64, num_layers=2,
                                num_heads=4, dropout_rate=0.0, decoder_start_token_id=0,
                                pad_token_id=0)
    torch.manual_seed(0)
    model = transformers.T5ForConditionalGeneration(cfg).double()

    def batch(source: int, target: int, seed: int) -> dict[str, torch.Tensor]:
        enc, dec = _hf_batch(source, seed), _hf_batch(target, seed + 100)
        return {"input_ids": enc["input_ids"], "attention_mask": enc["attention_mask"],
                "labels": dec["labels"]}

    cm = mbcompile.compile(model, GBS, NUM_CSX, MBS, example_kwargs=batch(8, 4, 0),
                           cost_model=False, dynamic={"input_ids": [1], "attention_mask": [1],
                                                      "labels": [1]})
    caught = _steps(model, cm, [batch(s, t, s * t) for s, t in
                                ((8, 4), (5, 9), (12, 3), (3, 6), (10, 10))], 1e-4)
    assert not _recompiles(caught), caught


# --------------------------------------------------------------------------- #
# Done when: transformers.Trainer with a padding collator trains exactly
# --------------------------------------------------------------------------- #


@pytest.mark.slow
@pytest.mark.parametrize("name", ["gpt2", "llama"])
def test_the_trainer_with_a_padding_collator_trains_like_the_plain_trainer(transformers, name):
    """40 steps of batches padded to their own longest row (5-60 tokens): the parameters
    after training equal the plain Trainer's (float64, float32 regions kept in float64),
    compiled once (benchmarks/bench_dynamic.py runs 200 steps and times both)."""
    _trains_like_the_plain_trainer(transformers, name, 40)


@pytest.mark.slow
@pytest.mark.zoo  # 22-32 s each on the shared 2-core machine (about 11 s of CPU each)
@pytest.mark.parametrize("name", ["gpt2-cls", "bert-mlm"])
def test_the_trainer_with_a_classifier_or_a_masked_lm_trains_like_the_plain_trainer(
        transformers, name):
    """The same, 12 steps: ``DataCollatorWithPadding`` and ``GPT2ForSequenceClassification``
    (the loss reads each row's last real token), and ``BertForMaskedLM`` with
    ``DataCollatorForLanguageModeling(mlm=True)`` (its random masks drawn alike in both
    Trainers: the compiled step draws nothing)."""
    _trains_like_the_plain_trainer(transformers, name, 12)


@pytest.mark.slow
@pytest.mark.zoo  # 32 s on the shared 2-core machine (about 8 s of CPU)
def test_the_trainer_compiles_once_when_its_keyword_and_lengths_are_compiled_up_front(
        transformers):
    """The example with the Trainer's ``num_items_in_batch``, the lengths symbolic and
    ``use_cache=False`` as the Trainer sets it: compile() is the only compile."""
    _trains_like_the_plain_trainer(transformers, "gpt2", 12, upfront=True)


def _trains_like_the_plain_trainer(transformers: Any, name: str, steps: int,
                                   upfront: bool = False) -> None:
    sys.path.insert(0, str(BENCHMARKS))
    try:
        import bench_dynamic
    finally:
        sys.path.remove(str(BENCHMARKS))
    run = bench_dynamic.run_both(transformers, name, steps=steps, upfront=upfront)
    # compile() compiled the Trainer's call, its lengths symbolic: nothing compiles after
    assert run["compiles"] == 1, run["warnings"]
    assert_close_errors(run["errors"], 1e-9)
    assert run["cm"].plan.num_microbatches > 1  # it did split


def test_a_variant_on_the_same_capture_takes_the_first_proof(monkeypatch):
    """``checked_symbolic`` compiles the step again at other lengths; a variant for another
    batch size on the same capture takes that verdict (``Captures.proved``), and stays
    exact at two lengths. The proof finds the other length's step on the first capture
    (its shapes, facts and rewrite again): compile() captures once."""
    from mbcompile import analysis, compiler

    proofs, captures = [], []
    afresh, capture = compiler._at_other_lengths, analysis._capture
    monkeypatch.setattr(compiler, "_at_other_lengths",
                        lambda *a, **k: proofs.append(1) or afresh(*a, **k))
    monkeypatch.setattr(analysis, "_capture",
                        lambda *a, **k: captures.append(1) or capture(*a, **k))
    model, cm = _gpt(dynamic=True)
    assert len(proofs) == 1 and len(captures) == 1
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # the new batch size's BatchSizeWarning
        _steps(model, cm, [token_batch(GBS - 2, n, seed=n) for n in (10, 16)])
    assert len(cm._variants) == 1 and len(proofs) == 1 and len(captures) == 1
    variant = next(iter(cm._variants.values()))
    assert variant._request.inputs.symbolic == cm._request.inputs.symbolic

