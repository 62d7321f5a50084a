"""The model zoo: every architecture of ``tests/zoo.py``, one uneven training step each.

Each case compiles the model for ``GBS = 7`` over ``NUM_CSX = 2`` systems with
``MBS = 2`` (microbatches 2, 2 | 2, 1), runs one compiled step and one eager
full-batch step on the same model, and compares the loss, every output tensor and
every parameter gradient within the entry's tolerance class (``zoo.F64``,
``zoo.F32_LOSS``, ``zoo.F32_INSIDE``, ``zoo.F32_MODEL``; each states its reason,
and the test checks the part of the reason it can see: the eager loss's dtype).
An entry expected ``"two-phase"`` (BatchNorm in training: its ops mix samples) must
match the same way and compile to a two-phase step; a ``"match"`` entry must not (a
plain split: one microbatch of activations, no extra forward). An entry
``"reject:<reason>"`` is refused with a ``MixingError`` whose message names the
reason (none today: what no two-phase step can run).

An entry with ``known_failure`` must match but is refused today: it is marked
``xfail(strict=True, raises=MbcompileError)``. When a fix lands the case passes,
strict turns that pass into a failure, and whoever sees it moves the entry to a
plain match (``python benchmarks/zoo_table.py`` prints today's outcomes). A wrong
number is never an expected failure: only an ``MbcompileError`` is.
"""

from __future__ import annotations

from collections import Counter
from typing import Any

import pytest
import torch
from models import assert_close_errors
from zoo import (
    F32_INSIDE,
    F32_LOSS,
    F32_MODEL,
    F64,
    GBS,
    MATCHES,
    NUM_CSX,
    ZOO,
    ZooModel,
    build_case,
    compare,
    compile_case,
    is_two_phase,
)

from mbcompile import MbcompileError, MixingError
from mbcompile.integrations.transformers import called_plainly

# What issue 12 names, family by family: the zoo must hold at least these.
REQUIRED = {
    "causal LM": {"gpt2", "gpt_neo", "gpt_neox", "gptj", "opt", "bloom", "llama", "mistral",
                  "qwen2", "qwen3", "gemma", "gemma2", "phi", "phi3", "stablelm", "starcoder2",
                  "codegen", "olmo", "olmo2", "cohere", "granite", "falcon", "mamba"},
    "masked LM": {"bert", "roberta", "distilbert", "albert", "electra", "mpnet", "convbert",
                  "deberta"},
    "sequence classification": {"bert_regression"},
    "seq2seq": {"t5", "bart", "pegasus", "mt5", "umt5", "blenderbot_small", "marian", "mbart",
                "longt5"},
    "vision classification": {"vit", "deit", "convnext", "dinov2", "swin", "resnet"},
    "MoE causal LM": {"mixtral", "qwen2_moe", "qwen3_moe", "olmoe", "granitemoe"},
    "PEFT LoRA": {"llama_lora"},
}


# The fast tier (``python -m pytest``) keeps at least one entry per family, the quickest;
# these (each 8-40 s on the 2-core CI machine) are the slow tier's ``zoo`` part (the same
# mechanisms on more architectures, several of CI's minutes), so .ci/run leaves them out
# (``-m "not zoo"``) and ``python -m pytest -m zoo`` runs them.
SLOW = {"longt5", "funnel", "qwen3_moe", "mbart", "olmoe", "t5", "qwen2_moe", "granitemoe",
        "bart", "pegasus", "umt5", "swin", "convbert", "blenderbot_small", "mt5", "starcoder2",
        "mamba", "falcon", "gpt2_classification", "deberta", "gpt_neo", "gemma3", "gemma2",
        "deberta_v2", "resnet", "phi3", "llama_classification", "stablelm", "phi", "cohere",
        "mistral", "codegen", "qwen2", "olmo2", "olmo", "gptj",
        # each family keeps its quickest entries in CI (gpt2, opt, llama; bert, roberta, ...)
        "gpt_neox", "bloom", "qwen3", "gemma", "granite", "mpnet", "roformer"}


