"""The schema of a run configuration: its keys, their defaults, and the checks of
each section (``Sections``).

``Sections`` checks each section of a loaded document (types, required and unknown
keys, flag keys and values, import paths, an int MBS against the per-system batch);
each problem is a ``ConfigError`` at the file and line of the value (see ``loader``).
``parse.parse_config`` runs them in order and returns the frozen ``Config``.
"""

from __future__ import annotations

import dataclasses
import warnings
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import torch.nn as nn

import mbcompile.models as models
from mbcompile.errors import MbcompileError
from mbcompile.planning import systems
from mbcompile.planning.plan import make_plan
from mbcompile.request import OUTPUT_MODES
from mbcompile.training.config.checks import (
    Checks,
    optimizer_classes,
    signature_names,
    suggest_from,
    type_name,
)
from mbcompile.training.config.loader import Path_
from mbcompile.training.flags import (
    FLAGS,
    Callback,
    FlagError,
    GlobalFlags,
    ScopedTrainFlags,
    ScopedValidateFlags,
    resolve_key,
)

__all__ = ["BACKENDS", "BUILTIN_MODELS", "CALLBACKS", "DEFAULT_OUTPUTS", "DEFAULT_OUTPUT_ROOT",
           "REQUIRED_TOP", "SHARDS", "SYNTHETIC", "TOP_KEYS", "Sections"]

#: Built-in example models by config name (their synthetic data: ``SYNTHETIC_BATCHES``).
BUILTIN_MODELS: dict[str, type[nn.Module]] = {
    "tiny_gpt": models.TinyGPT,
    "mlp": models.MLP,
    "cnn": models.CNN,
}
CALLBACKS: dict[str, type[Callback]] = {
    "GlobalFlags": GlobalFlags,
    "ScopedTrainFlags": ScopedTrainFlags,
    "ScopedValidateFlags": ScopedValidateFlags,
}
#: ``backend:`` values; auto (default): ranks under a launcher's group of several, else simulated
BACKENDS = ("auto", "simulated", "torch.distributed")
#: ``shard:`` values: none, or FSDP2 (``fully_shard`` per repeated block and at the root).
SHARDS = ("none", "fsdp")
SYNTHETIC = "synthetic"
DEFAULT_OUTPUT_ROOT = "mbcompile-artifacts"

#: Top-level keys: what each holds (also the text of "missing key" errors).
TOP_KEYS: dict[str, str] = {
    "model": "a built-in model name (tiny_gpt, mlp, cnn), {name, kwargs}, or a transformers "
             "model as {class: transformers:LlamaForCausalLM, config: {<its config's fields>}}",
    "data": "'synthetic' (default) or {source: package.module:factory, kwargs}",
    "batch_size": "the global batch size (GBS), an int >= 1",
    "num_csx": "the number of systems, an int >= 1 (default 1)",
    "system": "a system preset name or a mapping of SystemSpec fields",
    "backend": "'auto' (default: the launcher's ranks under torchrun or accelerate launch, "
               "else simulated systems), 'simulated' or 'torch.distributed'",
    "optimizer": "{name: a torch.optim class or package.module:Class, <its kwargs>}",
    "callbacks": "a list of {GlobalFlags | ScopedTrainFlags | ScopedValidateFlags: {flags}}",
    "fit": "{max_steps, val_steps, val_every, log_every, checkpoint_every, keep_checkpoints}",
    "in_dims": "the batch dim of the inputs (default 0)",
    "seed": "the seed for the model's initial weights and synthetic data (default 0)",
    "output_dir": "where artifacts and metrics go (default mbcompile-artifacts/<file name>)",
    "compile_only": "true: compile and estimate, never run",
    "validate_only": "true: stop after capture and batch analysis",
    "lr_scaling": "{reference_batch_size, rule: linear | sqrt | none, warmup_steps}",
    "shard": "'none' (default) or 'fsdp': fully_shard each repeated block and the root",
    "outputs": "what a training step returns, for compile and fit alike: 'loss' (default: "
               "the logits are never kept), 'all', or a list of output names",
    "compile_options": "more of mbcompile.compile's options, by name, for compile and fit "
                       "alike: {precision: bf16-mixed, recompute: true, ...}",
}
#: compile()'s options set by a top-level key of their own, so not under compile_options
#: (``optimizer:`` builds the instance; compile_options.optimizer may name a state layout).
OWN_KEY_OPTIONS = ("system", "backend", "outputs", "compile_only", "validate_only")
LR_SCALING_KEYS = ("reference_batch_size", "rule", "warmup_steps")
REQUIRED_TOP = ("model", "batch_size")
FIT_KEYS = {"max_steps": 10, "val_steps": 2, "val_every": None, "log_every": 1,
            "checkpoint_every": None, "keep_checkpoints": 2}
