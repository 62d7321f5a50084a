"""YAML configs: the examples load, every mistake is reported with file and line."""

from __future__ import annotations

import inspect
import sys
import textwrap
from pathlib import Path

import pytest
import torch

from mbcompile import compiler
from mbcompile.planning.systems import SystemSpec
from mbcompile.training.config import (
    ConfigError,
    build_callbacks,
    build_data,
    build_model,
    build_optimizer,
    build_trainer,
    compile_options,
    load_config,
)
from mbcompile.training.flags import GlobalFlags, ScopedTrainFlags

EXAMPLES = Path(__file__).resolve().parent.parent / "examples"
EXAMPLE_FILES = sorted(EXAMPLES.glob("*.yaml"))


def write(tmp_path: Path, text: str, name: str = "run.yaml") -> Path:
    path = tmp_path / name
    path.write_text(textwrap.dedent(text).lstrip("\n"))
    return path


def test_there_is_an_example_for_each_built_in_model():
    assert {p.stem for p in EXAMPLE_FILES} >= {"tiny_gpt", "mlp", "cnn"}


@pytest.mark.parametrize("path", EXAMPLE_FILES, ids=lambda p: p.stem)
def test_examples_load_and_build(path):
    cfg = load_config(path)
    model = build_model(cfg)
    batch = next(iter(build_data(cfg, "train")))
    assert all(t.shape[0] == cfg.batch_size for t in batch)
    loss, _ = model(*batch)
    assert torch.isfinite(loss)
    assert isinstance(build_optimizer(cfg, model), torch.optim.Optimizer)
    assert build_callbacks(cfg)


def test_the_tiny_gpt_example_reads_as_written():
    cfg = load_config(EXAMPLES / "tiny_gpt.yaml")
    assert (cfg.model, cfg.batch_size, cfg.num_csx, cfg.backend) == ("tiny_gpt", 16, 4,
                                                                     "auto")
    assert cfg.model_kwargs["width"] == 32
    assert cfg.optimizer == "AdamW" and cfg.optimizer_kwargs["lr"] == 3e-3  # a float, not '3.0e-3'
    assert cfg.flags() == {"micro_batch_size": "auto"}  # the path key, read as the short one
    assert cfg.flags("train") == {"micro_batch_size": 2}
    assert cfg.flags("validate") == {"micro_batch_size": 4}
    assert (cfg.max_steps, cfg.val_steps, cfg.val_every) == (20, 2, 10)
    assert cfg.output_dir.endswith("tiny_gpt")


def test_yaml_1_2_floats_and_nested_flag_paths(tmp_path):
    cfg = load_config(write(tmp_path, """
        model: mlp
        batch_size: 8
        num_csx: 2
        optimizer: {name: SGD, lr: 1e-2}
        callbacks:
          - GlobalFlags:
              csx:
                performance:
                  micro_batch_size: 2
          - ScopedTrainFlags
    """))
    assert cfg.optimizer_kwargs == {"lr": 0.01}
    assert cfg.flags("train") == {"micro_batch_size": 2}
    callbacks = build_callbacks(cfg, mbs="none")  # --mbs overrides every MBS flag
    assert isinstance(callbacks[0], GlobalFlags) and callbacks[0].flags == {
        "micro_batch_size": "none"}
    assert isinstance(callbacks[-1], ScopedTrainFlags) and callbacks[-1].flags == {}


