"""``mbcompile.distributed``: the collectives and rank helpers of a step on torch.distributed
ranks (``shard``, ``PlanSampler``, ``launch``, ``OVERLAP``).

The public spelling of ``mbcompile.execution.distributed``: ``import mbcompile.distributed`` and
``from mbcompile.distributed import ...`` work as ``mbcompile.distributed.<name>`` does. Importing
it gives that module itself, not a copy, so a setting made here reaches the plan and
the run.
"""

import sys

from mbcompile.execution import distributed

sys.modules[__name__] = distributed  # this name is that module (the import system reads it back)
