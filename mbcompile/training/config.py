"""YAML run configurations: load, validate (with file and line), build the run's objects.

One file describes a run; everything is checked before anything runs, and every
error names the file and the line::

    model:
      name: tiny_gpt                # built-in: tiny_gpt, mlp, cnn; or package.module:Class
      kwargs: {width: 32, depth: 2}
    data: synthetic                 # or {source: package.module:factory, kwargs: {...}}
    batch_size: 16                  # the global batch size (GBS)
    num_csx: 4
    optimizer: {name: AdamW, lr: 1.0e-3}
    callbacks:
      - GlobalFlags: {csx.performance.micro_batch_size: auto}
      - ScopedTrainFlags: {micro_batch_size: 2}
    fit: {max_steps: 10, val_steps: 2, checkpoint_every: 5}
    shard: fsdp                     # or none (default): FSDP2 per block and at the root

How a file becomes a run:

1. ``load_config(path)`` composes the YAML into nodes (yaml's ``compose`` keeps each
   node's line), builds the Python values from them, and records the line of every
   key and value by its path (``("model", "kwargs", "width")``);
2. the schema below checks every section: types, required keys, unknown keys (with
   "did you mean", from difflib), flag keys and values, import paths (imported
   now, and keyword arguments checked against the signature), and returns a frozen
   ``Config``. A problem raises ``ConfigError("tiny_gpt.yaml:7: model.kwargs: ...")``;
3. ``build_model``, ``build_data``, ``build_optimizer``, ``build_callbacks`` and
   ``build_trainer`` make the objects; their failures name the line as well.

``1e-3`` is a float here (YAML 1.2), not the string YAML 1.1 makes of it.
"""

from __future__ import annotations

import importlib
import inspect
import json
import os
import re
import sys
import warnings
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
import torch.nn as nn
import yaml
from yaml.constructor import ConstructorError, SafeConstructor
from yaml.nodes import MappingNode, Node, ScalarNode, SequenceNode

from mbcompile import models
from mbcompile.errors import MbcompileError
from mbcompile.planning.plan import make_plan
from mbcompile.training.flags import (
    FLAGS,
    Callback,
    FlagError,
    GlobalFlags,
    ScopedTrainFlags,
    ScopedValidateFlags,
    resolve_key,
    suggest,
)

__all__ = [
    "BACKENDS",
    "BUILTIN_MODELS",
    "SHARDS",
    "CALLBACKS",
    "Config",
    "ConfigError",
    "build_callbacks",
    "build_data",
    "build_model",
    "build_optimizer",
    "build_trainer",
    "load_config",
    "parse_config",
]

Path_ = tuple[Any, ...]  # a key path into the document: ("callbacks", 0, "GlobalFlags")

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
BACKENDS = ("simulated", "torch.distributed")
#: ``shard:`` values: none, or FSDP2 (``fully_shard`` per repeated block and at the root).
SHARDS = ("none", "fsdp")
SYNTHETIC = "synthetic"
DEFAULT_OUTPUT_ROOT = "mbcompile-artifacts"

#: Top-level keys: what each holds (also the text of "missing key" errors).
TOP_KEYS: dict[str, str] = {
    "model": "a built-in model name (tiny_gpt, mlp, cnn) or {name, kwargs}",
    "data": "'synthetic' (default) or {source: package.module:factory, kwargs}",
    "batch_size": "the global batch size (GBS), an int >= 1",
    "num_csx": "the number of systems, an int >= 1 (default 1)",
    "system": "a system preset name or a mapping of SystemSpec fields",
    "backend": "'simulated' (default) or 'torch.distributed'",
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
}
LR_SCALING_KEYS = ("reference_batch_size", "rule", "warmup_steps")
REQUIRED_TOP = ("model", "batch_size")
FIT_KEYS = {"max_steps": 10, "val_steps": 2, "val_every": None, "log_every": 1,
            "checkpoint_every": None, "keep_checkpoints": 2}