# (file text, line of the error, words it must contain)
BAD = {
    "wrong type": ("model: mlp\nbatch_size: '8'\n", 2, "batch_size: must be an int, got string"),
    "missing key": ("model: mlp\nnum_csx: 2\n", 1, "missing required key 'batch_size'"),
    "missing name": ("model:\n  kwargs: {}\nbatch_size: 8\n", 1, "missing required key 'name'"),
    "unknown key": ("model: mlp\nbatch_size: 8\nnum_cxs: 2\n", 3,
                    "unknown key 'num_cxs' (did you mean 'num_csx'?)"),
    "unknown nested key": ("model: mlp\nbatch_size: 8\nfit:\n  max_step: 2\n", 4,
                           "did you mean 'max_steps'?"),
    "bad value": ("model: mlp\nbatch_size: 8\nfit:\n  max_steps: 0\n", 4, "at least 1"),
    "unknown model": ("model: tiny_gtp\nbatch_size: 8\n", 1, "did you mean 'tiny_gpt'?"),
    "model kwarg": ("model:\n  name: mlp\n  kwargs:\n    hiden: 4\nbatch_size: 8\n", 4,
                    "MLP has no argument 'hiden' (did you mean 'hidden'?)"),
    "import path": ("model: no_such_pkg.mod:Net\nbatch_size: 8\n", 1,
                    "cannot import 'no_such_pkg.mod:Net'"),
    "unknown callback": ("model: mlp\nbatch_size: 8\ncallbacks:\n  - GlobalFlag: {}\n", 4,
                         "did you mean 'GlobalFlags'?"),
    "unknown flag": ("model: mlp\nbatch_size: 8\ncallbacks:\n  - ScopedTrainFlags:\n"
                     "      csx.performance.micro_batch_sise: 2\n", 5,
                     "did you mean 'csx.performance.micro_batch_size'?"),
    "flag value": ("model: mlp\nbatch_size: 8\ncallbacks:\n  - GlobalFlags:\n"
                   "      micro_batch_size: atuo\n", 5, "unknown mbs 'atuo'"),
    "mbs above pbs": ("model: mlp\nbatch_size: 8\nnum_csx: 2\ncallbacks:\n  - GlobalFlags:\n"
                      "      micro_batch_size: 5\n", 6, "at most the per-system batch size 4"),
    "optimizer": ("model: mlp\nbatch_size: 8\noptimizer: {name: Adamw}\n", 3,
                  "did you mean 'AdamW'?"),
    "optimizer kwarg": ("model: mlp\nbatch_size: 8\noptimizer:\n  name: AdamW\n"
                        "  momentum: 0.9\n", 5, "AdamW has no argument 'momentum'"),
    "backend": ("model: mlp\nbatch_size: 8\nbackend: simulate\n", 3,
                "did you mean 'simulated'?"),
    "duplicate key": ("model: mlp\nbatch_size: 8\nbatch_size: 9\n", 3, "appears twice"),
    "yaml syntax": ("model: mlp\nbatch_size: [8\n", 3, "not valid YAML"),
    "empty": ("", 1, "the file is empty"),
    "not a mapping": ("- model\n", 1, "must be a mapping"),
    "gbs < num_csx": ("model: mlp\nbatch_size: 2\nnum_csx: 4\n", 2, "smaller than num_csx=4"),
    "both only": ("model: mlp\nbatch_size: 8\ncompile_only: true\nvalidate_only: true\n", 4,
                  "both true"),
    "synthetic for own model": ("model: collections:OrderedDict\nbatch_size: 8\n", 1,
                                "synthetic data is built in only for the example models"),
    "data source": ("model: mlp\nbatch_size: 8\ndata: {source: synthetc}\n", 3,
                    "did you mean 'synthetic'?"),
}


@pytest.mark.parametrize("name", list(BAD))
def test_mistakes_name_the_file_and_line(tmp_path, name):
    text, line, words = BAD[name]
    path = write(tmp_path, text, "bad.yaml")
    with pytest.raises(ConfigError) as info:
        load_config(path)
    message = str(info.value)
    assert message.startswith(f"{path}:{line}: "), message
    assert words in message
    assert info.value.line == line and info.value.file == str(path)


def test_a_missing_file_is_a_config_error(tmp_path):
    with pytest.raises(ConfigError, match="no such file"):
        load_config(tmp_path / "nope.yaml")


def test_every_config_key_passed_to_compile_is_a_compile_option(tmp_path):
    """The keys that reach ``mbcompile.compile`` (in_dims, system, backend, compile_only,
    validate_only) name its keyword options: checked here against its signature, which
    the product never reads at run time."""
    params = inspect.signature(compiler.compile).parameters
    cfg = load_config(write(tmp_path, "model: mlp\nbatch_size: 8\nnum_csx: 2\nsystem: host\n"
                                      "backend: torch.distributed\ncompile_only: true\n"))
    assert cfg.compile_only and cfg.backend == "torch.distributed"
    for only in ({}, {"compile_only": True}, {"validate_only": True}):
        options = compile_options(cfg, **only)
        assert set(options) == {"in_dims", "outputs", "system", "backend", *only}
        assert all(params[k].kind is inspect.Parameter.KEYWORD_ONLY for k in options)


