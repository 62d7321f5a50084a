"""Building a run's objects from a ``Config``: model, data, optimizer, callbacks, Trainer,
and the options of a compile; their failures name the config's line as well."""

from __future__ import annotations

import contextlib
import inspect
import os
from collections.abc import Callable, Iterable, Mapping, Sequence
from typing import Any

import torch
import torch.nn as nn

import mbcompile.models as models
from mbcompile.training.config.checks import import_object, optimizer_classes, signature_names
from mbcompile.training.config.loader import Path_
from mbcompile.training.config.parse import Config
from mbcompile.training.config.schema import BUILTIN_MODELS, CALLBACKS, SYNTHETIC
from mbcompile.training.flags import Callback, GlobalFlags
from mbcompile.training.sharding import shard_model

__all__ = ["SYNTHETIC_BATCHES", "build_callbacks", "build_data", "build_model",
           "build_optimizer", "build_trainer", "compile_options", "synthetic_batches"]


def _model_target(cfg: Config) -> Any:
    return BUILTIN_MODELS.get(cfg.model) or import_object(cfg.model)


def _model_path(cfg: Config) -> Path_:
    for key in ("name", "class"):
        if ("model", key) in cfg.marks.keys:
            return ("model", key)
    return ("model",)


def build_model(cfg: Config) -> nn.Module:
    """The model, with weights drawn from ``cfg.seed``; a transformers model from its
    config, ``Class(Class.config_class(**cfg.model_config), **cfg.model_kwargs)``. With
    ``model.init: meta`` it is built on the meta device: shapes and tied weights, no
    values and no memory, for plans only."""
    torch.manual_seed(cfg.seed)
    target = _model_target(cfg)
    device = torch.device("meta") if cfg.model_init == "meta" else contextlib.nullcontext()
    try:
        config = () if cfg.model_config is None else (target.config_class(**cfg.model_config),)
        with device:
            model = target(*config, **cfg.model_kwargs)
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
    of batches) or a map-style/iterable ``Dataset``, which is batched here: every row once
    an epoch, the last batch short where the rows do not divide (the Trainer trains it
    exactly); ``data.drop_last: true`` leaves it out, so every batch has ``batch_size``.
    """
    if cfg.data == SYNTHETIC:
        return synthetic_batches(cfg, split)
    path = ("data", "source") if ("data", "source") in cfg.marks.keys else ("data",)
    factory = import_object(cfg.data)
    accepted = signature_names(factory)
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
                                           drop_last=cfg.drop_last, generator=g)
    if not isinstance(data, Iterable):
        raise cfg.error(path, f"the data factory {cfg.data!r} returned a "
                        f"{type(data).__name__}; return a dataloader (an iterable of batches) "
                        "or a torch Dataset")
    return data


def build_optimizer(cfg: Config, model: nn.Module) -> torch.optim.Optimizer:
    cls = optimizer_classes().get(cfg.optimizer) or import_object(cfg.optimizer)
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


def compile_options(cfg: Config, *, compile_only: bool = False,
                    validate_only: bool = False) -> dict[str, Any]:
    """The keyword options of ``mbcompile.compile`` that ``cfg`` sets: its
    ``compile_options``, ``in_dims``, ``outputs``, ``system``, ``backend``, ``compile_only``
    and ``validate_only`` (``mbcompile compile``). ``compile_options`` and ``outputs`` are
    what ``build_trainer`` hands the Trainer, so that ``compile`` plans the step ``fit``
    runs."""
    options: dict[str, Any] = {**cfg.compile_options, "in_dims": cfg.in_dims,
                               "outputs": cfg.outputs}
    if cfg.system is not None:
        options["system"] = cfg.system
    if cfg.backend != "auto":
        options["backend"] = cfg.backend
    if compile_only:
        options["compile_only"] = True
    if validate_only:
        options["validate_only"] = True
    return options


def build_trainer(cfg: Config, *, mbs: Any = None, log_dir: str | None = None,
                  progress: bool = True, console: Any = None, model: nn.Module | None = None,
                  compile_options: Mapping[str, Any] | None = None,
                  checkpoint_dir: str | os.PathLike[str] | None = None,
                  write_metrics: bool = True) -> Any:
    """A ``Trainer`` for ``cfg`` (model, optimizer, callbacks, logging to ``output_dir``).

    Checkpoints go to ``checkpoint_dir`` (default ``<log_dir>/checkpoints``) every
    ``fit.checkpoint_every`` steps and at the end; each holds ``cfg``. With
    ``write_metrics=False`` (ranks other than 0) no ``metrics.csv`` is written.
    """
    from mbcompile.training.trainer import Trainer

    if cfg.model_init == "meta" and model is None:
        raise cfg.error(("model", "init"), "init: meta builds the model without values, which "
                        "plans it but cannot train it: plan it with mbcompile compile "
                        "--compile-only, and remove model.init (or set it to random) to train")
    model = build_model(cfg) if model is None else model
    if cfg.shard != "none":  # before the optimizer, which must hold the shards
        shard_model(model, cfg.shard)
    log_dir = log_dir or cfg.output_dir
    return Trainer(model, build_optimizer(cfg, model), gbs=cfg.batch_size, num_csx=cfg.num_csx,
                   callbacks=build_callbacks(cfg, mbs), system=cfg.system,
                   backend=cfg.backend,
                   in_dims=cfg.in_dims, log_dir=log_dir if write_metrics else None,
                   log_every=cfg.log_every, progress=progress, console=console,
                   compile_options={**cfg.compile_options, "outputs": cfg.outputs,
                                    **(compile_options or {})},
                   checkpoint_dir=checkpoint_dir or os.path.join(log_dir, "checkpoints"),
                   checkpoint_every=cfg.checkpoint_every,
                   keep_checkpoints=cfg.keep_checkpoints, config=cfg.to_plain(),
                   shard=None if cfg.shard == "none" else cfg.shard,
                   **(cfg.lr_scaling or {}))