DATA_KEYS = ("source", "kwargs", "seed", "num_batches")
MODEL_KEYS = ("name", "kwargs")


class ConfigError(MbcompileError, ValueError):
    """A configuration problem, located: ``file:line: key: what is wrong and how to fix it``."""

    def __init__(self, message: str, *, file: str | None = None, line: int | None = None,
                 key: str | None = None) -> None:
        where = f"{file}:{line}: " if file and line else f"{file}: " if file else ""
        what = f"{key}: " if key else ""
        super().__init__(f"{where}{what}{message}")
        self.file, self.line, self.key = file, line, key


# --------------------------------------------------------------------------- #
# Loading with line numbers
# --------------------------------------------------------------------------- #


class _Loader(yaml.SafeLoader):
    """SafeLoader that reads ``1e-3`` as a float, as YAML 1.2 does (1.1 makes it a string)."""


_Loader.add_implicit_resolver(
    "tag:yaml.org,2002:float",
    re.compile(r"^[-+]?(?:[0-9][0-9_]*)(?:\.[0-9_]*)?[eE][-+]?[0-9]+$"),
    list("-+0123456789"))


def _dotted(path: Path_) -> str:
    out = ""
    for part in path:
        out += f"[{part}]" if isinstance(part, int) else (f".{part}" if out else str(part))
    return out


@dataclass(frozen=True)
class _Marks:
    """Where each key and value of one YAML file is (1-based lines)."""

    file: str
    keys: Mapping[Path_, int]
    values: Mapping[Path_, int]

    def line(self, path: Path_, *, key: bool = False) -> int:
        table = (self.keys, self.values) if key else (self.values, self.keys)
        p = tuple(path)
        while True:
            for t in table:
                if p in t:
                    return t[p]
            if not p:
                return 1
            p = p[:-1]

    def error(self, path: Path_, message: str, *, key: bool = False) -> ConfigError:
        return ConfigError(message, file=self.file, line=self.line(path, key=key),
                           key=_dotted(path) or None)


def _construct(node: Node, path: Path_, ctor: SafeConstructor, keys: dict[Path_, int],
               values: dict[Path_, int], file: str) -> Any:
    values.setdefault(path, node.start_mark.line + 1)
    if isinstance(node, MappingNode):
        merged = any(k.tag == "tag:yaml.org,2002:merge" for k, _ in node.value)
        ctor.flatten_mapping(node)  # resolves merge keys (<<: *anchor); later keys override
        out: dict[Any, Any] = {}
        for key_node, value_node in node.value:
            if not isinstance(key_node, ScalarNode):
                raise ConfigError("mapping keys must be plain scalars", file=file,
                                  line=key_node.start_mark.line + 1, key=_dotted(path) or None)
            key = ctor.construct_object(key_node, deep=True)
            if key in out and not merged:
                raise ConfigError(
                    f"key {key!r} appears twice (first at line {keys[path + (key,)]}); "
                    "YAML would silently keep the last one: remove one of them",
                    file=file, line=key_node.start_mark.line + 1, key=_dotted(path) or None)
            keys[path + (key,)] = key_node.start_mark.line + 1
            out[key] = _construct(value_node, path + (key,), ctor, keys, values, file)
        return out
    if isinstance(node, SequenceNode):
        return [_construct(item, path + (i,), ctor, keys, values, file)
                for i, item in enumerate(node.value)]
    return ctor.construct_object(node, deep=True)