def test_a_config_compiles_with_the_options_it_sets(tmp_path):
    cfg = load_config(write(tmp_path, "model: mlp\nbatch_size: 8\nnum_csx: 2\n"
                                      "system: a100-80gb\ncompile_only: true\n"))
    (batch,) = build_data(cfg)[:1]
    cm = compiler.compile(build_model(cfg), cfg.batch_size, cfg.num_csx, 2,
                          example_inputs=batch, **compile_options(cfg, compile_only=True))
    assert cm.compile_only and cm.system.name == "a100-80gb" and cm.plan.mbs == 2


def test_system_is_a_preset_or_the_fields_of_a_system_spec(tmp_path):
    spec = load_config(write(tmp_path, """
        model: mlp
        batch_size: 8
        system:
          memory_bytes: 1.0e+9
          peak_flops: 1.0e+12
          peak_flops_fp32: 5.0e+11
          memory_bandwidth: 1.0e+11
        """)).system
    assert isinstance(spec, SystemSpec) and spec.name == "run-system"
    assert spec.memory_bytes == 1e9
    with pytest.raises(ConfigError, match=r"run.yaml:3: system: unknown system 'a100-80g' "
                                          r"\(did you mean 'a100-80gb'\?\)"):
        load_config(write(tmp_path, "model: mlp\nbatch_size: 8\nsystem: a100-80g\n"))
    with pytest.raises(ConfigError, match=r"run.yaml:4: system.memory_bytes: must be a number"):
        load_config(write(tmp_path, "model: mlp\nbatch_size: 8\nsystem:\n"
                                    "  memory_bytes: lots\n"))
    with pytest.raises(ConfigError, match=r"run.yaml:3: system: not a complete SystemSpec"):
        load_config(write(tmp_path, "model: mlp\nbatch_size: 8\nsystem:\n"
                                    "  memory_bytes: 1.0e+9\n"))


def test_a_system_mapping_states_its_topology_and_reserved_bytes(tmp_path):
    spec = load_config(write(tmp_path, """
        model: mlp
        batch_size: 8
        system:
          memory_bytes: 1.0e+9
          reserved_bytes: 1.0e+8
          reserved_note: the runtime's context
          peak_flops: 1.0e+12
          peak_flops_fp32: 5.0e+11
          memory_bandwidth: 1.0e+11
          devices_per_node: 4
          inter_node_bandwidth: 1.0e+10
        """)).system
    assert spec.usable_bytes == 9e8 and spec.reserved_note == "the runtime's context"
    assert spec.ring_link(8)[0] == 1e10 and spec.ring_link(4)[0] == spec.interconnect_bandwidth


def test_mbcompile_compile_plans_the_optimizer_of_the_config(tmp_path):
    import json

    from mbcompile.training.cli.compile import compile_config

    cfg = load_config(write(tmp_path, """
        model: mlp
        batch_size: 8
        num_csx: 2
        optimizer: {name: SGD, lr: 0.1, momentum: 0.9}
        """))
    compile_config(cfg, tmp_path / "out", mbs=2, compile_only=True)
    report = json.loads((tmp_path / "out" / "plan.json").read_text())["report"]
    assert "momentum_buffer" in report["system"]["optimizer_source"]
    assert report["system"]["optimizer_bytes_per_param"] == 4  # one fp32 buffer (fp32 mlp)


USER_MODULE = '''
import torch
import torch.nn as nn


class Net(nn.Module):
    def __init__(self, features, classes=3):
        super().__init__()
        self.l = nn.Linear(features, classes)

    def forward(self, x, y):
        return nn.functional.cross_entropy(self.l(x), y)


class Pairs(torch.utils.data.Dataset):
    def __init__(self, n, features):
        g = torch.Generator().manual_seed(0)
        self.x = torch.randn(n, features, generator=g)
        self.y = torch.randint(0, 3, (n,), generator=g)

    def __len__(self):
        return len(self.x)

    def __getitem__(self, i):
        return self.x[i], self.y[i]


def dataset(split, features, n=20):
    return Pairs(n if split == "train" else 10, features)
'''


