"""A trained model captured by its repeated block (``passes/export_blocks.py``).

Export traces the model cut to two layers and the graph is grown to all of them; the
compiled step must still equal eager PyTorch on the full batch in float64 (GPT-2 and
Llama at 5 layers, gbs 7 over 2 systems, mbs 2). Where a later layer differs in what the
two-layer trace cannot see (a flag the trace read, a submodule class, a hook, a
non-plain attribute), or the forward reads the layer list's length or picks from it, the
model is captured whole, and still trains exactly. The guards are the user's: a value
changed later in any layer, or on the model itself, compiles again.
"""

from __future__ import annotations

import warnings
from typing import Any

import pytest
import torch
import torch.nn as nn
from models import TOL, assert_close_errors, step_errors
from test_block_probe import _structure
from test_hf_models import causal_lm_loss_float64, padded_batch, rms_norm_in_input_dtype

import mbcompile
from mbcompile.passes.export_blocks import capture_once_per_block
from mbcompile.passes.export_capture import export_capture

GBS, NUM_CSX, MBS, DEPTH = 7, 2, 2, 5
GRAD_FLOOR = 1e-4  # attention key biases: a gradient zero up to rounding


def _gpt2(tf: Any) -> nn.Module:
    return tf.GPT2LMHeadModel(tf.GPT2Config(
        vocab_size=64, n_positions=16, n_embd=32, n_layer=DEPTH, n_head=4, resid_pdrop=0.0,
        embd_pdrop=0.0, attn_pdrop=0.0, bos_token_id=0, eos_token_id=0,
        attn_implementation="sdpa"))


def _llama(tf: Any) -> nn.Module:
    return tf.LlamaForCausalLM(tf.LlamaConfig(
        vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=DEPTH,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=16,
        use_cache=False, bos_token_id=0, eos_token_id=0, pad_token_id=0,
        attn_implementation="sdpa"))


@pytest.mark.slow
@pytest.mark.parametrize("make", [_gpt2, pytest.param(_llama, marks=pytest.mark.zoo)],
                         ids=["gpt2", "llama"])
def test_transformers_trained_by_blocks_equal_eager(make: Any,
                                                    monkeypatch: pytest.MonkeyPatch) -> None:
    tf = pytest.importorskip("transformers")
    tf.logging.set_verbosity_error()
    from transformers.models.llama import modeling_llama

    monkeypatch.setattr(modeling_llama.LlamaRMSNorm, "forward", rms_norm_in_input_dtype)
    torch.manual_seed(0)
    model = make(tf).double()
    model.loss_function = causal_lm_loss_float64  # no float32 upcast: exact in float64
    batch = padded_batch(GBS)
    names = list(batch)

    def exported(module: nn.Module) -> Any:
        return export_capture(module, batch, dict.fromkeys(names, 0))

    grown = capture_once_per_block(model, exported)
    assert grown is not None  # captured by blocks, and the same graph as whole
    assert _structure(grown.graph_module) == _structure(exported(model).graph_module)
    cm = mbcompile.compile(model, GBS, NUM_CSX, MBS, example_kwargs=batch)
    assert cm.plan.microbatch_sizes == ((2, 2), (2, 1))
    assert_close_errors(step_errors(model, cm, (), batch, floor=GRAD_FLOOR), TOL)


class Block(nn.Module):
    """Alike layers: one class, one parameter shape; ``scale`` a plain value forward reads."""

    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(8, 8)
        self.scale = 1.0

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        return torch.tanh(self.lin(h)) * self.scale


class Net(nn.Module):
    """``how`` says how forward walks the layers (``"iterate"``: as transformers does)."""

    def __init__(self, how: str = "iterate") -> None:
        super().__init__()
        self.layers = nn.ModuleList(Block() for _ in range(DEPTH))
        self.how = how
        self.offset = 0.0

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        layers: Any = self.layers
        if self.how == "slice-all":
            layers = self.layers[:DEPTH]
        elif self.how == "slice-some":
            layers = self.layers[:3]
        elif self.how == "pick-last":
            layers = [*self.layers[:-1], self.layers[-1]]
        for layer in layers:
            x = layer(x)
        if self.how == "len":
            x = x / len(self.layers)
        return (x + self.offset).pow(2).mean()


def _exported(model: nn.Module, x: torch.Tensor) -> Any:
    return capture_once_per_block(model, lambda m: export_capture(m, {"x": x}, {"x": 0}))


def _trains_exactly(model: nn.Module, x: torch.Tensor) -> mbcompile.CompiledModule:
    cm = mbcompile.compile(model, GBS, NUM_CSX, MBS, example_inputs=(x,), capture="export")
    assert_close_errors(step_errors(model, cm, (x,)), TOL)
    return cm


def _hook(module: nn.Module, args: Any, out: torch.Tensor) -> torch.Tensor:
    return out * 2


