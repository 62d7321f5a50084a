"""YAML run configurations: load, validate (with file and line), build the run's objects.

One file describes a run; everything is checked before anything runs, and every
error names the file and the line::

    model:
      name: tiny_gpt                # built-in: tiny_gpt, mlp, cnn; or package.module:Class
      kwargs: {width: 32, depth: 2}   # or class: transformers:Llama..., config: {...}
    data: synthetic                 # or {source: package.module:factory, kwargs: {...}}
    batch_size: 16                  # the global batch size (GBS)
    num_csx: 4
    optimizer: {name: AdamW, lr: 1.0e-3}
    callbacks:
      - GlobalFlags: {csx.performance.micro_batch_size: auto}
      - ScopedTrainFlags: {micro_batch_size: 2}
    fit: {max_steps: 10, val_steps: 2, checkpoint_every: 5}
    shard: fsdp                     # or none (default): FSDP2 per block and at the root
    outputs: loss                   # (default) what a step returns, in compile and fit alike

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

Each step has its module: ``loader`` (YAML with lines), ``checks`` and ``schema`` (the
checks and the sections), ``parse`` (the ``Config`` they make), ``builders`` (the objects);
this one reads a file through them, and is where their public names are imported from.

``1e-3`` is a float here (YAML 1.2), not the string YAML 1.1 makes of it.
"""

from __future__ import annotations

import os
from pathlib import Path

from mbcompile.training.config.builders import (
    build_callbacks,
    build_data,
    build_model,
    build_optimizer,
    build_trainer,
    compile_options,
    synthetic_batches,
)
from mbcompile.training.config.checks import import_object
from mbcompile.training.config.loader import ConfigError, load_yaml
from mbcompile.training.config.parse import Config, parse_config
from mbcompile.training.config.schema import BACKENDS, BUILTIN_MODELS, CALLBACKS, SHARDS

__all__ = [
    "BACKENDS",
    "BUILTIN_MODELS",
    "CALLBACKS",
    "SHARDS",
    "Config",
    "ConfigError",
    "build_callbacks",
    "build_data",
    "build_model",
    "build_optimizer",
    "build_trainer",
    "compile_options",
    "import_object",
    "load_config",
    "parse_config",
    "synthetic_batches",
]


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
    data, marks = load_yaml(text, file)
    return parse_config(data, marks)