@pytest.fixture
def user_module(tmp_path, monkeypatch):
    name = f"user_models_{abs(hash(tmp_path)) % 10**8}"
    (tmp_path / f"{name}.py").write_text(USER_MODULE)
    monkeypatch.syspath_prepend(str(tmp_path))
    yield name
    sys.modules.pop(name, None)


def test_import_path_model_and_dataset_factory(tmp_path, user_module):
    cfg = load_config(write(tmp_path, f"""
        model:
          name: {user_module}:Net
          kwargs: {{features: 4}}
        data:
          source: {user_module}:dataset
          kwargs: {{features: 4}}
        batch_size: 6
        num_csx: 2
    """))
    model = build_model(cfg)
    batches = list(build_data(cfg, "train"))
    assert [len(y) for _, y in batches] == [6, 6, 6, 2]  # 20 samples: the short last kept
    assert all(x.shape == (len(y), 4) for x, y in batches)
    assert torch.isfinite(model(*batches[0]))
    assert [len(y) for _, y in build_data(cfg, "validate")] == [6, 4]


def test_every_row_of_a_dataset_is_trained_once_an_epoch(tmp_path, user_module):
    """A factory's Dataset is batched with its short last batch (the Trainer trains it
    exactly): one epoch of fit trains every row once. ``data.drop_last: true`` keeps whole
    batches only."""
    def config(drop_last: str) -> Path:
        return write(tmp_path, f"""
            model: {{name: {user_module}:Net, kwargs: {{features: 4}}}}
            data: {{source: {user_module}:dataset, kwargs: {{features: 4}}{drop_last}}}
            batch_size: 6
            num_csx: 2
            callbacks: [{{GlobalFlags: {{micro_batch_size: 2}}}}]
        """)

    cfg = load_config(config(""))
    assert not cfg.drop_last
    rows = torch.cat([x for x, _ in build_data(cfg, "train")])  # shuffled: every row once
    dataset = sys.modules[user_module].dataset("train", 4)
    assert sorted(map(tuple, rows.tolist())) == sorted(map(tuple, dataset.x.tolist()))
    trainer = build_trainer(cfg, log_dir=str(tmp_path / "run"), progress=False)
    trained = trainer.fit(build_data(cfg, "train"), max_steps=4)  # one epoch: 6 + 6 + 6 + 2
    assert [r["samples"] for r in trained] == [6, 6, 6, 2]
    cfg = load_config(config(", drop_last: true"))
    assert [len(y) for _, y in build_data(cfg, "train")] == [6, 6, 6]


def test_import_path_kwargs_are_checked_against_the_signature(tmp_path, user_module):
    with pytest.raises(ConfigError, match=r"run.yaml:2: .*needs the argument\(s\) features"):
        load_config(write(tmp_path, f"""
            model:
              name: {user_module}:Net
            data: {user_module}:dataset
            batch_size: 6
        """))
    with pytest.raises(ConfigError, match=r"run.yaml:5: data.kwargs.split: 'split' is set by "
                                          r"mbcompile"):
        load_config(write(tmp_path, f"""
            model: {{name: {user_module}:Net, kwargs: {{features: 4}}}}
            data:
              source: {user_module}:dataset
              kwargs:
                split: train
                features: 4
            batch_size: 6
        """))


def test_the_sharded_example_reads_as_written():
    """``examples/fsdp/`` (a folder of its own: it runs on ranks only, not in the plain
    example runs): ``shard: fsdp`` makes the backend torch.distributed."""
    cfg = load_config(EXAMPLES / "fsdp" / "tiny_gpt.yaml")
    assert (cfg.model, cfg.shard, cfg.backend, cfg.num_csx) == ("tiny_gpt", "fsdp",
                                                                "torch.distributed", 2)
    assert cfg.output_dir.endswith("tiny_gpt_fsdp")


