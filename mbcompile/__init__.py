"""mbcompile: automatic microbatching for PyTorch, as a compiler pass.

``mbcompile.compile(model, gbs, num_csx, mbs="auto", example_inputs=...)`` captures
the model as an fx graph, proves splitting the batch cannot change the result,
rewrites it into split -> microbatch loop -> accumulate, and runs it.
"""

from mbcompile.compiler import CompiledModule, compile
from mbcompile.config import ConfigError, load_config
from mbcompile.cost import CostModelError, DoesNotFitError
from mbcompile.draw import draw
from mbcompile.errors import (
    ArgumentTypeError,
    CaptureError,
    InputError,
    MbcompileError,
    MbcompileWarning,
    MbsAdjustedWarning,
    MicrobatchError,
    MicrobatchOutOfMemoryError,
    MixingError,
    PlanError,
    RetainedActivationsWarning,
    UnsupportedOpError,
)
from mbcompile.explore import CompileOnlyError, CostModelWarning
from mbcompile.flags import GlobalFlags, ScopedTrainFlags, ScopedValidateFlags
from mbcompile.monitors import NoiseScaleMonitor
from mbcompile.noise import NoiseScale
from mbcompile.passes.batch_rules import register_batch_rule, trust_module
from mbcompile.plan import MicrobatchPlan, make_plan
from mbcompile.report import Validation
from mbcompile.systems import SystemSpec, get_system
from mbcompile.trainer import Trainer

__version__ = "0.1.0"

__all__ = [
    "ArgumentTypeError",
    "CaptureError",
    "CompileOnlyError",
    "CompiledModule",
    "CostModelError",
    "CostModelWarning",
    "DoesNotFitError",
    "ConfigError",
    "GlobalFlags",
    "InputError",
    "MbcompileError",
    "MbcompileWarning",
    "MbsAdjustedWarning",
    "MicrobatchError",
    "MicrobatchOutOfMemoryError",
    "MicrobatchPlan",
    "MixingError",
    "NoiseScale",
    "NoiseScaleMonitor",
    "PlanError",
    "RetainedActivationsWarning",
    "SystemSpec",
    "ScopedTrainFlags",
    "ScopedValidateFlags",
    "Trainer",
    "UnsupportedOpError",
    "Validation",
    "compile",
    "get_system",
    "draw",
    "load_config",
    "make_plan",
    "register_batch_rule",
    "trust_module",
]
