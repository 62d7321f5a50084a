"""Wrappers users actually pass: peft's PeftModel, torch.compile, DataParallel, DDP.

Their ``forward(*args, **kwargs)`` names no inputs, so mbcompile cannot bind a call to
it; the ``unwrap`` pass finds the module each one hands the call to, and the compiler
binds and captures that one, with a note per wrapper in ``plan.warnings``. What the
user holds keeps working:

- parameters stay shared: the compiled graphs hold the wrapper's own Parameter
  objects, so gradients land in the user's ``.grad``;
- ``cm.state_dict()`` has the keys of the model passed in, wrapper prefixes and all
  (``module.``, ``_orig_mod.``, ``base_model.model.``), so a checkpoint of the
  compiled module loads into the user's wrapper and back, as for an unwrapped model;
- a PEFT LoRA model trains only its adapters: the base weights keep ``.grad is None``.

A wrapper whose forward is not known (any other ``forward(*args, **kwargs)``, or a
subclass that overrides a known forward) is not unwrapped: it may do more than
forward, so it gets the CaptureError it got before.

Sections 1 and 2 test the pass alone and need nothing else. Section 3 calls
``mbcompile.compile(wrapper, ...)`` and NEEDS THE COMPILER INTEGRATION of
``passes/unwrap.py`` (compile() unwraps, binds and captures the inner module, and
``CompiledModule`` keeps the user's wrapper as ``module``).
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F
from models import (
    TOL,
    assert_close_errors,
    grad_errors,
    grads_of,
    keyword_steps,
    mlp,
    rel_err,
)

import mbcompile
from mbcompile.passes.unwrap import Unwrapped, unwrap

GBS, NUM_CSX = 6, 4  # systems get 2, 2, 1, 1 samples


# --------------------------------------------------------------------------- #
# Models
# --------------------------------------------------------------------------- #


class Forwarding(nn.Module):
    """A wrapper mbcompile does not know: its forward could do anything with the call."""

    def __init__(self, module: nn.Module) -> None:
        super().__init__()
        self.module = module

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        return self.module(*args, **kwargs)


class ScaledDataParallel(nn.DataParallel):
    """A DataParallel whose own forward does more than DataParallel's: not unwrapped."""

    def forward(self, *inputs: Any, **kwargs: Any) -> Any:
        loss, pred = super().forward(*inputs, **kwargs)
        return 2 * loss, pred


def tiny_llama(tf: Any) -> nn.Module:
    cfg = tf.LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=64,
                         num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                         max_position_embeddings=16, use_cache=False, bos_token_id=0,
                         eos_token_id=0, pad_token_id=0, attn_implementation="sdpa")
    return tf.LlamaForCausalLM(cfg)


@pytest.fixture(scope="module")
def tf() -> Any:
    transformers = pytest.importorskip("transformers")
    transformers.logging.set_verbosity_error()
    return transformers


@pytest.fixture(scope="module")
def peft() -> Any:
    return pytest.importorskip("peft")


def lora(tf: Any, peft: Any, **config: Any) -> nn.Module:
    """``get_peft_model(tiny_llama, LoraConfig(r=4, target_modules=["q_proj", "v_proj"]))``.

    ``init_lora_weights=False`` draws lora_B at random too: peft's default zero B makes
    the adapter a no-op whose lora_A gradients are exactly zero, which would compare
    nothing. The float64 exactness fixes of test_hf_models are applied (its docstring
    says why): the loss without its float32 upcast here, RMSNorm by the caller.
    """
    from test_hf_models import causal_lm_loss_float64

    torch.manual_seed(0)
    cfg = peft.LoraConfig(r=4, target_modules=["q_proj", "v_proj"], init_lora_weights=False,
                          **config)
    model = peft.get_peft_model(tiny_llama(tf).double(), cfg).double()
    model.get_base_model().loss_function = causal_lm_loss_float64
    return model


@pytest.fixture
def float64_rms_norm(tf: Any, monkeypatch: pytest.MonkeyPatch) -> None:
    from test_hf_models import rms_norm_in_input_dtype
    from transformers.models.llama import modeling_llama

    monkeypatch.setattr(modeling_llama.LlamaRMSNorm, "forward", rms_norm_in_input_dtype)