def test_outputs_is_what_compile_and_fit_both_use(tmp_path):
    """``mbcompile compile`` plans the step ``mbcompile fit`` runs (issue 26, item 6):
    the ``outputs`` key, by default the loss only, reaches both the same way."""
    for text, outputs in (("", "loss"), ("outputs: all\n", "all"),
                          ("outputs: [loss, 1]\n", ("loss", 1))):
        cfg = load_config(write(tmp_path, "model: mlp\nbatch_size: 8\nnum_csx: 2\n" + text))
        trainer = build_trainer(cfg, log_dir=str(tmp_path / "run"), progress=False)
        assert cfg.outputs == outputs
        assert compile_options(cfg)["outputs"] == trainer.compile_options["outputs"] == outputs
    with pytest.raises(ConfigError, match=r"run.yaml:3: outputs: unknown value 'los' "
                                          r"\(did you mean 'loss'\?\)"):
        load_config(write(tmp_path, "model: mlp\nbatch_size: 8\noutputs: los\n"))
    with pytest.raises(ConfigError, match=r"run.yaml:5: outputs\[1\]: an output is a name or a "
                                          r"position, got float 1.5"):
        load_config(write(tmp_path, "model: mlp\nbatch_size: 8\noutputs:\n  - loss\n"
                                    "  - 1.5\n"))


def test_a_transformers_model_from_its_class_and_config(tmp_path):
    """``model: {class: transformers:LlamaForCausalLM, config: {...}}`` builds
    ``Class(Class.config_class(**config))``; its mistakes are located like any other."""
    pytest.importorskip("transformers")
    cfg = load_config(EXAMPLES / "hf" / "llama.yaml")
    model = build_model(cfg)
    assert type(model).__name__ == "LlamaForCausalLM"
    assert (model.config.hidden_size, model.config.num_hidden_layers) == (32, 2)
    assert torch.equal(next(model.parameters()), next(build_model(cfg).parameters()))  # seeded
    batch = next(iter(build_data(cfg, "train")))
    assert batch["input_ids"].shape == (cfg.batch_size, 16)
    assert torch.isfinite(model(**batch).loss)

    llama = "model:\n  class: transformers:LlamaForCausalLM\n"
    mistakes = [
        (llama + "  config: {hidden_sise: 32}\n",
         r"run.yaml:3: model.config.hidden_sise: LlamaConfig has no argument 'hidden_sise' "
         r"\(did you mean 'hidden_size'\?\)"),
        (llama + "  config: {hidden_size: 30, num_attention_heads: 4}\n",
         r"run.yaml:3: model.config: LlamaConfig\(\*\*config\) failed: .*not a multiple"),
        (llama, r"run.yaml:1: model: transformers:LlamaForCausalLM is built from a "
                r"LlamaConfig: give its fields under model.config"),
        ("model:\n  class: mlp\n  config: {width: 3}\n",
         r"run.yaml:3: model.config: mlp has no config_class"),
        ("model:\n  class: mlp\n  name: mlp\n", r"run.yaml:2: model.class: name and class "
                                                r"are one key"),
    ]
    for text, message in mistakes:
        with pytest.raises(ConfigError, match=message):
            load_config(write(tmp_path, text + "batch_size: 8\n"))