def _load_yaml(text: str, file: str) -> tuple[Any, _Marks]:
    loader = _Loader(text)
    try:
        node = loader.get_single_node()
    except yaml.MarkedYAMLError as exc:
        mark = exc.problem_mark or exc.context_mark
        line = mark.line + 1 if mark is not None else None
        raise ConfigError(f"not valid YAML: {exc.problem or exc.context}", file=file,
                          line=line) from None
    except yaml.YAMLError as exc:
        raise ConfigError(f"not valid YAML: {exc}", file=file) from None
    finally:
        loader.dispose()
    if node is None:
        raise ConfigError("the file is empty; it needs at least 'model' and 'batch_size'",
                          file=file, line=1)
    keys: dict[Path_, int] = {}
    values: dict[Path_, int] = {}
    try:
        data = _construct(node, (), SafeConstructor(), keys, values, file)
    except ConstructorError as exc:
        mark = exc.problem_mark
        raise ConfigError(f"cannot read this value: {exc.problem}", file=file,
                          line=mark.line + 1 if mark else None) from None
    return data, _Marks(file, keys, values)


# --------------------------------------------------------------------------- #
# The validated configuration
# --------------------------------------------------------------------------- #


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
    marks: _Marks = field(repr=False, compare=False)
    lr_scaling: Mapping[str, Any] | None = None  # Trainer keyword arguments, or None
    checkpoint_every: int | None = None  # steps between checkpoints (None: at the end only)
    keep_checkpoints: int = 2  # the newest checkpoints kept
    shard: str = "none"  # "fsdp": the Trainer shards the model with FSDP2 (SHARDS)

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


def load_config(path: str | os.PathLike[str]) -> Config:
    """Read and validate the YAML file at ``path``; ``ConfigError`` names file and line."""
    file = os.fspath(path)
    try:
        text = Path(file).read_text(encoding="utf-8")
    except FileNotFoundError:
        raise ConfigError("no such file; give the path of a YAML config "
                          "(examples/tiny_gpt.yaml is one)", file=file) from None
    except (OSError, UnicodeDecodeError) as exc:
        raise ConfigError(f"cannot read it: {exc}", file=file) from None
    data, marks = _load_yaml(text, file)
    return parse_config(data, marks)


def parse_config(data: Any, marks: _Marks) -> Config:
    """Validate the document ``data`` (its lines in ``marks``) into a ``Config``."""
    v = _Validator(marks)
    top = v.mapping((), data, TOP_KEYS, REQUIRED_TOP)
    model, model_kwargs = v.model(top["model"])
    data_source, data_kwargs, data_seed, num_batches = v.data(top.get("data", SYNTHETIC), model)
    batch_size = v.integer(("batch_size",), top["batch_size"], 1)
    num_csx = v.integer(("num_csx",), top.get("num_csx", 1), 1)
    if batch_size < num_csx:
        raise marks.error(("batch_size",), f"the global batch size {batch_size} is smaller than "
                          f"num_csx={num_csx}: each system needs at least one sample")
    system = v.system(top.get("system"))
    backend = v.choice(("backend",), top.get("backend", "simulated"), BACKENDS)
    shard = v.shard(top.get("shard", "none"), backend, "backend" in top, num_csx)
    if shard != "none":
        backend = "torch.distributed"
    if backend != "simulated":
        v.compile_option(("backend",), "backend", f"the {backend} backend")
    optimizer, optimizer_kwargs = v.optimizer(top.get("optimizer"))
    callbacks = v.callbacks(top.get("callbacks", []))
    v.plan(callbacks, batch_size, num_csx)
    fit = v.fit(top.get("fit", {}))
    compile_only = v.boolean(("compile_only",), top.get("compile_only", False))
    validate_only = v.boolean(("validate_only",), top.get("validate_only", False))
    if compile_only and validate_only:
        raise marks.error(("validate_only",), "compile_only and validate_only are both true; "
                          "choose one (validate_only stops earlier, after the batch analysis)")
    for key, on in (("compile_only", compile_only), ("validate_only", validate_only)):
        if on:
            v.compile_option((key,), key, f"{key}: true")
    seed = v.integer(("seed",), top.get("seed", 0), 0)
    lr_scaling = v.lr_scaling(top.get("lr_scaling"))
    in_dims = v.in_dims(top.get("in_dims", 0))
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
        keep_checkpoints=fit["keep_checkpoints"], shard=shard, marks=marks)


