"""The optimizer's state in the plan: sized from the optimizer's own layout.

The oracle is ``optimizer.state`` after one real step: every named optimizer, an
instance before and after its first step, fp32 master weights under ``"-mixed"``, and
the figure ``compile(optimizer=...)`` puts in the plan.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn as nn

import mbcompile
from mbcompile.errors import ArgumentTypeError, InputError
from mbcompile.planning.optimizer_state import NAMES, optimizer_state, with_optimizer
from mbcompile.planning.systems import get_system


def _model(dtype: torch.dtype) -> nn.Module:
    torch.manual_seed(0)  # matrices (factored by Adafactor), vectors, a frozen part
    model = nn.Sequential(nn.Linear(8, 16), nn.LayerNorm(16), nn.Linear(16, 4)).to(dtype)
    model[1].bias.requires_grad_(False)
    return model


def _real_state_bytes(optimizer: torch.optim.Optimizer) -> float:
    """The state tensors with elements that a real step left (0-dim step counts apart)."""
    return float(sum(v.numel() * v.element_size() for s in optimizer.state.values()
                     for v in s.values() if isinstance(v, torch.Tensor) and v.dim() > 0))


def _step(optimizer: torch.optim.Optimizer, model: nn.Module) -> None:
    x = torch.randn(3, 8, dtype=next(model.parameters()).dtype)
    model(x).square().sum().backward()
    optimizer.step()


def _trainable(model: nn.Module) -> list[nn.Parameter]:
    return [p for p in model.parameters() if p.requires_grad]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float64])
@pytest.mark.parametrize("name", sorted(NAMES))
def test_a_named_optimizer_is_sized_as_its_real_step_makes_its_state(name, dtype) -> None:
    model = _model(dtype)
    cls, kwargs = NAMES[name]
    real = cls(_trainable(model), **kwargs)
    _step(real, model)
    state = optimizer_state(name, model)
    assert state.state_bytes == _real_state_bytes(real)
    assert state.num_trainable == sum(p.numel() for p in _trainable(model))


def test_adam_moments_follow_the_parameter_dtype() -> None:
    # torch's Adam keeps exp_avg and exp_avg_sq in each parameter's dtype
    assert optimizer_state("adamw", _model(torch.float32)).bytes_per_param == 8
    assert optimizer_state("adamw", _model(torch.bfloat16)).bytes_per_param == 4
    assert "bfloat16" in optimizer_state("adamw", _model(torch.bfloat16)).layout
    assert optimizer_state("sgd", _model(torch.float32)).bytes_per_param == 0
    assert optimizer_state("sgd-momentum", _model(torch.bfloat16)).bytes_per_param == 2


@pytest.mark.parametrize("make", [
    lambda ps: torch.optim.AdamW(ps, amsgrad=True),
    lambda ps: torch.optim.SGD(ps, lr=0.1, momentum=0.9, nesterov=True),
    lambda ps: torch.optim.RMSprop(ps, centered=True, momentum=0.5),
    lambda ps: torch.optim.Adamax(ps),
    lambda ps: torch.optim.Adafactor(ps),
], ids=["adamw-amsgrad", "sgd-nesterov", "rmsprop-centered", "adamax", "adafactor"])
def test_an_instance_is_sized_before_and_after_its_first_step(make) -> None:
    model = _model(torch.bfloat16)
    optimizer = make(_trainable(model))
    before = optimizer_state(optimizer, model)  # a step of its class on meta tensors
    assert optimizer.state == {} or all(not s for s in optimizer.state.values())
    _step(optimizer, model)
    after = optimizer_state(optimizer, model)  # read off its own state
    assert before.state_bytes == after.state_bytes == _real_state_bytes(optimizer)
    assert "meta" in before.how


def test_a_parameter_without_state_yet_is_counted_after_a_step() -> None:
    model = _model(torch.float32)
    model.append(nn.Linear(4, 4))  # never called: no gradient, no state after a step
    optimizer = torch.optim.AdamW(model.parameters())
    _step(optimizer, model[:3])
    state = optimizer_state(optimizer, model)
    assert state.state_bytes == 8 * sum(p.numel() for p in _trainable(model))
    assert state.state_bytes > _real_state_bytes(optimizer)


def test_a_class_that_cannot_be_rebuilt_is_read_off_its_own_state() -> None:
    class Scaled(torch.optim.SGD):  # a required argument its groups do not hold
        def __init__(self, params, scale):
            super().__init__(params, lr=0.1 * scale, momentum=0.9)

    model = _model(torch.float32)
    optimizer = Scaled(model.parameters(), 2.0)
    with pytest.raises(InputError, match="take one real step"):
        optimizer_state(optimizer, model)
    _step(optimizer, model)
    state = optimizer_state(optimizer, model)
    assert state.state_bytes == _real_state_bytes(optimizer) and "after a step" in state.how


def test_mixed_keeps_fp32_master_weights_and_fp32_state() -> None:
    model = _model(torch.bfloat16)
    masters = [p.detach().float().requires_grad_() for p in _trainable(model)]
    real = torch.optim.AdamW(masters)
    for p in masters:
        p.grad = torch.ones_like(p)
    real.step()
    state = optimizer_state("adamw-mixed", model)
    master = sum(p.numel() * 4 for p in masters)
    assert state.master_bytes == master
    assert state.state_bytes == _real_state_bytes(real) + master
    assert state.bytes_per_param == 12  # + 2 (bf16 weight) + 2 (its gradient) = 16
    fp32 = optimizer_state("adamw-mixed", _model(torch.float32))
    assert fp32.master_bytes == 0 and fp32.bytes_per_param == 8  # fp32 weights are masters


def test_with_optimizer_puts_the_figure_and_its_source_in_the_system() -> None:
    model = _model(torch.bfloat16)
    spec = with_optimizer(get_system("h100-80gb"), "adamw", model)
    assert spec.optimizer_bytes_per_param == 4
    assert "adamw" in spec.optimizer_source and "meta" in spec.optimizer_source
    assert with_optimizer(get_system("h100-80gb"), None, model) is get_system("h100-80gb")


def test_compile_plans_the_optimizer_it_is_given() -> None:
    model = _model(torch.float64)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    x = torch.randn(8, 8, dtype=torch.float64)

    class Loss(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.net = model

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return self.net(x).square().mean()

    cm = mbcompile.compile(Loss(), gbs=8, num_csx=2, mbs=2, example_inputs=(x,),
                           optimizer=optimizer)
    cm(x).backward()
    optimizer.step()
    assert cm.estimate.memory.optimizer == pytest.approx(_real_state_bytes(optimizer), rel=1e-12)


def test_bad_optimizers_are_refused_with_the_names() -> None:
    model = _model(torch.float32)
    with pytest.raises(InputError, match="'adamw-mixed'"):
        optimizer_state("lion", model)
    with pytest.raises(ArgumentTypeError, match="torch.optim.Optimizer"):
        optimizer_state(3, model)

    class Custom(torch.optim.Optimizer):
        def __init__(self, params, scale):  # a required argument the groups do not hold
            super().__init__(params, {})

    with pytest.raises(InputError, match="take one real step"):
        optimizer_state(Custom(model.parameters(), 2.0), model)


def test_the_trainer_plans_the_optimizer_it_trains_with(tmp_path) -> None:
    from mbcompile.models import make_mlp

    model, batch = make_mlp(8)
    optimizer = torch.optim.AdamW(model.parameters(), amsgrad=True)
    trainer = mbcompile.Trainer(model, optimizer, gbs=8, num_csx=2, progress=False,
                                log_dir=tmp_path)
    cm = trainer.compile("train", batch)
    assert "max_exp_avg_sq" in cm.system.optimizer_source  # AMSGrad's third buffer
    assert cm.system.optimizer_bytes_per_param == 3 * batch[0].element_size()
    named = mbcompile.Trainer(model, optimizer, gbs=8, num_csx=2, progress=False,
                              log_dir=tmp_path, compile_options={"optimizer": "adamw-mixed"})
    assert named.compile("train", batch).system.optimizer_source.startswith("adamw-mixed")