def test_model_init_meta_plans_what_the_materialised_model_plans(tmp_path):
    """``model: {..., init: meta}`` builds the model on the meta device, tied weights and
    all (no memory); ``mbcompile compile --compile-only`` plans it with the figures of the
    same model built with values; compiling it for real and training it are refused, each
    naming the way that works."""
    pytest.importorskip("transformers")
    import json

    from mbcompile.training.cli.compile import compile_config
    from mbcompile.training.cli.messages import CommandError

    text = (EXAMPLES / "hf" / "llama.yaml").read_text()
    sys.path.insert(0, str(EXAMPLES / "hf"))  # hf_tokens, beside the example
    try:
        tied = text.replace("  config:\n", "  config:\n    tie_word_embeddings: true\n")
        meta = load_config(write(tmp_path, tied.replace("  config:\n", "  init: meta\n  config:\n"),
                                 "meta.yaml"))
        plain = load_config(write(tmp_path, tied, "plain.yaml"))
        assert meta.model_init == "meta" and plain.model_init == "random"
        model = build_model(meta)
        assert all(p.is_meta for p in model.parameters())
        assert model.lm_head.weight is model.model.embed_tokens.weight  # still tied
        reports = {}
        for name, cfg in (("meta", meta), ("plain", plain)):
            compile_config(cfg, tmp_path / name, compile_only=True)
            reports[name] = json.loads((tmp_path / name / "plan.json").read_text())
        assert reports["meta"]["plan"] == reports["plain"]["plan"]
        assert reports["meta"]["report"]["estimate"] == reports["plain"]["report"]["estimate"]
        with pytest.raises(CommandError, match="add --compile-only"):
            compile_config(meta, tmp_path / "real")
        with pytest.raises(ConfigError, match=r"meta.yaml:\d+: model.init: init: meta builds the "
                                              r"model without values"):
            build_trainer(meta)
    finally:
        sys.path.remove(str(EXAMPLES / "hf"))
    big = build_model(load_config(EXAMPLES / "hf" / "llama_1b_meta.yaml"))  # no memory
    c = big.config
    layer = (2 * c.hidden_size * c.hidden_size  # q and o; k and v are GQA-sized
             + 2 * c.hidden_size * c.num_key_value_heads * (c.hidden_size // c.num_attention_heads)
             + 3 * c.hidden_size * c.intermediate_size + 2 * c.hidden_size)
    assert sum(p.numel() for p in big.parameters()) == \
        c.vocab_size * c.hidden_size + c.num_hidden_layers * layer + c.hidden_size  # tied
    assert big.lm_head.weight.is_meta and big.lm_head.weight is big.model.embed_tokens.weight
    with pytest.raises(ConfigError, match=r"model.init: unknown value 'metal' \(did you mean "
                                          r"'meta'\?\)"):
        load_config(write(tmp_path, "model: {name: mlp, init: metal}\nbatch_size: 8\n"))


def test_compile_options_reach_compile_and_fit_alike(tmp_path, capsys):
    """``compile_options:`` sets more of compile()'s options by name: the Trainer that
    ``fit`` builds and ``mbcompile compile`` get them the same way; a misspelt option is
    a located ConfigError with "did you mean", an option with a key of its own is sent
    there."""
    from mbcompile.training.cli.main import main

    head = "model: mlp\nbatch_size: 8\nnum_csx: 2\n"
    path = write(tmp_path, head + "compile_options:\n  precision: bf16-mixed\n"
                                  "  recompute: false\n  nonfinite: return\n"
                                  "  optimizer: adamw-mixed\n")
    cfg = load_config(path)
    options = {"precision": "bf16-mixed", "recompute": False, "nonfinite": "return",
               "optimizer": "adamw-mixed"}
    assert cfg.compile_options == options
    trainer = build_trainer(cfg, log_dir=str(tmp_path / "run"), progress=False)
    assert options.items() <= trainer.compile_options.items()
    assert options.items() <= compile_options(cfg).items()
    # mbcompile compile plans under them: the plan's precision is the config's
    assert main(["compile", str(path), "--compile-only", "--mbs", "2",
                 "--out", str(tmp_path / "art")]) == 0
    plan = (tmp_path / "art" / "plan.txt").read_text()
    assert "precision: bf16-mixed" in plan and "adamw-mixed" in plan
    assert "precision: bf16-mixed" in capsys.readouterr().out
    with pytest.raises(ConfigError) as info:
        load_config(write(tmp_path, head + "compile_options:\n  recompte: true\n"))
    assert str(info.value).startswith(f"{tmp_path / 'run.yaml'}:5: compile_options: unknown "
                                      "key 'recompte' (did you mean 'recompute'?)")
    with pytest.raises(ConfigError, match=r"run.yaml:5: compile_options.outputs: outputs has "
                                          r"a key of its own: write outputs: at the top level"):
        load_config(write(tmp_path, head + "compile_options:\n  outputs: all\n"))
    with pytest.raises(ConfigError, match=r"run.yaml:4: compile_options: this section must "
                                          r"be a mapping of mbcompile.compile's options"):
        load_config(write(tmp_path, head + "compile_options: bf16-mixed\n"))