def _later_layer_differs(model: Net, how: str) -> None:
    later = model.layers[3]
    if how == "hook":
        later.lin.register_forward_hook(_hook)
    elif how == "attribute":  # not a plain value: no guard would see it
        for layer in model.layers:
            layer.table = (torch.zeros(1),)
        later.table = (torch.ones(1),)
    elif how == "buffer":
        later.lin.register_buffer("seen", torch.zeros(2))


def _fresh(how: str = "iterate") -> tuple[Net, torch.Tensor]:
    torch.manual_seed(0)
    return Net(how).double(), torch.randn(GBS, 8, dtype=torch.float64)


@pytest.mark.parametrize("how", ["iterate", "slice-all"])
def test_alike_layers_are_captured_by_blocks_and_train_exactly(how: str) -> None:
    model, x = _fresh(how)
    assert _exported(model, x) is not None
    _trains_exactly(model, x)


@pytest.mark.parametrize("how", ["len", "slice-some", "pick-last"])
def test_a_forward_that_reads_the_list_is_captured_whole(how: str) -> None:
    """Two layers would answer ``len()``, ``[:3]`` or ``[-1]`` otherwise than five."""
    model, x = _fresh(how)
    assert _exported(model, x) is None
    _trains_exactly(model, x)


@pytest.mark.parametrize("how", ["hook", "attribute", "buffer"])
def test_a_later_layer_that_differs_unseen_is_captured_whole(how: str) -> None:
    model, x = _fresh()
    _later_layer_differs(model, how)
    assert _exported(model, x) is None
    if how != "buffer":  # an unread buffer changes nothing; the others change the step
        _trains_exactly(model, x)


def test_the_flag_and_class_conditions_hold_for_training() -> None:
    """commit 109e911's two models (tests/test_block_probe.py): a flag set by index and a
    submodule class that differs are captured whole, and train exactly."""
    from test_block_probe import _ActivationBlock, _FlagBlock, _FlagNet

    for block in (_FlagBlock, _ActivationBlock):
        torch.manual_seed(0)
        model, x = _FlagNet(block).double(), torch.randn(GBS, 8, dtype=torch.float64)
        assert _exported(model, x) is None
        _trains_exactly(model, x)


@pytest.mark.parametrize("where", ["later-layer", "model"])
def test_a_value_changed_after_compile_compiles_again(where: str) -> None:
    """The guards are on the user's modules: layer 3's ``scale`` (copied from layer 1's
    trace) and the model's own ``offset`` (read on the cut model's shallow copy)."""
    model, x = _fresh()
    cm = _trains_exactly(model, x)
    if where == "later-layer":
        model.layers[3].scale = 0.5
    else:
        model.offset = 0.25
    with pytest.warns(mbcompile.RecompileWarning):
        cm(x)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        assert_close_errors(step_errors(model, cm, (x,)), TOL)


def _func(kernel: Any) -> nn.Module:
    """A parameter-free helper of a class made afresh on every call, as transformers 5.25
    gives each attention layer ``_kernel_funcs = {"rotary_pos_emb": Func()}``."""
    class Func(nn.Module):
        def forward(self, h: torch.Tensor) -> torch.Tensor:
            return kernel(h)

    return Func()


def _rotate(h: torch.Tensor) -> torch.Tensor:
    return torch.cat([-h[..., 4:], h[..., :4]], dim=-1)


def _flip(h: torch.Tensor) -> torch.Tensor:
    return h.flip(-1)


class KernelBlock(Block):
    """A ``Block`` that reads its helper from a dict, which holds a module of its own class."""

    def __init__(self, kernel: Any = _rotate) -> None:
        super().__init__()
        self._kernel_funcs = {"rotary_pos_emb": _func(kernel)}

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        return torch.tanh(self.lin(self._kernel_funcs["rotary_pos_emb"](h))) * self.scale


def _kernel_net(later: Any = _rotate) -> tuple[Net, torch.Tensor]:
    model, x = _fresh()
    torch.manual_seed(1)
    model.layers = nn.ModuleList(KernelBlock(_rotate if k < 3 else later)
                                 for k in range(DEPTH)).double()
    return model, x


def test_per_layer_helper_classes_of_one_source_are_captured_by_blocks() -> None:
    """Each layer's helper is of a class of its own, made by one class statement: the
    layers are alike, captured by their block, train exactly, and each later layer's
    guard holds its own helper (no recompile on the next calls)."""
    model, x = _kernel_net()
    assert len({type(layer._kernel_funcs["rotary_pos_emb"]) for layer in model.layers}) == DEPTH
    assert _exported(model, x) is not None
    cm = _trains_exactly(model, x)
    with warnings.catch_warnings():
        warnings.simplefilter("error", mbcompile.RecompileWarning)
        cm(x)
        assert_close_errors(step_errors(model, cm, (x,)), TOL)


def test_a_later_helper_that_runs_other_code_is_captured_whole() -> None:
    """Layers 3 and 4 close over another kernel: same class statement, other behaviour."""
    model, x = _kernel_net(later=_flip)
    assert _exported(model, x) is None
    _trains_exactly(model, x)
