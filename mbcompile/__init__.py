"""mbcompile: automatic microbatching for PyTorch, as a compiler pass.

``mbcompile.compile(model, gbs, num_csx, mbs="auto", example_inputs=...)`` captures
the model as an fx graph, proves splitting the batch cannot change the result,
rewrites it into split -> microbatch loop -> accumulate, and runs it.

The package is laid out by part: ``passes/`` (the compiler passes, installed as
``mbcompile.passes``), ``planning/`` (plan arithmetic, systems, cost model, MBS
choice), ``execution/`` (the loop, the simulated and torch.distributed backends),
``training/`` (flags, YAML config, Trainer, LR scaling, monitors, CLI) and
``reports/`` (reports, drawings). Names load on first use (PEP 562), so that
importing one pass does not import the compiler, the trainer or a backend.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

#: public name -> the module that defines it
_NAMES = {
    "CompiledModule": "mbcompile.compiled_module",
    "compile": "mbcompile.compiler",
    "ConfigError": "mbcompile.training.config",
    "load_config": "mbcompile.training.config",
    "draw": "mbcompile.reports.draw",
    "Callback": "mbcompile.training.flags",
    "GlobalFlags": "mbcompile.training.flags",
    "ScopedTrainFlags": "mbcompile.training.flags",
    "ScopedValidateFlags": "mbcompile.training.flags",
    "NoiseScaleMonitor": "mbcompile.training.monitors",
    "NoiseScale": "mbcompile.execution.noise",
    "register_batch_rule": "mbcompile.passes.rules",
    "trust_module": "mbcompile.passes.rules",
    "per_microbatch": "mbcompile.passes.hook_sandbox",
    "MicrobatchPlan": "mbcompile.planning.plan",
    "make_plan": "mbcompile.planning.plan",
    "Validation": "mbcompile.reports.report",
    "SystemSpec": "mbcompile.planning.systems",
    "get_system": "mbcompile.planning.systems",
    "Trainer": "mbcompile.training.trainer",
    "CheckpointError": "mbcompile.training.checkpoint",
    "TrainingInterrupted": "mbcompile.training.checkpoint",
    "read_checkpoint": "mbcompile.training.checkpoint",
    **{name: "mbcompile.passes.errors" for name in (
        "ArgumentTypeError", "BatchSizeWarning", "CaptureError", "InputError",
        "JointStepWarning", "MbcompileError",
        "MbcompileWarning", "MbsAdjustedWarning", "MicrobatchError",
        "PerMicrobatchStatisticsWarning", "MicrobatchOutOfMemoryError", "MixingError",
        "PlanError", "RecompileWarning", "RetainedActivationsWarning",
        "UnsupportedOpError")},
    **{name: "mbcompile.errors" for name in (
        "CompileOnlyError", "CostModelError", "CostModelWarning", "DoesNotFitError",
        "TwoPhaseWarning")},
}
#: modules users reach as ``mbcompile.<name>`` (``mbcompile.distributed.shard``, ...); those
#: that live deeper have a file of that name too (``mbcompile/distributed.py``), so that
#: ``import mbcompile.distributed`` and ``from mbcompile.distributed import shard`` work
_MODULES = {
    "check": "mbcompile.check",
    "errors": "mbcompile.errors",
    "models": "mbcompile.models",
    "buckets": "mbcompile.planning.buckets",
    "distributed": "mbcompile.execution.distributed",
    "systems": "mbcompile.planning.systems",
}

__all__ = sorted(_NAMES)


def __getattr__(name: str) -> Any:
    if name == "__version__":  # in its own module, so the package's modules read it there
        value = importlib.import_module("mbcompile.version").__version__
    elif name in _NAMES:
        value = getattr(importlib.import_module(_NAMES[name]), name)
    elif name in _MODULES:
        value = importlib.import_module(_MODULES[name])
    else:
        raise AttributeError(f"module 'mbcompile' has no attribute {name!r}")
    globals()[name] = value  # load once
    return value


def __dir__() -> list[str]:
    return sorted({*globals(), *_NAMES, *_MODULES, "__version__"})


if TYPE_CHECKING:  # what type checkers and IDEs see; nothing is imported at run time
    from mbcompile.compiled_module import CompiledModule  # noqa: F401
    from mbcompile.compiler import compile  # noqa: F401
    from mbcompile.errors import (  # noqa: F401
        CompileOnlyError,
        CostModelError,
        CostModelWarning,
        DoesNotFitError,
        TwoPhaseWarning,
    )
    from mbcompile.execution.noise import NoiseScale  # noqa: F401
    from mbcompile.passes.errors import *  # noqa: F401,F403
    from mbcompile.passes.hook_sandbox import per_microbatch  # noqa: F401
    from mbcompile.passes.rules import register_batch_rule, trust_module  # noqa: F401
    from mbcompile.planning.plan import MicrobatchPlan, make_plan  # noqa: F401
    from mbcompile.planning.systems import SystemSpec, get_system  # noqa: F401
    from mbcompile.reports.draw import draw  # noqa: F401
    from mbcompile.reports.report import Validation  # noqa: F401
    from mbcompile.training.config import ConfigError, load_config  # noqa: F401
    from mbcompile.training.flags import (  # noqa: F401
        Callback,
        GlobalFlags,
        ScopedTrainFlags,
        ScopedValidateFlags,
    )
    from mbcompile.training.monitors import NoiseScaleMonitor  # noqa: F401
    from mbcompile.training.trainer import Trainer  # noqa: F401
