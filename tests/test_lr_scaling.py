"""Learning-rate scaling with the global batch size: rules, defaults, warmup, YAML."""

from __future__ import annotations

import math
import textwrap

import pytest
import torch

import mbcompile
from mbcompile.models import make_mlp
from mbcompile.training.config import load_config
from mbcompile.training.lr_scaling import LRScaling, default_rule, scale_factor


def _opt(kind: str, lr: float = 0.1) -> torch.optim.Optimizer:
    params = [torch.nn.Parameter(torch.zeros(2))]
    return {"sgd": lambda: torch.optim.SGD(params, lr=lr),
            "adamw": lambda: torch.optim.AdamW(params, lr=lr),
            "adam": lambda: torch.optim.Adam(params, lr=lr)}[kind]()


@pytest.mark.parametrize("rule,gbs,ref,want", [
    ("linear", 256, 32, 8.0), ("linear", 16, 32, 0.5), ("sqrt", 128, 32, 2.0),
    ("sqrt", 32, 128, 0.5), ("none", 4096, 32, 1.0)])
def test_scale_factor_against_hand_computed_values(rule, gbs, ref, want):
    assert scale_factor(rule, gbs, ref) == pytest.approx(want)


def test_defaults_sqrt_for_adam_family_linear_for_sgd():
    assert default_rule(_opt("adamw")) == "sqrt"
    assert default_rule(_opt("adam")) == "sqrt"
    assert default_rule(_opt("sgd")) == "linear"


def test_warmup_ramps_from_the_reference_rate_to_the_scaled_one():
    opt = _opt("sgd", lr=0.1)
    scaling = LRScaling.apply(opt, gbs=64, reference_batch_size=16, warmup_steps=4)
    rates = []
    for step in range(6):
        scaling.set_step(opt, step)
        rates.append(opt.param_groups[0]["lr"])
    # 0.1 -> 0.4 (x4, linear) in four equal steps, then flat
    assert rates == pytest.approx([0.175, 0.25, 0.325, 0.4, 0.4, 0.4])


def test_bad_rule_is_an_error():
    with pytest.raises(mbcompile.PlanError, match="lr_scaling"):
        LRScaling.apply(_opt("sgd"), 64, 16, "cubic")


def test_trainer_scales_and_logs_the_choice(capsys):
    model, batch = make_mlp(32)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    trainer = mbcompile.Trainer(model, opt, gbs=32, num_csx=2, reference_batch_size=8,
                                progress=False)
    out = capsys.readouterr().out
    assert "sqrt (the default for AdamW)" in out and "0.001 -> 0.002" in out
    trainer.fit([batch], max_steps=1)
    assert opt.param_groups[0]["lr"] == pytest.approx(1e-3 * math.sqrt(32 / 8))
    with pytest.raises(mbcompile.MbcompileError, match="reference_batch_size"):
        mbcompile.Trainer(model, opt, gbs=32, num_csx=2, lr_scaling="linear", progress=False)


def test_yaml_gbs_change_scales_the_rate(tmp_path, capsys):
    def run(gbs: int) -> float:
        path = tmp_path / f"run{gbs}.yaml"
        path.write_text(textwrap.dedent(f"""\
            model: mlp
            batch_size: {gbs}
            num_csx: 2
            optimizer: {{name: SGD, lr: 0.01}}
            lr_scaling: {{reference_batch_size: 16}}
            fit: {{max_steps: 1, val_steps: 0}}
        """))
        from mbcompile.training.config import build_trainer

        trainer = build_trainer(load_config(path), progress=False, log_dir=str(tmp_path / "o"))
        return trainer.optimizer.param_groups[0]["lr"]

    assert run(16) == pytest.approx(0.01)
    assert run(64) == pytest.approx(0.04)  # SGD: linear
    assert "linear (the default for SGD)" in capsys.readouterr().out
    bad = tmp_path / "bad.yaml"
    bad.write_text("model: mlp\nbatch_size: 8\nlr_scaling:\n  reference_batch_size: 4\n"
                   "  rule: cubic\n")
    with pytest.raises(mbcompile.ConfigError, match=r"bad.yaml:5"):
        load_config(bad)