def batch() -> dict[str, torch.Tensor]:
    from test_hf_models import padded_batch

    return padded_batch(GBS)


def check_lora_step(model: nn.Module, call: Any) -> None:
    """``call(**batch)`` (compiled) against ``model(**batch)`` (eager, the user's own call):
    loss, logits, every trainable gradient; the frozen base weights get no gradient."""
    from test_hf_models import GRAD_FLOOR

    trainable = {n for n, p in model.named_parameters() if p.requires_grad}
    assert trainable and all("lora_" in n for n in trainable)
    out, got, ref, want = keyword_steps(model, call, batch())
    assert rel_err(out.loss, ref.loss) <= TOL and rel_err(out.logits, ref.logits) <= TOL
    assert {n for n, g in got.items() if g is not None} == trainable
    assert {n for n, g in want.items() if g is not None} == trainable
    errors = grad_errors(got, want, GRAD_FLOOR)
    assert set(errors) == trainable
    assert_close_errors(errors, TOL)


@pytest.fixture(scope="module")
def process_group(tmp_path_factory: pytest.TempPathFactory) -> Iterator[None]:
    """A one-process gloo group, for a real DistributedDataParallel on the CPU."""
    dist = torch.distributed
    if not dist.is_available() or dist.is_initialized():
        pytest.skip("needs torch.distributed and no process group of the test run's own")
    store = tmp_path_factory.mktemp("ddp") / "store"
    dist.init_process_group("gloo", init_method=f"file://{store}", rank=0, world_size=1)
    try:
        yield
    finally:
        dist.destroy_process_group()


class _TwoRanks:
    """Stands in for a DDP wrapper's process group of two ranks."""

    def size(self) -> int:
        return 2


# --------------------------------------------------------------------------- #
# 1. The pass alone: what is unwrapped, to what, with which note
# --------------------------------------------------------------------------- #


def test_plain_module_is_not_unwrapped() -> None:
    net, _ = mlp(GBS)
    assert unwrap(net) == Unwrapped(net)


def test_data_parallel_on_cpu_unwraps_to_module() -> None:
    net, _ = mlp(GBS)
    dp = nn.DataParallel(net)  # no GPU: no device_ids, forward calls .module itself
    got = unwrap(dp)
    assert got.module is net and got.prefix == "module" and got.world_size == 1
    assert got.notes == ("unwrapped DataParallel -> .module (MLP): DataParallel on one "
                         "device or none only calls it, after moving the inputs to that device "
                         "(pass them there)",)


def test_torch_compile_unwraps_to_orig_mod() -> None:
    net, _ = mlp(GBS)
    got = unwrap(torch.compile(net))
    assert got.module is net and got.prefix == "_orig_mod"
    assert got.notes[0].startswith("unwrapped OptimizedModule -> ._orig_mod (MLP): ")
    assert "without torch.compile's generated code" in got.notes[0]


def test_ddp_unwraps_to_module_and_reports_its_world(process_group: None,
                                                     monkeypatch: pytest.MonkeyPatch) -> None:
    net, _ = mlp(GBS)
    ddp = nn.parallel.DistributedDataParallel(net)
    got = unwrap(ddp)
    assert got.module is net and got.prefix == "module" and got.world_size == 1
    assert "gradient all-reduce, buffer broadcast and move of the inputs" in got.notes[0]
    monkeypatch.setattr(ddp, "process_group", _TwoRanks())
    assert unwrap(ddp).world_size == 2


def test_peft_model_unwraps_to_its_base_model(tf: Any, peft: Any) -> None:
    model = lora(tf, peft)
    assert type(model).__name__ == "PeftModel"  # no task_type: forward(*args, **kwargs)
    got = unwrap(model)
    assert got.module is model.get_base_model() and got.prefix == "base_model.model"
    assert got.notes == ("unwrapped PeftModel -> .base_model.model (LlamaForCausalLM): peft's "
                         "forward only calls it (its adapter_names and alora_offsets "
                         "arguments, which select adapters per sample, are not supported)",)
    # the same Parameter objects: the wrapper holds nothing but the base model
    assert list(map(id, got.module.parameters())) == list(map(id, model.parameters()))