DATA_KEYS = ("source", "kwargs", "seed", "num_batches", "drop_last")
MODEL_KEYS = ("name", "class", "kwargs", "config", "init")  # name and class: one key, two spellings
#: ``model.init``: "random" draws the weights from ``seed``; "meta" builds the model on the
#: meta device (shapes, no values), for compile-only and validate-only plans of large models.
MODEL_INITS = ("random", "meta")
#: ``outputs:`` when the config sets none: what ``Trainer`` returns without metrics, so
#: that ``mbcompile compile`` plans the step ``mbcompile fit`` runs.
DEFAULT_OUTPUTS = "loss"


class Sections(Checks):
    """The schema, as code: one method per section, each raising a located ``ConfigError``."""

    # -------------------------------------------------------------- sections
    def model(self, value: Any) -> tuple[str, dict[str, Any], dict[str, Any] | None]:
        path: Path_ = ("model",)
        config = None
        if isinstance(value, str):
            name, kwargs, name_path = value, {}, path
        else:
            section = self.mapping(path, value, MODEL_KEYS, (),
                                   " ({name: tiny_gpt, kwargs: {...}}) or a model name")
            spelled = [k for k in ("name", "class") if k in section]
            if not spelled:
                raise self.fail(path, "missing required key 'name' (a built-in model or "
                                "package.module:Class; also spelled class:)", key=True)
            if len(spelled) > 1:
                raise self.fail(path + ("class",), "name and class are one key, spelled two "
                                "ways: keep one", key=True)
            name_path = path + (spelled[0],)
            name = self.string(name_path, section[spelled[0]])
            kwargs = self.kwargs(path + ("kwargs",), section.get("kwargs"))
            if "config" in section:
                config = self.kwargs(path + ("config",), section["config"])
        if name in BUILTIN_MODELS:
            target: Any = BUILTIN_MODELS[name]
        elif ":" in name:
            target = self.importable(name_path, name, "Class")
            if not callable(target):
                raise self.fail(name_path, f"{name!r} is not a class or function")
        else:
            raise self.fail(name_path, f"unknown model {name!r}"
                            f"{suggest_from(name, BUILTIN_MODELS)}; use a built-in example "
                            f"({', '.join(BUILTIN_MODELS)}) or an import path "
                            "package.module:Class")
        if config is not None:
            self.model_config(path + ("config",), name, target, config)
        elif isinstance(getattr(target, "config_class", None), type):
            self.needs_config(path, name, target, kwargs)
        self.signature_kwargs(path + ("kwargs",), target, kwargs,
                              provided=("config",) if config is not None else ())
        return name, kwargs, config

    def model_init(self, value: Any) -> str:
        if not isinstance(value, Mapping) or "init" not in value:
            return "random"
        return self.choice(("model", "init"), value["init"], MODEL_INITS)

    def model_config(self, path: Path_, name: str, target: Any, config: dict[str, Any]) -> None:
        """``model.config``: the fields of ``target.config_class`` (a transformers model's),
        built now so that a bad value is reported here; a key that is not one of its
        arguments but close to one is a typo (transformers would keep it silently)."""
        config_class = getattr(target, "config_class", None)
        if not isinstance(config_class, type):
            raise self.fail(path, f"{name} has no config_class: model.config builds a "
                            "transformers model's configuration (Class.config_class(**config)); "
                            "give this model's arguments under model.kwargs", key=True)
        known = signature_names(config_class)
        for k in config:
            hint = suggest_from(k, known)
            if k not in known and hint:
                raise self.fail(path + (k,), f"{config_class.__name__} has no argument {k!r}"
                                f"{hint}", key=True)
        try:
            config_class(**config)
        except Exception as exc:
            said = " ".join(str(exc).split())  # one line: transformers' errors span several
            raise self.fail(path, f"{config_class.__name__}(**config) failed: "
                            f"{type(exc).__name__}: {said}", key=True) from None

    def needs_config(self, path: Path_, name: str, target: Any, kwargs: dict[str, Any]) -> None:
        """A transformers model class without ``model.config``: say which key builds it."""
        if "config" not in kwargs and "config" in signature_names(target):
            raise self.fail(path, f"{name} is built from a {target.config_class.__name__}: "
                            "give its fields under model.config ({class: " + name +
                            ", config: {hidden_size: 32, ...}})", key=True)

    def data(self, value: Any, model: str
             ) -> tuple[str, dict[str, Any], int | None, int, bool]:
        path: Path_ = ("data",)
        section: dict[str, Any] = {}
        if isinstance(value, str):
            source, source_path = value, path
        else:
            section = self.mapping(path, value, DATA_KEYS,
                                   what=" ({source: synthetic} or {source: pkg.mod:factory})")
            source = section.get("source", SYNTHETIC)
            source_path = path + ("source",)
            self.string(source_path, source)
        kwargs = self.kwargs(path + ("kwargs",), section.get("kwargs"))
        seed = self.optional_integer(path + ("seed",), section.get("seed"), 0)
        num_batches = self.integer(path + ("num_batches",), section.get("num_batches", 4), 1)
        drop_last = self.boolean(path + ("drop_last",), section.get("drop_last", False))
        if source == SYNTHETIC:
            if kwargs:
                raise self.fail(path + ("kwargs",), "synthetic data takes no kwargs (only seed "
                                "and num_batches); for your own data give source: "
                                "package.module:factory", key=True)
            if model not in BUILTIN_MODELS:
                raise self.fail(source_path if "data" in self.m.keys else ("model",),
                                f"synthetic data is built in only for the example models "
                                f"({', '.join(BUILTIN_MODELS)}); for {model!r} give data: "
                                "{source: package.module:factory} returning a dataset or a "
                                "dataloader")
            return source, kwargs, seed, num_batches, drop_last
        if ":" not in source:
            raise self.fail(source_path, f"unknown data source {source!r}"
                            f"{suggest_from(source, [SYNTHETIC])}; use 'synthetic' or an import "
                            "path package.module:factory")
        factory = self.importable(source_path, source, "factory")
        if not callable(factory):
            raise self.fail(source_path, f"{source!r} is not callable")
        accepted = signature_names(factory)
        self.signature_kwargs(path + ("kwargs",), factory, kwargs,
                              provided=[p for p in ("split", "batch_size") if p in accepted])
        return source, kwargs, seed, num_batches, drop_last

    def system(self, value: Any) -> Any:
        """A preset name (kept as written: compile resolves it) or a mapping of
        ``SystemSpec`` fields (built into one here)."""
        path: Path_ = ("system",)
        if value is None:
            return None
        if isinstance(value, str):
            try:
                systems.get_system(self.string(path, value))
            except MbcompileError:
                names = systems.system_names()
                raise self.fail(path, f"unknown system {value!r}{suggest_from(value, names)}; "
                                f"the presets are {', '.join(names)}, or give a mapping of "
                                "SystemSpec fields") from None
            return value
        if not isinstance(value, dict):
            raise self.fail(path, f"must be a preset name or a mapping of SystemSpec fields, "
                            f"got {type_name(value)} {value!r}")
        self.mapping(path, value, [f.name for f in dataclasses.fields(systems.SystemSpec)])
        kwargs = dict(value)
        kwargs.setdefault("name", f"{Path(self.m.file).stem}-system")
        for k, v in kwargs.items():
            if k not in systems.TEXT_FIELDS and v is not None and (
                    isinstance(v, bool) or not isinstance(v, (int, float))):
                raise self.fail(path + (k,), f"must be a number, got {type_name(v)} {v!r}")
        try:
            return systems.SystemSpec(**kwargs)
        except TypeError as exc:  # a required field is missing
            raise self.fail(path, f"not a complete SystemSpec: {exc}", key=True) from None
        except MbcompileError as exc:
            raise self.fail(path, str(exc), key=True) from None

    def optimizer(self, value: Any) -> tuple[str, dict[str, Any]]:
        path: Path_ = ("optimizer",)
        if value is None:
            return "AdamW", {"lr": 1e-3}
        if isinstance(value, str):
            value = {"name": value}
        if not isinstance(value, dict):
            raise self.fail(path, f"must be a mapping {{name: AdamW, lr: 1.0e-3, ...}}, got "
                            f"{type_name(value)} {value!r}")
        if "name" not in value:
            raise self.fail(path, "missing required key 'name' (a torch.optim class such as "
                            "AdamW or SGD, or package.module:Class)", key=True)
        name = self.string(path + ("name",), value["name"])
        classes = optimizer_classes()
        if name in classes:
            target: Any = classes[name]
        elif ":" in name:
            target = self.importable(path + ("name",), name, "Class")
        else:
            raise self.fail(path + ("name",), f"unknown optimizer {name!r}"
                            f"{suggest_from(name, classes)}; use a torch.optim class "
                            f"({', '.join(sorted(classes))}) or package.module:Class")
        kwargs = {k: v for k, v in value.items() if k != "name"}
        self.kwargs(path, kwargs)
        self.signature_kwargs(path, target, kwargs, provided=("params",))
        return name, kwargs

    def callbacks(self, value: Any) -> tuple[tuple[str, dict[str, Any]], ...]:
        path: Path_ = ("callbacks",)
        if value is None:
            return ()
        if not isinstance(value, list):
            raise self.fail(path, f"must be a list of callbacks (- GlobalFlags: {{...}}), got "
                            f"{type_name(value)} {value!r}")
        out = []
        for i, item in enumerate(value):
            item_path = path + (i,)
            if isinstance(item, str):
                item = {item: {}}
            if not isinstance(item, dict) or len(item) != 1:
                raise self.fail(item_path, "each callback is a mapping with one key, its name: "
                                "- GlobalFlags: {micro_batch_size: 4}")
            (name, flags), = item.items()
            if name not in CALLBACKS:
                raise self.fail(item_path + (name,), f"unknown callback {name!r}"
                                f"{suggest_from(name, CALLBACKS)}; choose one of "
                                f"{', '.join(CALLBACKS)}", key=True)
            out.append((name, self.flags(item_path + (name,), flags)))
        return tuple(out)

    def flags(self, path: Path_, value: Any, prefix: str = "",
              out: dict[str, Any] | None = None) -> dict[str, Any]:
        out = {} if out is None else out
        if value is None:
            return out
        if not isinstance(value, dict):
            raise self.fail(path, f"must be a mapping of flags (micro_batch_size: 4), got "
                            f"{type_name(value)} {value!r}")
        paths = [spec.path for spec in FLAGS.values()]
        for k, v in value.items():
            full = f"{prefix}{k}"
            if isinstance(v, dict) and full not in FLAGS and full not in paths \
                    and any(p.startswith(full + ".") for p in paths):
                self.flags(path + (k,), v, full + ".", out)  # nested: csx: {performance: ...}
                continue
            try:
                short = resolve_key(full)
            except FlagError as exc:
                raise self.fail(path + (k,), str(exc), key=True, label=path) from None
            try:
                FLAGS[short].check(v)
            except MbcompileError as exc:
                raise self.fail(path + (k,), str(exc)) from None
            if short in out and out[short] != v:
                raise self.fail(path + (k,), f"flag {short!r} is set twice with different "
                                f"values ({out[short]!r} and {v!r}); keep one", key=True)
            out[short] = v
            self.flag_paths.setdefault(short, []).append(path + (k,))
        return out

    def plan(self, callbacks: Sequence[tuple[str, Mapping[str, Any]]], gbs: int,
             num_csx: int) -> None:
        """An int MBS must fit the per-system batch: say so at the flag's line, now."""
        values = [flags["micro_batch_size"] for _, flags in callbacks
                  if "micro_batch_size" in flags]
        for value, path in zip(values, self.flag_paths.get("micro_batch_size", [])):
            if isinstance(value, int) and not isinstance(value, bool):
                with warnings.catch_warnings():
                    warnings.simplefilter("ignore")  # an adjusted MBS warns when compiling
                    try:
                        make_plan(gbs, num_csx, value)
                    except MbcompileError as exc:
                        raise self.fail(path, str(exc)) from None

    def shard(self, value: Any, backend: str, backend_given: bool, num_csx: int) -> str:
        """``shard: fsdp`` runs on ranks: it makes the backend torch.distributed, and refuses
        a ``backend: simulated`` written beside it and a single system."""
        path: Path_ = ("shard",)
        if isinstance(value, bool) or value is None:  # YAML reads `shard: no` as false
            raise self.fail(path, f"must be one of {', '.join(SHARDS)}, got "
                            f"{type_name(value)} {value!r}")
        shard = self.choice(path, value, SHARDS)
        if shard == "none":
            return shard
        if backend_given and backend == "simulated":
            raise self.fail(path, f"shard: {shard} splits the model over torch.distributed "
                            f"ranks, but backend is {backend!r} (line "
                            f"{self.m.line(('backend',))}): set backend: torch.distributed or "
                            "auto, or remove the backend key, and run with --nproc N or "
                            "torchrun")
        if num_csx < 2:
            raise self.fail(path, f"shard: {shard} splits the model over the ranks, one per "
                            f"system, but num_csx is {num_csx}: set num_csx to the number of "
                            "ranks (2 or more), or use shard: none")
        return shard

    def fit(self, value: Any) -> dict[str, Any]:
        path: Path_ = ("fit",)
        section = self.mapping(path, {} if value is None else value, FIT_KEYS)
        out = {**FIT_KEYS, **section}
        self.integer(path + ("max_steps",), out["max_steps"], 1)
        self.integer(path + ("val_steps",), out["val_steps"], 0)
        self.optional_integer(path + ("val_every",), out["val_every"], 1)
        self.integer(path + ("log_every",), out["log_every"], 1)
        self.optional_integer(path + ("checkpoint_every",), out["checkpoint_every"], 1)
        self.integer(path + ("keep_checkpoints",), out["keep_checkpoints"], 1)
        return out

    def lr_scaling(self, value: Any) -> dict[str, Any] | None:
        if value is None:
            return None
        path: Path_ = ("lr_scaling",)
        section = self.mapping(path, value, LR_SCALING_KEYS, ("reference_batch_size",))
        out = {"reference_batch_size": self.integer(path + ("reference_batch_size",),
                                                    section["reference_batch_size"], 1),
               "warmup_steps": self.integer(path + ("warmup_steps",),
                                            section.get("warmup_steps", 0), 0)}
        if "rule" in section:
            out["lr_scaling"] = self.choice(path + ("rule",), section["rule"],
                                            ("linear", "sqrt", "none"))
        return out

    def outputs(self, value: Any) -> Any:
        """``outputs:`` as ``mbcompile.compile`` takes it: a mode, or output names (a
        dict output's keys) and positions (a tuple output's), kept as a tuple."""
        path: Path_ = ("outputs",)
        if isinstance(value, list):
            if not value:
                raise self.fail(path, "an empty list keeps no output; list the outputs to "
                                f"return, or write one of {', '.join(OUTPUT_MODES)}")
            for i, item in enumerate(value):
                if isinstance(item, bool) or not isinstance(item, (str, int)):
                    raise self.fail(path + (i,), f"an output is a name or a position, got "
                                    f"{type_name(item)} {item!r}")
            return tuple(value)
        if isinstance(value, str) and value not in OUTPUT_MODES:
            raise self.fail(path, f"unknown value {value!r}{suggest_from(value, OUTPUT_MODES)}; "
                            f"choose one of {', '.join(OUTPUT_MODES)}, or list the outputs")
        if not isinstance(value, str):
            raise self.fail(path, f"must be one of {', '.join(OUTPUT_MODES)} or a list of "
                            f"output names, got {type_name(value)} {value!r}")
        return value

    def compile_options(self, value: Any) -> dict[str, Any]:
        """``compile_options:`` the options ``Trainer(compile_options=...)`` takes, by name,
        but those set by a key of their own here (``outputs``, ``system``, ...). Their values
        are ``mbcompile.compile``'s to check, when it runs."""
        path: Path_ = ("compile_options",)
        if value is None:
            return {}
        # here, not at the top: only a config that sets options pays for importing the Trainer
        from mbcompile.training.trainer import COMPILE_OPTIONS

        for k in value if isinstance(value, dict) else ():
            if k in OWN_KEY_OPTIONS:
                raise self.fail(path + (k,), f"{k} has a key of its own: write {k}: at the top "
                                "level of the file, not under compile_options", key=True)
        allowed = [k for k in COMPILE_OPTIONS if k not in OWN_KEY_OPTIONS]
        return dict(self.mapping(path, value, allowed, what=" of mbcompile.compile's options"))

    def in_dims(self, value: Any) -> Any:
        path: Path_ = ("in_dims",)

        def dim(p: Path_, d: Any) -> Any:
            return d if d is None else self.integer(p, d, 0)

        if isinstance(value, list):
            return tuple(dim(path + (i,), d) for i, d in enumerate(value))
        if isinstance(value, dict):
            return {k: dim(path + (k,), d) for k, d in value.items()}
        return dim(path, value)


# --------------------------------------------------------------------------- #
