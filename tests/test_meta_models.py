"""Meta and fake models plan like the materialised model, and what cannot fit fails fast.

A model built on the meta device (``with torch.device("meta")``) or under the user's own
``FakeTensorMode`` compiles with ``compile_only=True`` or ``validate_only=True``: its
modelled figures (MBS, peak memory, step time, parameter count with tied weights counted
once) equal the same model's on the CPU, with meta, fake or real example inputs. Static
memory is checked before anything is traced (``planning/static_memory.py``).
"""

from __future__ import annotations

from typing import Any

import pytest
import torch
import torch.nn as nn
from torch._subclasses.fake_tensor import FakeTensorMode

import mbcompile
from mbcompile import CompileOnlyError, compiler
from mbcompile.errors import CostModelError, DoesNotFitError, InputError
from mbcompile.models import TinyGPT, token_batch
from mbcompile.planning.systems import SystemSpec

GPT = dict(vocab=64, width=32, depth=2, heads=2, seq=16)


def _figures(model: nn.Module, inputs: tuple[Any, ...], **options: Any) -> tuple[Any, ...]:
    cm = mbcompile.compile(model, 8, 2, "auto", example_inputs=inputs, compile_only=True,
                           system="host", **options)
    e = cm.estimate
    return (cm.plan.mbs, e.memory.peak, e.memory.activations, e.time.step,
            cm.selection.cost.static.num_params, cm.selection.cost.probes_run)


def _gpt_inputs() -> tuple[torch.Tensor, torch.Tensor]:
    return token_batch(4, GPT["seq"], GPT["vocab"], seed=1)


def test_meta_and_fake_gpt_plan_as_the_materialised_one() -> None:
    torch.manual_seed(0)
    want = _figures(TinyGPT(**GPT), _gpt_inputs())
    with torch.device("meta"):
        meta = TinyGPT(**GPT)
    ids, labels = _gpt_inputs()
    assert _figures(meta, (ids.to("meta"), labels.to("meta"))) == want
    assert _figures(meta, (ids, labels)) == want  # real inputs beside meta parameters
    mode = FakeTensorMode()
    with mode:
        fake = TinyGPT(**GPT)
    assert _figures(fake, (mode.from_tensor(ids), mode.from_tensor(labels))) == want


def test_meta_model_compiles_only_and_calling_it_says_so() -> None:
    with torch.device("meta"):
        model = TinyGPT(**GPT)
    ids, labels = (t.to("meta") for t in _gpt_inputs())
    cm = mbcompile.compile(model, 8, 1, 2, example_inputs=(ids, labels), compile_only=True,
                           cost_model=False)
    with pytest.raises(CompileOnlyError, match="compile_only=True") as info:
        cm(ids, labels)
    assert "its parameters hold no data (the meta device" in str(info.value)
    assert all(p.is_meta for p in model.parameters())  # nothing was materialised
    validation = mbcompile.compile(model, 8, 2, 2, example_inputs=(ids, labels),
                                   validate_only=True)
    assert validation.graph_module is not None


def test_transformers_llama_on_meta_keeps_tied_weights_and_figures() -> None:
    transformers = pytest.importorskip("transformers")
    config = transformers.LlamaConfig(
        vocab_size=128, hidden_size=32, intermediate_size=64, num_hidden_layers=1,
        num_attention_heads=4, num_key_value_heads=2, tie_word_embeddings=True)
    torch.manual_seed(0)
    real = transformers.LlamaForCausalLM(config)
    with torch.device("meta"):
        meta = transformers.LlamaForCausalLM(config)
    assert meta.lm_head.weight is meta.model.embed_tokens.weight  # tied, not untied by to_empty
    ids = torch.randint(0, 128, (4, 16))
    want = _figures(real, (ids,), example_kwargs={"labels": ids}, outputs="loss")
    got = _figures(meta, (ids.to("meta"),), example_kwargs={"labels": ids.to("meta")},
                   outputs="loss")
    assert got == want
    assert got[4] == sum(p.numel() for p in real.parameters())  # the tied matrix once


def test_compile_only_auto_refuses_an_unchecked_mbs(monkeypatch: pytest.MonkeyPatch) -> None:
    from mbcompile import selection

    def broken(*args: Any, **kwargs: Any) -> Any:
        raise CostModelError("the cost model could not run TinyGPT (as a test breaks it)")

    monkeypatch.setattr(selection, "analyse_cost", broken)
    model = TinyGPT(**GPT)
    with pytest.raises(CostModelError, match="compile_only=True with mbs='auto' needs the "
                       "cost model.*as a test breaks it"):
        mbcompile.compile(model, 16, 2, "auto", example_inputs=_gpt_inputs(),
                          compile_only=True)


def _system(gigabytes: float, optimizer_bytes: float = 8.0) -> SystemSpec:
    return SystemSpec(name="small", memory_bytes=gigabytes * 1e9, peak_flops=1e14,
                      peak_flops_fp32=1e13, memory_bandwidth=1e12,
                      optimizer_bytes_per_param=optimizer_bytes)


def _big(rows: int = 50_000, cols: int = 50_000) -> tuple[nn.Module, torch.Tensor]:
    """A 2.5e9-parameter fp32 model on the meta device: 10 GB of weights."""
    with torch.device("meta"):
        model = nn.Sequential(nn.Linear(cols, rows, bias=False))
    return model, torch.zeros(4, cols, device="meta")


def _refused(model: nn.Module, x: torch.Tensor, system: SystemSpec, num_csx: int,
             monkeypatch: pytest.MonkeyPatch) -> str:
    def traced(*args: Any, **kwargs: Any) -> Any:
        raise AssertionError("static memory is checked before anything is traced")

    monkeypatch.setattr(compiler, "analyse", traced)
    with pytest.raises(DoesNotFitError) as info:
        mbcompile.compile(model, 8, num_csx, "auto", example_inputs=(x,), system=system,
                          compile_only=True)
    return str(info.value)


def test_static_memory_fails_before_tracing_and_names_the_fsdp_world(
        monkeypatch: pytest.MonkeyPatch) -> None:
    model, x = _big()
    # 10 GB weights + 10 GB gradients + 20 GB of Adam state = 40 GB per system, on 15 GB
    text = _refused(model, x, _system(15), 2, monkeypatch)
    assert "needs 40.00 GB on each system" in text
    assert "at least 3 ranks" in text and "num_csx=3" in text  # ceil(40 / 15)
    assert "optimizer='sgd'" not in text  # 20 GB without any state: no help alone
    assert "more systems (num_csx) to" not in text


def test_static_memory_names_a_smaller_optimizer_state_when_it_fits(
        monkeypatch: pytest.MonkeyPatch) -> None:
    model, x = _big()
    text = _refused(model, x, _system(25), 4, monkeypatch)
    assert "optimizer='sgd' (0 B of state, static memory 20.00 GB)" in text
    assert "optimizer='sgd-momentum'" not in text  # 30 GB: does not fit either
    assert "at least 2 ranks" in text


def test_measuring_a_model_without_data_is_refused() -> None:
    with torch.device("meta"):
        model = TinyGPT(**GPT)
    ids, labels = (t.to("meta") for t in _gpt_inputs())
    with pytest.raises(InputError, match="measure=True times real.*hold no data"):
        mbcompile.compile(model, 8, 2, 2, example_inputs=(ids, labels), compile_only=True,
                          measure=True)
