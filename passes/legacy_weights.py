"""The plain ``weight`` of legacy ``spectral_norm``, ``weight_norm`` and ``prune``, set per step.

The legacy forms (``torch.nn.utils.spectral_norm``, ``torch.nn.utils.weight_norm``) and
``torch.nn.utils.prune`` keep the layer's weight as a plain attribute that a forward
pre-hook recomputes at every call (``module.weight = weight_orig / sigma``,
``module.weight = weight_orig * weight_mask``). Both captures trace that hook: the step uses
the weight the graph computes, and the plain attribute is left alone, so after a compiled
step ``module.weight`` would still hold the last eager call's value (``torch.export``
restores the module's attributes after tracing; ``torch.fx`` records the write as a side
effect, replayed with the traced value). ``weights_set_after`` adds an effect that sets
it once per step, after the state write-back, as the hook would: from the step's
``weight_orig`` and the power iteration's updated ``u`` and ``v`` buffers (the same
numbers eager's hook computes, with no further power iteration), detached like the state
the step writes back (eager's carries a graph to ``weight_orig``, which keeps
``copy.deepcopy`` of the model from working).

Before (legacy spectral norm on ``lin``, one compiled training step)::

    lin.weight  # the value of the last eager call (or of spectral_norm() itself)

After (``replay`` of ``SetLegacyWeight``)::

    lin.weight  # == eager's: lin.weight_orig / sigma(u, v) of this step
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import Any

import torch
import torch.fx as fx
from torch.nn.utils.prune import BasePruningMethod
from torch.nn.utils.spectral_norm import SpectralNorm
from torch.nn.utils.weight_norm import WeightNorm

from .side_effects import Effects, SetAttr

__all__ = ["WEIGHT_HOOKS", "SetLegacyWeight", "legacy_weights", "weights_set_after"]

#: the forward pre-hooks that recompute a layer's weight into a plain attribute
WEIGHT_HOOKS = (SpectralNorm, WeightNorm, BasePruningMethod)


@dataclass(frozen=True)
class SetLegacyWeight:
    """``module.<name> = hook.compute_weight(module)``, once after each step."""

    module: torch.nn.Module
    hook: SpectralNorm | WeightNorm | BasePruningMethod
    where: str

    def apply(self, flat: Sequence[Any]) -> None:
        with torch.no_grad():  # a leaf, as state is written back: the model stays copyable
            if isinstance(self.hook, SpectralNorm):  # u, v hold the step's iteration already
                weight = self.hook.compute_weight(self.module, do_power_iteration=False)
            elif isinstance(self.hook, BasePruningMethod):
                weight = self.hook.apply_mask(self.module)
            else:
                weight = self.hook.compute_weight(self.module)
        setattr(self.module, _name(self.hook), weight)

    def __repr__(self) -> str:  # compared between two captures (dynamic_shapes.py)
        return f"SetLegacyWeight({self.where})"


def _read_attributes(gm: fx.GraphModule) -> set[str]:
    """The qualified attribute names the graph (and every graph it calls) reads."""
    names: set[str] = set()
    for prefix, module in gm.named_modules():
        if isinstance(module, fx.GraphModule):
            names.update(".".join(filter(None, (prefix, str(n.target))))
                         for n in module.graph.nodes if n.op == "get_attr")
    return names


def weights_set_after(effects: Effects, model: torch.nn.Module, gm: fx.GraphModule) -> Effects:
    """``effects`` plus a ``SetLegacyWeight`` for each legacy weight hook of ``model`` whose
    layer the captured ``gm`` computes with (it reads the layer's ``<name>_orig`` or
    ``<name>_v``), unless a recorded effect already writes that attribute."""
    read = _read_attributes(gm)
    written = {(id(r.owner), r.name) for r in effects.records if isinstance(r, SetAttr)}
    added = []
    for path, module in model.named_modules():
        for hook in module._forward_pre_hooks.values():
            if not isinstance(hook, WEIGHT_HOOKS):
                continue
            name = _name(hook)
            source = f"{name}_v" if isinstance(hook, WeightNorm) else f"{name}_orig"
            if (".".join(filter(None, (path, source))) in read
                    and (id(module), name) not in written):
                added.append(SetLegacyWeight(module, hook, ".".join(filter(None, (path, name)))))
    if not added:
        return effects
    return dataclasses.replace(effects, records=(*effects.records, *added))


def legacy_weights(modules: Iterable[torch.nn.Module]) -> set[tuple[int, str]]:
    """``(id(module), name)`` of each attribute a legacy weight hook of ``modules`` sets:
    set after each step by ``SetLegacyWeight`` (detached), not as a write forward made."""
    return {(id(module), _name(hook)) for module in modules
            for hook in module._forward_pre_hooks.values() if isinstance(hook, WEIGHT_HOOKS)}


def _name(hook: SpectralNorm | WeightNorm | BasePruningMethod) -> str:
    """The attribute ``hook`` recomputes."""
    return hook._tensor_name if isinstance(hook, BasePruningMethod) else hook.name