def _suggest(word: Any, choices: Iterable[str]) -> str:
    return suggest(str(word), list(choices))


def _type_name(value: Any) -> str:
    return "null" if value is None else {dict: "mapping", list: "list", str: "string",
                                         bool: "boolean"}.get(type(value), type(value).__name__)


def import_object(spec: str) -> Any:
    """``package.module:attr.sub`` -> the object; ``ImportError``/``AttributeError`` if missing."""
    module_name, _, attr = spec.partition(":")
    obj: Any = importlib.import_module(module_name)
    for part in attr.split("."):
        obj = getattr(obj, part)
    return obj


_IMPORT_PATH = re.compile(r"^[A-Za-z_][\w.]*:[A-Za-z_][\w.]*$")



def _signature_names(fn: Any) -> tuple[str, ...]:
    try:
        params = inspect.signature(fn).parameters.values()
    except (TypeError, ValueError):
        return ()
    return tuple(p.name for p in params if p.kind not in (p.VAR_POSITIONAL, p.VAR_KEYWORD))


def _optimizer_classes() -> dict[str, type[torch.optim.Optimizer]]:
    return {name: obj for name, obj in vars(torch.optim).items()
            if isinstance(obj, type) and issubclass(obj, torch.optim.Optimizer)
            and obj is not torch.optim.Optimizer}


def _add_import_dirs(file: str) -> None:
    # `python -m mbcompile` puts the current directory on sys.path, the console script
    # does not; make both find `package.module:Class` next to the user and the config.
    for folder in (os.getcwd(), os.path.dirname(os.path.abspath(file))):
        if folder not in sys.path:
            sys.path.insert(0, folder)


