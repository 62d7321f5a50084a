"""Code replaced after compile compiles again (``guard_values.method_lookups``).

The graph holds what forward's code did at compile. Each of these replacements changed
what eager runs while the compiled module kept the old code, silently (a submodule's
forward replaced on the instance: 1.2169 eager against 1.1983 compiled; ``Block.forward``
patched on the class, a helper method, ``nn.Linear.forward`` under export, the model's own
forward wrapped, a hook replaced under its key, ``m.__class__`` swapped, a parent's forward
reached through ``super()``, a method a helper calls, a property, ``self.act = torch.sin``
for ``torch.tanh``). Each step here
is compared with eager's: the loss, every ``.grad`` and the parameters after it.
"""

from __future__ import annotations

import copy
import types
import warnings
from collections.abc import Callable
from typing import Any

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

import mbcompile

DTYPE = torch.float64
GBS, NUM_CSX, MBS = 7, 2, 2
TOL = 1e-12


class Base(nn.Module):
    def forward(self, h: torch.Tensor) -> torch.Tensor:
        return self.act(h)


class Block(Base):
    """Code forward reaches: the parent's forward through super(), a helper and the helper
    it calls, a property, a torch function held in an attribute."""

    def __init__(self) -> None:
        super().__init__()
        self.lin, self.act = nn.Linear(8, 8), torch.tanh

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        return super().forward(self.squash(self.lin(h))) * self.scale

    def squash(self, h: torch.Tensor) -> torch.Tensor:
        return self.inner(h) + 0.1

    def inner(self, h: torch.Tensor) -> torch.Tensor:
        return h * 0.5

    @property
    def scale(self) -> float:
        return 1.0


