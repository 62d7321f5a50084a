"""What one compiled graph assumes of a call's inputs beyond their shapes, checked at each
call of that graph (``CompiledModule._call``): the example's values inside the inputs and
their dtypes, where the graph holds them (torch.export's), and no input it writes in
place sharing memory with another.

>>> check_held(inputs, values, layout, fixed=True, written=("input_ids",))
InputError: input 'input_ids' shares memory with input 'labels' ...
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch

from mbcompile.errors import InputError
from mbcompile.input_kinds import dtype_error
from mbcompile.inputs import (
    ExampleValue,
    InputDtypeError,
    Inputs,
    check_value,
    leaf_name,
    leaves,
)

__all__ = ["check_dtypes", "check_held", "check_values"]


def check_held(inputs: Inputs, values: Sequence[Any], layout: tuple[Any, ...], fixed: bool,
               written: Sequence[str]) -> None:
    """What one compiled graph assumes of a call's inputs: the example's values inside them
    where it holds them (``fixed``: ``check_values``), and no input it writes in place
    (``written``, by name) sharing memory with another (``labels=input_ids`` with
    ``input_ids.masked_fill_(...)`` in forward: the step wrote it back after the step, so
    ``labels`` read the old ids, where eager's sees the write). Raises ``InputError``."""
    if fixed:
        check_values(inputs, values, layout)
        if layout and not layout[0][0].fixed:  # the module's first graph was torch.fx's
            check_dtypes(inputs, values, layout)
    for name in written:
        value = values[inputs.names.index(name)]
        if not isinstance(value, torch.Tensor):
            continue
        storage = value.untyped_storage().data_ptr()
        for other, leaf in ((n, t) for n, v in zip(inputs.names, values) if n != name
                            for _, t in leaves(v) if isinstance(t, torch.Tensor)):
            if leaf.untyped_storage().data_ptr() == storage:
                raise InputError(
                    f"input {name!r} shares memory with input {other!r} (the same tensor, "
                    f"or a view of it), and forward writes {name!r} in place; the compiled "
                    f"step writes it back after the step, so {other!r} would read it as it "
                    f"was. Fix: pass a copy ({other}={name}.clone()), or write it out of "
                    "place in forward")


def check_values(inputs: Inputs, values: Sequence[Any], layout: tuple[Any, ...]) -> None:
    """Raise ``InputError`` where a number, flag or string inside an input differs from the
    example's, for a graph that holds the example's (torch.export's: a call with another
    silently ran the example's; torch.fx reads a number there as the call's)."""
    for name, value, (_, shapes) in zip(inputs.names, values, layout):
        if any(isinstance(w, ExampleValue) for w in shapes):
            for (path, t), want in zip(leaves(value), shapes):
                if isinstance(want, ExampleValue):
                    check_value(leaf_name(name, path), t, want)


def check_dtypes(inputs: Inputs, values: Sequence[Any], layout: tuple[Any, ...]) -> None:
    """Raise ``InputDtypeError`` where a tensor inside an input has another dtype than the
    example's, for a torch.export graph of a module whose layout does not say so (its
    first graph, in another train/eval mode, was torch.fx's: ``check_layout`` compares
    dtypes where the first graph holds them)."""
    changed = [(leaf_name(name, path), was, t.dtype)
               for name, value, (held, _) in zip(inputs.names, values, layout)
               for (path, t), was in zip(leaves(value), held.dtypes)
               if was is not None and isinstance(t, torch.Tensor) and t.dtype is not was]
    if changed:
        raise InputDtypeError(dtype_error(changed))