class _Validator:
    """The schema, as code: one method per section, each raising a located ``ConfigError``."""

    def __init__(self, marks: _Marks) -> None:
        self.m = marks
        self.flag_paths: dict[str, list[Path_]] = {}  # short key -> where it is set

    def fail(self, path: Path_, message: str, *, key: bool = False,
             label: Path_ | None = None) -> ConfigError:
        return ConfigError(message, file=self.m.file, line=self.m.line(path, key=key),
                           key=_dotted(path if label is None else label) or None)

    # --------------------------------------------------------------- scalars
    def mapping(self, path: Path_, value: Any, allowed: Mapping[str, str] | Sequence[str],
                required: Sequence[str] = (), what: str = "") -> dict[str, Any]:
        if not isinstance(value, dict):
            where = "the file" if not path else "this section"
            raise self.fail(path, f"{where} must be a mapping{what}, got {_type_name(value)} "
                            f"{value!r}")
        for k in value:
            if k not in allowed:
                raise self.fail(path + (k,), f"unknown key {k!r}{_suggest(k, allowed)}; the "
                                f"allowed keys are {', '.join(allowed)}", key=True, label=path)
        for k in required:
            if k not in value:
                hint = f" ({allowed[k]})" if isinstance(allowed, Mapping) else ""
                raise self.fail(path, f"missing required key {k!r}{hint}", key=True)
        return value

    def integer(self, path: Path_, value: Any, minimum: int | None = None) -> int:
        if isinstance(value, bool) or not isinstance(value, int):
            raise self.fail(path, f"must be an int, got {_type_name(value)} {value!r}")
        if minimum is not None and value < minimum:
            raise self.fail(path, f"must be at least {minimum}, got {value}")
        return value

    def optional_integer(self, path: Path_, value: Any, minimum: int) -> int | None:
        return None if value is None else self.integer(path, value, minimum)

    def boolean(self, path: Path_, value: Any) -> bool:
        if not isinstance(value, bool):
            raise self.fail(path, f"must be true or false, got {_type_name(value)} {value!r}")
        return value

    def string(self, path: Path_, value: Any) -> str:
        if not isinstance(value, str) or not value:
            raise self.fail(path, f"must be a non-empty string, got {_type_name(value)} "
                            f"{value!r}")
        return value

    def choice(self, path: Path_, value: Any, choices: Sequence[str]) -> str:
        value = self.string(path, value)
        if value not in choices:
            raise self.fail(path, f"unknown value {value!r}{_suggest(value, choices)}; choose "
                            f"one of {', '.join(choices)}")
        return value

    def kwargs(self, path: Path_, value: Any) -> dict[str, Any]:
        if value is None:
            return {}
        if not isinstance(value, dict):
            raise self.fail(path, f"must be a mapping of keyword arguments, got "
                            f"{_type_name(value)} {value!r}")
        for k in value:
            if not isinstance(k, str) or not k.isidentifier():
                raise self.fail(path + (k,), f"{k!r} is not a valid argument name", key=True)
        return dict(value)

    def importable(self, path: Path_, spec: str, what: str) -> Any:
        if not _IMPORT_PATH.match(spec):
            raise self.fail(path, f"{spec!r} is not an import path; write it as "
                            f"package.module:{what}")
        _add_import_dirs(self.m.file)
        try:
            return import_object(spec)
        except ImportError as exc:
            raise self.fail(path, f"cannot import {spec!r}: {type(exc).__name__}: {exc}; the "
                            "current directory and the config's directory are on the import "
                            "path, check the module name") from None
        except AttributeError:
            module, _, attr = spec.partition(":")
            raise self.fail(path, f"module {module!r} has no {attr!r}") from None

    def signature_kwargs(self, path: Path_, fn: Any, kwargs: Mapping[str, Any],
                         provided: Sequence[str] = ()) -> None:
        """Check ``kwargs`` against ``fn``'s parameters: unknown names and missing ones."""
        name = getattr(fn, "__qualname__", repr(fn))
        try:
            params = inspect.signature(fn).parameters
        except (TypeError, ValueError):
            return
        names = [p.name for p in params.values()
                 if p.kind in (p.POSITIONAL_OR_KEYWORD, p.KEYWORD_ONLY)]
        takes_any = any(p.kind is p.VAR_KEYWORD for p in params.values())
        for k in kwargs:
            if k in provided:
                raise self.fail(path + (k,), f"{k!r} is set by mbcompile itself; remove it",
                                key=True)
            if k not in names and not takes_any:
                listed = ", ".join(n for n in names if n not in provided) or "none"
                raise self.fail(path + (k,), f"{name} has no argument {k!r}"
                                f"{_suggest(k, names)}; its arguments are: {listed}", key=True)
        missing = [p.name for p in params.values()
                   if p.kind in (p.POSITIONAL_OR_KEYWORD, p.KEYWORD_ONLY)
                   and p.default is p.empty and p.name not in kwargs and p.name not in provided]
        if missing:
            raise self.fail(path, f"{name} needs the argument(s) {', '.join(missing)}; add them "
                            f"under {_dotted(path)}")

    def compile_option(self, path: Path_, option: str, what: str) -> None:
        from mbcompile import compiler

        if option not in inspect.signature(compiler.compile).parameters:
            raise self.fail(path, f"{what} needs mbcompile.compile({option}=...), which this "
                            "version of mbcompile does not have yet; remove the key")

    # -------------------------------------------------------------- sections
    def model(self, value: Any) -> tuple[str, dict[str, Any]]:
        path: Path_ = ("model",)
        if isinstance(value, str):
            name, kwargs, name_path = value, {}, path
        else:
            section = self.mapping(path, value, MODEL_KEYS, ("name",),
                                   " ({name: tiny_gpt, kwargs: {...}}) or a model name")
            name_path = path + ("name",)
            name = self.string(name_path, section["name"])
            kwargs = self.kwargs(path + ("kwargs",), section.get("kwargs"))
        if name in BUILTIN_MODELS:
            target: Any = BUILTIN_MODELS[name]
        elif ":" in name:
            target = self.importable(name_path, name, "Class")
            if not callable(target):
                raise self.fail(name_path, f"{name!r} is not a class or function")
        else:
            raise self.fail(name_path, f"unknown model {name!r}"
                            f"{_suggest(name, BUILTIN_MODELS)}; use a built-in example "
                            f"({', '.join(BUILTIN_MODELS)}) or an import path "
                            "package.module:Class")
        self.signature_kwargs(path + ("kwargs",), target, kwargs)
        return name, kwargs

    def data(self, value: Any, model: str) -> tuple[str, dict[str, Any], int | None, int]:
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
            return source, kwargs, seed, num_batches
        if ":" not in source:
            raise self.fail(source_path, f"unknown data source {source!r}"
                            f"{_suggest(source, [SYNTHETIC])}; use 'synthetic' or an import "
                            "path package.module:factory")
        factory = self.importable(source_path, source, "factory")
        if not callable(factory):
            raise self.fail(source_path, f"{source!r} is not callable")
        accepted = _signature_names(factory)
        self.signature_kwargs(path + ("kwargs",), factory, kwargs,
                              provided=[p for p in ("split", "batch_size") if p in accepted])
        return source, kwargs, seed, num_batches

    def system(self, value: Any) -> Any:
        """A preset name or a mapping of ``SystemSpec`` fields (built into one here)."""
        path: Path_ = ("system",)
        try:  # the cost-model issue's module; without it the value goes to compile() as is
            from mbcompile import systems
        except ImportError:
            systems = None  # type: ignore[assignment]
        if value is None:
            return None
        if isinstance(value, str):
            names = tuple(systems.system_names()) if hasattr(systems, "system_names") else ()
            if names and value not in names:
                raise self.fail(path, f"unknown system {value!r}{_suggest(value, names)}; "
                                f"the presets are {', '.join(names)}, or give a mapping of "
                                "SystemSpec fields")
            return self.string(path, value)
        if not isinstance(value, dict):
            raise self.fail(path, f"must be a preset name or a mapping of SystemSpec fields, "
                            f"got {_type_name(value)} {value!r}")
        spec = getattr(systems, "SystemSpec", None)
        fields = getattr(spec, "__dataclass_fields__", None)
        if spec is None or not fields:
            return dict(value)
        self.mapping(path, value, list(fields))
        kwargs = dict(value)
        kwargs.setdefault("name", f"{Path(self.m.file).stem}-system")
        for k, v in kwargs.items():
            if k not in ("name", "source") and v is not None and (
                    isinstance(v, bool) or not isinstance(v, (int, float))):
                raise self.fail(path + (k,), f"must be a number, got {_type_name(v)} {v!r}")
        try:
            return spec(**kwargs)
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
                            f"{_type_name(value)} {value!r}")
        if "name" not in value:
            raise self.fail(path, "missing required key 'name' (a torch.optim class such as "
                            "AdamW or SGD, or package.module:Class)", key=True)
        name = self.string(path + ("name",), value["name"])
        classes = _optimizer_classes()
        if name in classes:
            target: Any = classes[name]
        elif ":" in name:
            target = self.importable(path + ("name",), name, "Class")
        else:
            raise self.fail(path + ("name",), f"unknown optimizer {name!r}"
                            f"{_suggest(name, classes)}; use a torch.optim class "
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
                            f"{_type_name(value)} {value!r}")
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
                                f"{_suggest(name, CALLBACKS)}; choose one of "
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
                            f"{_type_name(value)} {value!r}")
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
                            f"{_type_name(value)} {value!r}")
        shard = self.choice(path, value, SHARDS)
        if shard == "none":
            return shard
        if backend_given and backend != "torch.distributed":
            raise self.fail(path, f"shard: {shard} splits the model over torch.distributed "
                            f"ranks, but backend is {backend!r} (line "
                            f"{self.m.line(('backend',))}): set backend: torch.distributed or "
                            "remove the backend key, and run with --nproc N or torchrun")
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
# Building the run's objects
# --------------------------------------------------------------------------- #


