"""The structure of a model's output: flat leaves and the spec that rebuilds them.

Outputs are flattened (tuples, lists, dicts, dataclasses, ``ModelOutput``-like
objects) so that later passes see one fact per output leaf; ``OutputSpec`` puts
the structure back after the call.

>>> leaves = []
>>> spec = flatten_output({"loss": 1.5, "n": (2, 3)}, leaves, lambda v: isinstance(v, int))
>>> leaves, spec.rebuild([20, 30])
([2, 3], {'loss': 1.5, 'n': (20, 30)})
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

import torch.fx as fx
from torch.utils import _pytree as pytree

__all__ = ["OutputSpec", "flatten_output", "through_leaves"]


@dataclass(frozen=True)
class OutputSpec:
    """The structure of a model's output, with leaves numbered 0..n-1.

    ``kind`` is "leaf", "const", "tuple", "list", "dict" or "dataclass"; ``children``
    hold the sub-specs and ``keys`` their names (dict keys or dataclass fields).
    """

    kind: str
    index: int = -1  # for "leaf": position in the flat outputs
    value: Any = None  # for "const"
    type: Any = None  # container type to rebuild
    keys: tuple[Any, ...] = ()
    children: tuple[OutputSpec, ...] = ()

    def leaf_count(self) -> int:
        """How many leaves the structure holds (the flat outputs that follow are extras)."""
        if self.kind == "leaf":
            return 1
        return sum(c.leaf_count() for c in self.children)

    def leaf_of(self, output: Any, index: int) -> Any:
        """The leaf numbered ``index`` of ``output``, an object shaped like this spec
        (what ``rebuild`` made), or None."""
        if self.kind == "leaf":
            return output if self.index == index else None
        if self.kind in ("tuple", "list"):
            parts: list[Any] = list(output)
        elif self.kind == "dataclass":
            parts = [getattr(output, k) for k in self.keys]
        elif self.kind == "dict":
            parts = [output[k] for k in self.keys]
        else:
            return None
        for child, part in zip(self.children, parts):
            found = child.leaf_of(part, index)
            if found is not None:
                return found
        return None

    def rebuild(self, leaves: tuple[Any, ...] | list[Any]) -> Any:
        if self.kind == "leaf":
            return leaves[self.index]
        if self.kind == "const":
            return self.value
        values = [c.rebuild(leaves) for c in self.children]
        if self.kind == "tuple":
            return self.type(*values) if _is_namedtuple(self.type) else self.type(values)
        if self.kind == "list":
            return self.type(values)
        if self.kind == "dataclass":
            return self.type(**dict(zip(self.keys, values)))
        return self.type(zip(self.keys, values))  # dict and its subclasses


def _is_namedtuple(t: Any) -> bool:
    return isinstance(t, type) and issubclass(t, tuple) and hasattr(t, "_fields")


def flatten_output(obj: Any, leaves: list[Any], is_leaf: Callable[[Any], bool]) -> OutputSpec:
    """Flatten ``obj`` into ``leaves`` (appending) and return its spec."""
    if is_leaf(obj):
        leaves.append(obj)
        return OutputSpec("leaf", index=len(leaves) - 1)
    if dataclasses.is_dataclass(obj) and not isinstance(obj, type):
        # ModelOutput-like objects are dataclasses (and OrderedDicts): rebuild by field.
        names = tuple(f.name for f in dataclasses.fields(obj))
        kids = tuple(flatten_output(getattr(obj, n), leaves, is_leaf) for n in names)
        return OutputSpec("dataclass", type=type(obj), keys=names, children=kids)
    if isinstance(obj, tuple):
        kids = tuple(flatten_output(v, leaves, is_leaf) for v in obj)
        return OutputSpec("tuple", type=type(obj), children=kids)
    if isinstance(obj, list):
        kids = tuple(flatten_output(v, leaves, is_leaf) for v in obj)
        return OutputSpec("list", type=type(obj), children=kids)
    if isinstance(obj, Mapping):
        keys = tuple(obj.keys())
        kids = tuple(flatten_output(obj[k], leaves, is_leaf) for k in keys)
        return OutputSpec("dict", type=dict if type(obj) is fx.immutable_collections.immutable_dict
                          else type(obj), keys=keys, children=kids)
    return OutputSpec("const", value=obj)



def through_leaves(value: Any, kind: type, call: Callable[[list[Any]], Any]) -> Any:
    """``value`` with its leaves of type ``kind`` replaced by ``call(those leaves)``'s
    items, in order: one marker call for all of a unit's values (``call`` sees the list
    even when it is empty)."""
    leaves, spec = pytree.tree_flatten(value)
    at = [i for i, v in enumerate(leaves) if isinstance(v, kind)]
    out = call([leaves[i] for i in at])
    for j, i in enumerate(at):
        leaves[i] = out[j]
    return pytree.tree_unflatten(leaves, spec)