def test_nested_wrappers_unwrap_outermost_first(tf: Any, peft: Any) -> None:
    model = lora(tf, peft)
    wrapped = nn.DataParallel(torch.compile(model))
    got = unwrap(wrapped)
    assert got.module is model.get_base_model()
    assert got.prefix == "module._orig_mod.base_model.model"
    assert dict(wrapped.named_modules())[got.prefix] is got.module  # state_dict keys' prefix
    assert [n.split(" (")[0] for n in got.notes] == [
        "unwrapped DataParallel -> .module", "unwrapped OptimizedModule -> ._orig_mod",
        "unwrapped PeftModel -> .base_model.model"]


def test_unwrap_is_idempotent(tf: Any, peft: Any) -> None:
    first = unwrap(nn.DataParallel(lora(tf, peft)))
    assert unwrap(first.module) == Unwrapped(first.module)


def test_unknown_forwards_are_not_unwrapped(tf: Any, peft: Any) -> None:
    net, _ = mlp(GBS)
    for wrapper in (Forwarding(net), ScaledDataParallel(net)):
        assert unwrap(wrapper) == Unwrapped(wrapper)
    # peft's task-specific models name their inputs: compiled as they are (see section 2)
    causal = lora(tf, peft, task_type="CAUSAL_LM")
    assert type(causal).__name__ == "PeftModelForCausalLM"
    assert unwrap(causal) == Unwrapped(causal)


def test_wrapper_with_hooks_of_its_own_is_refused() -> None:
    net, _ = mlp(GBS)
    dp = nn.DataParallel(net)
    dp.register_forward_hook(lambda module, args, out: out)
    with pytest.raises(mbcompile.CaptureError, match=r"DataParallel has hooks of its own "
                       r"\(_forward_hooks\).*Fix: register them on a submodule"):
        unwrap(dp)


def test_unrecognised_wrapper_keeps_its_capture_error() -> None:
    net, inputs = mlp(GBS)
    with pytest.raises(mbcompile.CaptureError, match=r"Forwarding\.forward takes \*args; "
                       "mbcompile needs named parameters"):
        mbcompile.compile(Forwarding(net), GBS, NUM_CSX, 1, example_inputs=inputs)


# --------------------------------------------------------------------------- #
# 2. End to end through the pass's result (compile what unwrap finds)
# --------------------------------------------------------------------------- #


def test_lora_base_model_compiles_and_trains_only_adapters(tf: Any, peft: Any,
                                                          float64_rms_norm: None) -> None:
    model = lora(tf, peft)
    cm = mbcompile.compile(unwrap(model).module, GBS, NUM_CSX, 1, example_kwargs=batch())
    check_lora_step(model, cm)


def test_task_specific_peft_model_compiles_as_it_is(tf: Any, peft: Any,
                                                    float64_rms_norm: None) -> None:
    """PeftModelForCausalLM.forward names its inputs: bound and exported directly."""
    model = lora(tf, peft, task_type="CAUSAL_LM")
    cm = mbcompile.compile(model, GBS, NUM_CSX, 2, example_kwargs=batch())
    assert not any("unwrapped" in w for w in cm.plan.warnings)
    check_lora_step(model, cm)


# --------------------------------------------------------------------------- #
# 3. mbcompile.compile(wrapper): NEEDS THE COMPILER INTEGRATION of passes/unwrap.py
# --------------------------------------------------------------------------- #


def test_compile_peft_model_matches_eager(tf: Any, peft: Any, float64_rms_norm: None) -> None:
    model = lora(tf, peft)
    cm = mbcompile.compile(model, GBS, NUM_CSX, 1, example_kwargs=batch())
    assert cm.plan.per_system_batch_sizes == (2, 2, 1, 1) and cm.plan.num_microbatches == 2
    assert cm.plan.warnings == unwrap(model).notes
    assert "unwrapped PeftModel -> .base_model.model (LlamaForCausalLM)" in str(cm.plan)
    assert cm.module is model
    assert list(map(id, cm.parameters())) == list(map(id, model.parameters()))
    assert {id(p) for p in cm.graph_module.parameters()} <= {id(p) for p in model.parameters()}
    state, own = cm.state_dict(), model.state_dict()  # the wrapper's keys, the same tensors
    assert list(state) == list(own) and all(state[k].data_ptr() == own[k].data_ptr() for k in own)
    assert "base_model.model.model.layers.0.self_attn.q_proj.lora_A.default.weight" in state
    check_lora_step(model, cm)