def _model_target(cfg: Config) -> Any:
    return BUILTIN_MODELS.get(cfg.model) or import_object(cfg.model)


def _model_path(cfg: Config) -> Path_:
    return ("model", "name") if ("model", "name") in cfg.marks.keys else ("model",)


def build_model(cfg: Config) -> nn.Module:
    """The model, with weights drawn from ``cfg.seed``."""
    torch.manual_seed(cfg.seed)
    try:
        model = _model_target(cfg)(**cfg.model_kwargs)
    except Exception as exc:
        raise cfg.error(_model_path(cfg), f"building the model {cfg.model!r} failed: "
                        f"{type(exc).__name__}: {exc}") from exc
    if not isinstance(model, nn.Module):
        raise cfg.error(_model_path(cfg), f"{cfg.model!r} returned a {type(model).__name__}, "
                        "not a torch.nn.Module")
    return model


def _with_defaults(cls: Any, kwargs: Mapping[str, Any]) -> dict[str, Any]:
    bound = inspect.signature(cls).bind_partial(**kwargs)
    bound.apply_defaults()
    return dict(bound.arguments)


def _tiny_gpt_batch(a: Mapping[str, Any], n: int, g: torch.Generator, seed: int) -> Any:
    return models.token_batch(n, a["seq"], a["vocab"], seed=seed)