class Net(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.inp, self.block, self.out = nn.Linear(4, 8), Block(), nn.Linear(8, 3)

    def forward(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        return F.cross_entropy(self.out(self.block(self.inp(x))), y)


def _doubled(self: nn.Module, h: torch.Tensor) -> torch.Tensor:
    return torch.tanh(self.lin(h)) * 2


def _wrap_root(m: nn.Module) -> None:
    forward = m.forward
    m.forward = lambda x, y: forward(2 * x, y)


def _replace_hook(m: nn.Module) -> None:
    hooks = m.block._forward_hooks
    hooks[next(iter(hooks))] = lambda module, args, out: out * 3


class Doubled(Block):
    forward = _doubled


#: name -> (applied to the compiled and the eager model between the steps, capture)
CHANGES: dict[str, tuple[Callable[[nn.Module], None], str]] = {
    "instance forward": (lambda m: setattr(m.block, "forward",
                                           types.MethodType(_doubled, m.block)), "auto"),
    "instance forward, export": (lambda m: setattr(m.block, "forward",
                                                   types.MethodType(_doubled, m.block)),
                                 "export"),
    "root forward wrapped": (_wrap_root, "auto"),
    "hook replaced under its key": (_replace_hook, "auto"),
    "class swapped": (lambda m: setattr(m.block, "__class__", Doubled), "auto"),
    "a torch function in an attribute": (lambda m: setattr(m.block, "act", torch.sin), "auto"),
}


def _steps(model: nn.Module, ref: nn.Module, cm: Any, change: Callable[[nn.Module], None]
           | None) -> list[str]:
    """Two SGD steps each way, ``change`` applied to both models between them; returns the
    RecompileWarnings."""
    opts = [torch.optim.SGD(m.parameters(), lr=0.1) for m in (model, ref)]
    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        for step in range(2):
            if step and change is not None:
                change(model)
                change(ref)
            torch.manual_seed(step)
            x, y = torch.randn(GBS, 4, dtype=DTYPE), torch.randint(0, 3, (GBS,))
            losses = []
            for call, opt in zip((cm, ref), opts):
                opt.zero_grad(set_to_none=True)
                losses.append(call(x, y))
                losses[-1].backward()
                opt.step()
            assert torch.allclose(losses[0], losses[1], rtol=TOL, atol=0), (step, losses)
            for (name, p), q in zip(model.named_parameters(), ref.parameters()):
                assert torch.allclose(p.grad, q.grad, rtol=TOL, atol=TOL), (step, name)
                assert torch.allclose(p, q, rtol=TOL, atol=TOL), (step, name)
    return [str(w.message) for w in seen if issubclass(w.category, mbcompile.RecompileWarning)]


def _pair(capture: str = "auto", hooked: bool = False) -> tuple[nn.Module, nn.Module, Any]:
    torch.manual_seed(0)
    model = Net().to(DTYPE)
    if hooked:
        model.block.register_forward_hook(lambda module, args, out: out * 2)
    ref = copy.deepcopy(model)
    cm = mbcompile.compile(model, GBS, NUM_CSX, MBS, example_inputs=(
        torch.randn(GBS, 4, dtype=DTYPE), torch.randint(0, 3, (GBS,))), cost_model=False,
        capture=capture)
    return model, ref, cm


@pytest.mark.parametrize("name", list(CHANGES))
def test_code_replaced_on_an_instance_compiles_again(name: str) -> None:
    change, capture = CHANGES[name]
    model, ref, cm = _pair(capture, hooked=name.startswith("hook"))
    _steps(model, ref, cm, change)


@pytest.mark.parametrize("owner,attr,new", [
    (Block, "forward", _doubled),
    (Base, "forward", lambda self, h: torch.sin(h)),
    (Block, "squash", lambda self, h: h * 0.25),
    (Block, "inner", lambda self, h: h * 0.25),
    (Block, "scale", property(lambda self: 2.0)),
    (nn.Linear, "forward", lambda self, h: F.linear(h, self.weight, self.bias) * 1.5),
], ids=["Block.forward", "Base.forward (through super())", "Block.squash (a helper)",
        "Block.inner (through the helper)", "Block.scale (a property)", "nn.Linear.forward"])
@pytest.mark.parametrize("capture", ["auto", "export"])
def test_a_method_patched_on_the_class_compiles_again(owner: type, attr: str, new: Any,
                                                      capture: str, monkeypatch) -> None:
    model, ref, cm = _pair(capture)
    said = _steps(model, ref, cm, lambda m: monkeypatch.setattr(owner, attr, new))
    if owner is not nn.Linear:  # named where it changed (a torch layer under fx: live)
        assert any(f"{owner.__name__}.{attr}" in w for w in said), said


def test_the_models_forward_replaced_under_fx_is_refused_at_the_call_changing_nothing():
    model, ref, cm = _pair("fx")
    _steps(model, ref, cm, None)
    _wrap_root(model)
    state = copy.deepcopy(model.state_dict())
    with pytest.raises(mbcompile.MbcompileError, match="replaced on the instance"):
        cm(torch.randn(GBS, 4, dtype=DTYPE), torch.randint(0, 3, (GBS,)))
    assert all(torch.equal(v, model.state_dict()[k]) for k, v in state.items())


def test_an_installed_packages_function_patched_after_compile_compiles_again(monkeypatch):
    """transformers' ``eager_attention_forward`` replaced after compile ran the old one
    (3.907367 against eager's 3.907366, parameters 6e-6 apart after a step)."""
    transformers = pytest.importorskip("transformers")
    from transformers.models.gpt2 import modeling_gpt2

    torch.manual_seed(0)
    config = transformers.GPT2Config(n_embd=16, n_layer=1, n_head=2, vocab_size=50,
                                     n_positions=16, attn_implementation="eager",
                                     resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0)
    model = transformers.GPT2LMHeadModel(config).to(DTYPE)
    ref = copy.deepcopy(model)
    ids = torch.randint(0, 50, (GBS, 8))
    cm = mbcompile.compile(model, GBS, NUM_CSX, MBS, example_kwargs={
        "input_ids": ids, "labels": ids}, cost_model=False)
    original = modeling_gpt2.eager_attention_forward
    before = ref(input_ids=ids, labels=ids).loss
    cm(input_ids=ids, labels=ids)  # the call's own variant, compiled before the patch

    def sharper(module: nn.Module, query: Any, key: Any, value: Any, *args: Any,
                **kwargs: Any) -> Any:
        return original(module, query * 2, key, value, *args, **kwargs)

    monkeypatch.setattr(modeling_gpt2, "eager_attention_forward", sharper)
    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        got, want = cm(input_ids=ids, labels=ids).loss, ref(input_ids=ids, labels=ids).loss
    # the loss is float32 (transformers upcasts the logits): rounding, against the patch's
    assert abs(float(got - want)) < 1e-3 * abs(float(want - before)), (got, want, before)
    said = [str(w.message) for w in seen if issubclass(w.category, mbcompile.RecompileWarning)]
    assert any("eager_attention_forward" in w for w in said), [str(w.message) for w in seen]