def wrappers() -> list[Any]:
    return [pytest.param(nn.DataParallel, id="DataParallel"),
            pytest.param(lambda m: torch.compile(m, backend="eager"), id="torch.compile"),
            pytest.param(lambda m: nn.DataParallel(torch.compile(m, backend="eager")),
                         id="nested")]


@pytest.mark.parametrize("wrap", wrappers())
def test_compile_wrapper_matches_eager_and_shares_parameters(wrap: Any) -> None:
    net, inputs = mlp(GBS)
    model = wrap(net)
    cm = mbcompile.compile(model, GBS, NUM_CSX, 1, example_inputs=inputs)
    assert cm.module is model and cm.plan.warnings == unwrap(model).notes
    assert list(map(id, cm.parameters())) == list(map(id, net.parameters()))
    model.zero_grad(set_to_none=True)
    loss, pred = cm(*inputs)
    loss.backward()
    got = grads_of(model)
    model.zero_grad(set_to_none=True)
    ref_loss, ref_pred = model(*inputs)  # the user's own call, through the wrapper
    ref_loss.backward()
    assert rel_err(loss, ref_loss) <= TOL and rel_err(pred, ref_pred) <= TOL
    assert_close_errors(grad_errors(got, grads_of(model)), TOL)


@pytest.mark.parametrize("wrap", wrappers())
def test_compile_wrapper_state_dict_round_trips(wrap: Any) -> None:
    """cm.state_dict() is the wrapper's, keys and tensors; each loads into the other."""
    net, inputs = mlp(GBS)
    model = wrap(net)
    cm = mbcompile.compile(model, GBS, NUM_CSX, 1, example_inputs=inputs)
    assert list(cm.state_dict()) == list(model.state_dict())
    changed = {k: v + 1 for k, v in model.state_dict().items()}
    cm.load_state_dict(changed)  # into the user's parameters, in place
    assert all(torch.equal(model.state_dict()[k], v) for k, v in changed.items())
    model.load_state_dict(cm.state_dict())
    with pytest.raises(RuntimeError, match="Missing key"):  # the inner module's keys are not
        cm.load_state_dict(net.state_dict())  # the model's, as for model.load_state_dict
    loss, _ = cm(*inputs)
    assert rel_err(loss, model(*inputs)[0]) <= TOL  # the loaded weights are the ones used


