"""mbcompile: automatic microbatching for PyTorch, as a compiler pass.

``mbcompile.compile(model, gbs, num_csx, mbs="auto", example_inputs=...)`` captures
the model as an fx graph, proves splitting the batch cannot change the result,
rewrites it into split -> microbatch loop -> accumulate, and runs it.
"""

from mbcompile.compiler import CompiledModule, compile
from mbcompile.errors import (
    ArgumentTypeError,
    CaptureError,
    InputError,
    MbcompileError,
    MbcompileWarning,
    MbsAdjustedWarning,
    MicrobatchError,
    MixingError,
    PlanError,
    RetainedActivationsWarning,
    UnsupportedOpError,
)
from mbcompile.passes.batch_rules import register_batch_rule, trust_module
from mbcompile.plan import MicrobatchPlan, make_plan

__version__ = "0.1.0"

__all__ = [
    "ArgumentTypeError",
    "CaptureError",
    "CompiledModule",
    "InputError",
    "MbcompileError",
    "MbcompileWarning",
    "MbsAdjustedWarning",
    "MicrobatchError",
    "MicrobatchPlan",
    "MixingError",
    "PlanError",
    "RetainedActivationsWarning",
    "UnsupportedOpError",
    "compile",
    "make_plan",
    "register_batch_rule",
    "trust_module",
]