def _mlp_batch(a: Mapping[str, Any], n: int, g: torch.Generator, seed: int) -> Any:
    return torch.randn(n, a["features"], generator=g), torch.randn(n, a["out"], generator=g)


def _cnn_batch(a: Mapping[str, Any], n: int, g: torch.Generator, seed: int) -> Any:
    return (torch.randn(n, a["channels"], 8, 8, generator=g),
            torch.randint(0, a["classes"], (n,), generator=g))


#: Synthetic batches for the built-in models: (model kwargs with defaults, n, generator, seed).
SYNTHETIC_BATCHES: dict[str, Callable[..., Any]] = {
    "tiny_gpt": _tiny_gpt_batch,  # padded tokens with -100 labels (models.token_batch)
    "mlp": _mlp_batch,  # x ~ N(0, 1), regression targets ~ N(0, 1)
    "cnn": _cnn_batch,  # 8x8 images ~ N(0, 1), class labels
}

_SPLIT_SEED = {"train": 0, "validate": 10_000}


def synthetic_batches(cfg: Config, split: str, count: int | None = None) -> list[Any]:
    """``count`` (default ``cfg.num_batches``) distinct batches of ``cfg.batch_size`` samples."""
    args = _with_defaults(BUILTIN_MODELS[cfg.model], cfg.model_kwargs)
    make = SYNTHETIC_BATCHES[cfg.model]
    out = []
    for i in range(count or cfg.num_batches):
        seed = cfg.data_seed + _SPLIT_SEED[split] + i
        out.append(make(args, cfg.batch_size, torch.Generator().manual_seed(seed), seed))
    return out