class CentredCounter(nn.Module):
    """Buffers written in forward: an EMA of the batch mean and a step counter."""

    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(8, 3)
        self.register_buffer("center", torch.zeros(3))
        self.register_buffer("steps", torch.zeros((), dtype=torch.long))

    def forward(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        h = self.lin(x)
        with torch.no_grad():
            self.center.mul_(0.9).add_(0.1 * h.mean(0))
            self.steps.add_(1)
        return F.mse_loss(h, y)


@pytest.mark.parametrize("wrap", wrappers())
def test_compile_wrapper_writes_state_back_as_eager(wrap: Any) -> None:
    """Also needs the state-updates work (issue 12 item 0): the graph's buffer names are the
    inner module's, so the write-back resolves them there, not on the user's wrapper."""
    _, (x, y) = mlp(GBS)
    torch.manual_seed(0)
    model, ref = wrap(CentredCounter().double()), wrap(CentredCounter().double())
    ref.load_state_dict(model.state_dict())
    cm = mbcompile.compile(model, GBS, NUM_CSX, 1, example_inputs=(x, y))
    cm(x, y).backward()
    ref(x, y).backward()
    want = ref.state_dict()
    assert list(model.state_dict()) == list(want)
    assert all(rel_err(v, want[k]) <= TOL for k, v in model.state_dict().items())


def test_compile_ddp_on_one_rank(process_group: None) -> None:
    net, inputs = mlp(GBS)
    ddp = nn.parallel.DistributedDataParallel(net)
    cm = mbcompile.compile(ddp, GBS, 1, 2, example_inputs=inputs, backend="torch.distributed")
    assert cm.module is ddp and cm.rank == 0 and list(cm.state_dict()) == list(ddp.state_dict())
    loss, _ = cm(*inputs)
    loss.backward()
    got = grads_of(net)
    net.zero_grad(set_to_none=True)
    F.mse_loss(net.net(inputs[0]), inputs[1]).backward()
    assert_close_errors(grad_errors(got, grads_of(net)), TOL)


def test_compile_ddp_over_ranks_needs_the_distributed_backend(
        process_group: None, monkeypatch: pytest.MonkeyPatch) -> None:
    net, inputs = mlp(GBS)
    ddp = nn.parallel.DistributedDataParallel(net)
    monkeypatch.setattr(ddp, "process_group", _TwoRanks())
    with pytest.raises(mbcompile.InputError, match="backend='torch.distributed'"):
        mbcompile.compile(ddp, GBS, 2, 1, example_inputs=inputs)


def test_compiling_a_compiled_module_compiles_its_model() -> None:
    """``compile(cm)`` (a notebook cell run twice): its model compiled again for the new
    plan, the parameters shared; the first compiled module keeps its own plan. (It was a
    CaptureError quoting CompiledModule's read-only ``__class__``.)"""
    net, inputs = mlp(GBS)
    first = mbcompile.compile(net, GBS, NUM_CSX, 1, example_inputs=inputs, cost_model=False)
    again = mbcompile.compile(first, GBS, 2, 3, example_inputs=inputs, cost_model=False)
    assert again.module is first and again.plan.mbs == 3 and first.plan.mbs == 1
    assert any("unwrapped CompiledModule" in w for w in again.plan.warnings)
    assert list(map(id, again.parameters())) == list(map(id, net.parameters()))
    for cm in (again, first):
        net.zero_grad(set_to_none=True)
        loss, pred = cm(*inputs)
        loss.backward()
        got = grads_of(net)
        net.zero_grad(set_to_none=True)
        ref_loss, ref_pred = net(*inputs)
        ref_loss.backward()
        assert rel_err(loss, ref_loss) <= TOL and rel_err(pred, ref_pred) <= TOL
        assert_close_errors(grad_errors(got, grads_of(net)), TOL)


class Distilling(nn.Module):
    """A student trained on a teacher the user prepared (compiled, scripted) beforehand."""

    def __init__(self, teacher: nn.Module, student: nn.Module) -> None:
        super().__init__()
        self.teacher, self.student = teacher, student

    def forward(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        with torch.no_grad():
            soft = self.teacher(x, y)[1]
        return F.mse_loss(self.student(x, y)[1], soft)


@pytest.mark.parametrize("prepare", ["compiled", "scripted", "traced"])
def test_a_compiled_or_scripted_submodule_is_refused_by_name_changing_nothing(prepare: str
                                                                                ) -> None:
    """The capture cannot trace into either (a compiled module's call is its microbatch
    loop; TorchScript's code is not Python): refused naming the submodule and the fix,
    the wrapper's class and state as they were. (Both were CaptureErrors quoting internals,
    ``__class__`` has no setter and ParameterDict's contains(), and the first left the
    wrapper's class replaced.)"""
    teacher, inputs = mlp(GBS)
    held = {"compiled": lambda: mbcompile.compile(teacher, GBS, NUM_CSX, 1,
                                                  example_inputs=inputs, cost_model=False),
            "scripted": lambda: torch.jit.script(teacher),
            "traced": lambda: torch.jit.trace(teacher, inputs)}[prepare]()
    model = Distilling(held, mlp(GBS)[0])
    before = {k: v.clone() for k, v in model.state_dict().items()}
    with pytest.raises(mbcompile.CaptureError, match=r"Distilling\.teacher is a") as err:
        mbcompile.compile(model, GBS, NUM_CSX, 1, example_inputs=inputs, cost_model=False)
    assert "Fix:" in str(err.value) and "__class__" not in str(err.value)
    assert type(model) is Distilling
    assert all(torch.equal(v, before[k]) for k, v in model.state_dict().items())