def _param(entry: ZooModel) -> Any:
    marks = [pytest.mark.slow, pytest.mark.zoo] if entry.name in SLOW else []
    if entry.known_failure is not None:
        marks.append(pytest.mark.xfail(strict=True, raises=MbcompileError,
                                       reason=f"known failure: {entry.known_failure}"))
    return pytest.param(entry, id=entry.name, marks=marks)


MATCH = [_param(e) for e in ZOO if e.expected in MATCHES]
REJECT = [_param(e) for e in ZOO if e.expected.startswith("reject:")]


@pytest.fixture(autouse=True, scope="module")
def _quiet_transformers() -> None:
    tf = pytest.importorskip("transformers")
    tf.logging.set_verbosity_error()


@pytest.mark.parametrize("entry", MATCH)
def test_zoo_model_matches_eager_full_batch(entry: ZooModel) -> None:
    """Compiled for the example's own call (``called_plainly``), the one the comparison
    makes: by default a transformers model is compiled for the Trainer's call, and a plain
    call then captures its graph again (the silent variant test_hf_models runs), which
    would double each case's export for no other check."""
    pytest.importorskip(entry.requires)
    case = build_case(entry)
    with called_plainly():
        cm = compile_case(case)
    assert cm.plan.per_system_batch_sizes == (4, 3)
    assert is_two_phase(cm) == (entry.expected == "two-phase"), cm.plan.reason
    errors = compare(case, cm)
    assert not cm._variants  # the comparison ran the graph whose plan is checked above
    tolerance = entry.tolerance
    assert tolerance is not None
    assert errors["loss_dtype"] == tolerance.loss_dtype, (
        f"{entry.name} is in the {tolerance.name!r} class ({tolerance.why}), "
        f"but eager's loss is {errors['loss_dtype']}")
    assert errors["loss"] <= tolerance.tol, f"loss: {errors['loss']:.2e} ({tolerance.why})"
    assert_close_errors(errors["outputs"], tolerance.tol)
    assert_close_errors(errors["grads"], tolerance.tol)


@pytest.mark.parametrize("entry", REJECT)
def test_zoo_model_is_rejected_for_its_reason(entry: ZooModel) -> None:
    pytest.importorskip(entry.requires)
    case = build_case(entry)
    before = {k: v.clone() for k, v in case.model.state_dict().items()}
    with pytest.raises(MixingError) as info:
        compile_case(case)
    reason = entry.expected.removeprefix("reject:")
    assert reason.lower() in str(info.value).lower(), str(info.value)
    # Compiling did not touch the state (BatchNorm's running statistics).
    after = case.model.state_dict()
    assert all(torch.equal(v, after[k]) for k, v in before.items())


def test_lora_model_trains_only_its_adapters() -> None:
    """The PEFT entry is a real LoRA setup: only the adapters train."""
    pytest.importorskip("peft")
    case = build_case(next(e for e in ZOO if e.family == "PEFT LoRA"))
    trainable = {n for n, p in case.model.named_parameters() if p.requires_grad}
    assert trainable and all("lora_" in n for n in trainable)
    case.model(**case.kwargs).loss.backward()
    assert {n for n, p in case.model.named_parameters() if p.grad is not None} == trainable


def test_the_fast_tier_has_every_family() -> None:
    assert SLOW <= {e.name for e in ZOO}
    assert {e.family for e in ZOO} == {e.family for e in ZOO if e.name not in SLOW}


def test_zoo_covers_the_issue() -> None:
    names = [e.name for e in ZOO]
    assert len(names) == len(set(names)) >= 40
    for family, required in REQUIRED.items():
        have = {e.name for e in ZOO if e.family == family}
        assert required <= have, f"{family}: missing {required - have}"
    # Every tolerance class is used, and every float32 class names its reason.
    used = Counter(e.tolerance.name for e in ZOO if e.tolerance is not None)
    assert set(used) == {t.name for t in (F64, F32_LOSS, F32_INSIDE, F32_MODEL)}
    assert all(e.why for e in ZOO if e.tolerance in (F32_INSIDE,))
    # A known failure is the first line of an error, recorded for a model that must match.
    for e in ZOO:
        if e.known_failure is not None:
            assert e.expected == "match" and "\n" not in e.known_failure and e.known_failure
    assert (GBS, NUM_CSX) == (7, 2)