def build_data(cfg: Config, split: str = "train") -> Iterable[Any]:
    """Batches for ``split`` ("train" or "validate") of ``cfg.batch_size`` samples each.

    A factory is called as ``factory(**kwargs, split=..., batch_size=...)`` (the last
    two only where its signature takes them) and returns a dataloader (any iterable
    of batches) or a map-style/iterable ``Dataset``, which is batched here with
    ``drop_last=True`` so every batch has exactly ``batch_size`` samples.
    """
    if cfg.data == SYNTHETIC:
        return synthetic_batches(cfg, split)
    path = ("data", "source") if ("data", "source") in cfg.marks.keys else ("data",)
    factory = import_object(cfg.data)
    accepted = _signature_names(factory)
    kwargs = dict(cfg.data_kwargs)
    if "split" in accepted:
        kwargs["split"] = split
    if "batch_size" in accepted:
        kwargs["batch_size"] = cfg.batch_size
    try:
        data = factory(**kwargs)
    except Exception as exc:
        raise cfg.error(path, f"the data factory {cfg.data!r} failed for split {split!r}: "
                        f"{type(exc).__name__}: {exc}") from exc
    if isinstance(data, torch.utils.data.Dataset) and not isinstance(data, Sequence):
        g = torch.Generator().manual_seed(cfg.data_seed)
        shuffle = split == "train" and not isinstance(data, torch.utils.data.IterableDataset)
        return torch.utils.data.DataLoader(data, batch_size=cfg.batch_size, shuffle=shuffle,
                                           drop_last=True, generator=g)
    if not isinstance(data, Iterable):
        raise cfg.error(path, f"the data factory {cfg.data!r} returned a "
                        f"{type(data).__name__}; return a dataloader (an iterable of batches) "
                        "or a torch Dataset")
    return data


def build_optimizer(cfg: Config, model: nn.Module) -> torch.optim.Optimizer:
    cls = _optimizer_classes().get(cfg.optimizer) or import_object(cfg.optimizer)
    try:
        return cls(model.parameters(), **cfg.optimizer_kwargs)
    except Exception as exc:
        raise cfg.error(("optimizer",), f"building the optimizer {cfg.optimizer} failed: "
                        f"{type(exc).__name__}: {exc}") from exc


def build_callbacks(cfg: Config, mbs: Any = None) -> list[Callback]:
    """The config's flag callbacks; ``mbs`` (from ``--mbs``) overrides every MBS flag."""
    out: list[Callback] = []
    for name, flags in cfg.callbacks:
        if mbs is not None:
            flags = {k: v for k, v in flags.items() if k != "micro_batch_size"}
        out.append(CALLBACKS[name](flags))
    if mbs is not None:
        out.insert(0, GlobalFlags(micro_batch_size=mbs))
    return out


def build_trainer(cfg: Config, *, mbs: Any = None, log_dir: str | None = None,
                  progress: bool = True, console: Any = None, model: nn.Module | None = None,
                  compile_options: Mapping[str, Any] | None = None,
                  checkpoint_dir: str | os.PathLike[str] | None = None) -> Any:
    """A ``Trainer`` for ``cfg`` (model, optimizer, callbacks, logging to ``output_dir``).

    Checkpoints go to ``checkpoint_dir`` (default ``<log_dir>/checkpoints``) every
    ``fit.checkpoint_every`` steps and at the end; each holds ``cfg``.
    """
    from mbcompile.training.trainer import Trainer

    model = build_model(cfg) if model is None else model
    if cfg.shard != "none":  # before the optimizer, which must hold the shards
        from mbcompile.training.trainer import shard_model

        shard_model(model, cfg.shard)
    log_dir = log_dir or cfg.output_dir
    return Trainer(model, build_optimizer(cfg, model), gbs=cfg.batch_size, num_csx=cfg.num_csx,
                   callbacks=build_callbacks(cfg, mbs), system=cfg.system,
                   backend=None if cfg.backend == "simulated" else cfg.backend,
                   in_dims=cfg.in_dims, log_dir=log_dir,
                   log_every=cfg.log_every, progress=progress, console=console,
                   compile_options=compile_options,
                   checkpoint_dir=checkpoint_dir or os.path.join(log_dir, "checkpoints"),
                   checkpoint_every=cfg.checkpoint_every,
                   keep_checkpoints=cfg.keep_checkpoints, config=cfg.to_plain(),
                   shard=None if cfg.shard == "none" else cfg.shard,
                   **(cfg.lr_scaling or {}))
