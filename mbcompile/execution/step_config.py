"""What compile time tells one compiled graph's training step, in one typed object.

>>> config = StepConfig(reshard_after_forward=False, joint=joint_step(body, {}))
>>> channels = StepChannels(noise=None, config=config)   # bound into the loop ops

The runtime reads run-time options from here, never from attributes set on the
body (docs/architecture.md: "what the runtime needs from compile time travels in the loop op's
arguments or one typed step configuration"). The compiler builds one per rewritten
graph, and the backend binds it into that graph's loop and two-phase step through
``StepChannels``, the object it already binds.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

__all__ = ["StepConfig"]


@dataclass(frozen=True)
class StepConfig:
    """Per compiled graph: FSDP2's ``reshard_after_forward`` for the step (None: the units
    keep the setting they were sharded with) and ``gradient_sync``, a two-phase step's
    frontier template (each microbatch's body outputs as ``(shape, dtype, device)``, for
    a rank whose phase 1 fails to join the gather with zeros; None in one process), and
    the body's ``joint.JointStep`` (None: not compiled with ``torch_compile``)."""

    reshard_after_forward: bool | None = None
    frontier_template: Sequence[tuple[Any, ...]] | None = None
    joint: Any = None
    #: FSDP2's gradient reduce-scatter for the step: "step" (the last backward only),
    #: "microbatch" (every backward), None (the step's last, as "step").
    gradient_sync: str | None = None
    #: How each backward is seeded as eager's (``seeding.Seed``; None: with 1, scaled after).
    seed: Any = None
    #: A non-finite loss: "return" it (and its gradients) as eager does, or "raise"
    #: ``MicrobatchError`` with the step rolled back.
    nonfinite: str = "return"
    #: Other ranks may be called at other lengths (a symbolic dim, or ``dynamic="auto"``,
    #: where any rank's call at another length makes one): a two-phase step's frontier may
    #: have other shapes there, which the ranks exchange before gathering it
    #: (``frontier_gather``). The same on every rank, whichever variant each one runs.
    lengths_vary: bool = False
    #: A microbatch can run again after the call (the graph writes no state back, which
    #: a second forward would read): a first float16 step may wait for its seed
    #: (``deferred.py``).
    replayable: bool = True
