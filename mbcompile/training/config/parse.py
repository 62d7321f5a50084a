"""A run configuration as the Trainer and the CLI read it: the frozen ``Config``, and
``parse_config``, which runs the schema's section checks (``schema.Sections``) over a
loaded document in order and builds one.

>>> from mbcompile.training.config.loader import load_yaml
>>> data, marks = load_yaml("model: mlp\\nbatch_size: 8\\nnum_csx: 2\\n", "run.yaml")
>>> cfg = parse_config(data, marks)
>>> cfg.model, cfg.batch_size, cfg.num_csx, cfg.backend, cfg.output_dir
('mlp', 8, 2, 'auto', 'mbcompile-artifacts/run')
"""

from __future__ import annotations

import json
import os
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from mbcompile.training.config.loader import ConfigError, Marks, Path_
from mbcompile.training.config.schema import (
    BACKENDS,
    BUILTIN_MODELS,
    DEFAULT_OUTPUT_ROOT,
    DEFAULT_OUTPUTS,
    REQUIRED_TOP,
    SYNTHETIC,
    TOP_KEYS,
    Sections,
)
from mbcompile.training.flags import FLAGS

__all__ = ["Config", "parse_config"]


@dataclass(frozen=True)
class Config:
    """A validated run configuration. Build it with :func:`load_config`."""

    file: str
    model: str  # a built-in name or package.module:Class
    model_kwargs: Mapping[str, Any]
    data: str  # "synthetic" or package.module:factory
    data_kwargs: Mapping[str, Any]
    data_seed: int
    num_batches: int  # synthetic: how many distinct batches are cycled
    batch_size: int
    num_csx: int
    system: Any
    backend: str
    optimizer: str
    optimizer_kwargs: Mapping[str, Any]
    callbacks: tuple[tuple[str, Mapping[str, Any]], ...]  # (callback name, short-key flags)
    max_steps: int
    val_steps: int  # 0: no validation inside fit
    val_every: int | None
    log_every: int
    in_dims: Any
    seed: int
    output_dir: str
    compile_only: bool
    validate_only: bool
    marks: Marks = field(repr=False, compare=False)
    lr_scaling: Mapping[str, Any] | None = None  # Trainer keyword arguments, or None
    checkpoint_every: int | None = None  # steps between checkpoints (None: at the end only)
    keep_checkpoints: int = 2  # the newest checkpoints kept
    shard: str = "none"  # "fsdp": the Trainer shards the model with FSDP2 (SHARDS)
    #: ``model.config``: the fields of a transformers model's config, built as
    #: ``model_class.config_class(**model_config)`` and passed first (None: no config).
    model_config: Mapping[str, Any] | None = None
    model_init: str = "random"  # or "meta": built without values, for plans only (MODEL_INITS)
    outputs: Any = DEFAULT_OUTPUTS  # compile's ``outputs``: "loss", "all" or output names
    #: ``compile_options:``: more of compile's options, by name (``Trainer(compile_options=)``)
    compile_options: Mapping[str, Any] = field(default_factory=dict)
    #: ``data.drop_last``: a factory's Dataset is batched without its short last batch
    drop_last: bool = False

    @property
    def builtin(self) -> bool:
        return self.model in BUILTIN_MODELS

    def flags(self, phase: str | None = None) -> dict[str, Any]:
        """The flags in force in ``phase`` ("train", "validate" or None for global)."""
        scoped = {"train": "ScopedTrainFlags", "validate": "ScopedValidateFlags"}.get(phase or "")
        out = {k: spec.default for k, spec in FLAGS.items()}
        for name, flags in self.callbacks:
            if name == "GlobalFlags":
                out.update(flags)
        for name, flags in self.callbacks:
            if name == scoped:
                out.update(flags)
        return out

    def error(self, dotted_path: Path_, message: str) -> ConfigError:
        return self.marks.error(dotted_path, message)

    def to_dict(self) -> dict[str, Any]:
        return {k: v for k, v in self.__dict__.items() if k != "marks"}

    def to_plain(self) -> dict[str, Any]:
        """``to_dict`` as JSON types (what a checkpoint stores)."""
        return json.loads(json.dumps(self.to_dict(), default=str))


def parse_config(data: Any, marks: Marks) -> Config:
    """Validate the document ``data`` (its lines in ``marks``) into a ``Config``."""
    v = Sections(marks)
    top = v.mapping((), data, TOP_KEYS, REQUIRED_TOP)
    model, model_kwargs, model_config = v.model(top["model"])
    model_init = v.model_init(top["model"])
    data_source, data_kwargs, data_seed, num_batches, drop_last = v.data(
        top.get("data", SYNTHETIC), model)
    batch_size = v.integer(("batch_size",), top["batch_size"], 1)
    num_csx = v.integer(("num_csx",), top.get("num_csx", 1), 1)
    if batch_size < num_csx:
        raise marks.error(("batch_size",), f"the global batch size {batch_size} is smaller than "
                          f"num_csx={num_csx}: each system needs at least one sample")
    system = v.system(top.get("system"))
    backend = v.choice(("backend",), top.get("backend", "auto"), BACKENDS)
    shard = v.shard(top.get("shard", "none"), backend, "backend" in top, num_csx)
    if shard != "none":
        backend = "torch.distributed"
    optimizer, optimizer_kwargs = v.optimizer(top.get("optimizer"))
    callbacks = v.callbacks(top.get("callbacks", []))
    v.plan(callbacks, batch_size, num_csx)
    fit = v.fit(top.get("fit", {}))
    compile_only = v.boolean(("compile_only",), top.get("compile_only", False))
    validate_only = v.boolean(("validate_only",), top.get("validate_only", False))
    if compile_only and validate_only:
        raise marks.error(("validate_only",), "compile_only and validate_only are both true; "
                          "choose one (validate_only stops earlier, after the batch analysis)")
    seed = v.integer(("seed",), top.get("seed", 0), 0)
    lr_scaling = v.lr_scaling(top.get("lr_scaling"))
    in_dims = v.in_dims(top.get("in_dims", 0))
    outputs = v.outputs(top.get("outputs", DEFAULT_OUTPUTS))
    options = v.compile_options(top.get("compile_options"))
    output_dir = top.get("output_dir")
    if output_dir is None:
        output_dir = os.path.join(DEFAULT_OUTPUT_ROOT, Path(marks.file).stem)
    output_dir = v.string(("output_dir",), output_dir)
    return Config(
        file=marks.file, model=model, model_kwargs=model_kwargs, data=data_source,
        data_kwargs=data_kwargs, data_seed=data_seed if data_seed is not None else seed,
        num_batches=num_batches, batch_size=batch_size, num_csx=num_csx, system=system,
        backend=backend, optimizer=optimizer, optimizer_kwargs=optimizer_kwargs,
        callbacks=callbacks, max_steps=fit["max_steps"], val_steps=fit["val_steps"],
        val_every=fit["val_every"], log_every=fit["log_every"], in_dims=in_dims, seed=seed,
        output_dir=output_dir, compile_only=compile_only, validate_only=validate_only,
        lr_scaling=lr_scaling, checkpoint_every=fit["checkpoint_every"],
        keep_checkpoints=fit["keep_checkpoints"], shard=shard, model_config=model_config,
        model_init=model_init, outputs=outputs, compile_options=options, drop_last=drop_last,
        marks=marks)
