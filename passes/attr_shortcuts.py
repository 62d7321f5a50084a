"""A graph module's attribute paths, read in one step instead of one ``__getattr__`` a hop.

fx's code reads a parameter or layer by its dotted path, ``self.transformer.h[0].attn``
spelled ``getattr(self.transformer.h, "0").attn.c_attn.weight``: every hop is a call of
``nn.Module.__getattr__`` (the value lives in ``_modules`` / ``_parameters``, not in the
instance dict), 120 calls per microbatch of a two-layer GPT-2 (about 60 µs a microbatch,
0.5 µs each). The containers along those paths are the graph module's own: fx made them
(``GraphModule.__init__``'s ``_copy_attr``: plain ``nn.Module()``s) and nothing else holds
them. ``shortcut_attrs`` puts each child of those containers (and of the graph module itself)
in the container's instance dict as well, where Python finds it before ``__getattr__`` is
asked; the code, the graph and every ``named_parameters()`` stay as they were::

    body.blocks                     # before: Module.__getattr__ -> body._modules["blocks"]
    shortcut_attrs(body, user_ids)  # body.__dict__["blocks"] = body._modules["blocks"], ...
    body.blocks                     # after: the instance dict, no call

Modules of the user's (``foreign``) are never written to (a graph module shares the user's
layers and parameters, never copies them). Parameters and buffers are put there only with
``tensors=True``: ``torch.func.functional_call`` swaps the tensors of the module it runs,
which an instance-dict entry would hide. A shortcut is as current as the graph module's own
slots: ``nn.Module.__setattr__`` of a module or parameter drops the instance-dict entry of
that name, and the compiled module lowers again (a new graph module) whenever one of the
user's parameters, buffers or submodules is replaced (its mode key).
"""

from __future__ import annotations

from collections.abc import Container

import torch.fx as fx

__all__ = ["shortcut_attrs"]


def shortcut_attrs(gm: fx.GraphModule, foreign: Container[int], tensors: bool = True
                   ) -> fx.GraphModule:
    """Put the children of ``gm`` and of the containers under it that are not in
    ``foreign`` (ids of the user's modules) in their instance dicts (see above). Returns
    ``gm``."""
    for module in gm.modules():
        if id(module) in foreign:
            continue
        slots: list[dict[str, object]] = [module._modules]
        if tensors:
            slots += [module._parameters, module._buffers]
        own = vars(module)
        for table in slots:
            for name, value in table.items():
                # a name the class defines (a method, a property) is the class's: never shadowed
                if value is not None and not hasattr(type(module), name):
                    own[name] = value
    return gm
