"""RNG states as plain Python values: what a checkpoint stores so that a resumed run
draws the same numbers (torch CPU and CUDA, Python's ``random``, numpy when installed,
and the ``torch.Generator`` objects the model holds, which forward may draw from).

The states are JSON (hex strings and lists), never pickles: a checkpoint's files are
read without unpickling anything but tensors (see ``mbcompile.training.checkpoint``).
"""

from __future__ import annotations

import contextlib
import importlib
import importlib.util
import random
from collections.abc import Iterator, Mapping
from typing import Any

import torch

__all__ = ["broadcast_rng_state", "generator_states", "preserved_rng", "rng_state",
           "set_generator_states", "set_rng_state"]


def _numpy() -> Any:
    return importlib.import_module("numpy") if importlib.util.find_spec("numpy") else None


def _hex(t: torch.Tensor) -> str:  # a torch RNG state (bytes) as plain text
    return bytes(t.tolist()).hex()


def _unhex(text: str) -> torch.Tensor:
    return torch.tensor(list(bytes.fromhex(text)), dtype=torch.uint8)


def rng_state() -> dict[str, Any]:
    """The process's RNG states (torch CPU and CUDA, Python, numpy) as JSON-able values."""
    state: dict[str, Any] = {"torch": _hex(torch.get_rng_state()),
                             "python": [random.getstate()[0], list(random.getstate()[1]),
                                        random.getstate()[2]]}
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        state["cuda"] = [_hex(s) for s in torch.cuda.get_rng_state_all()]
    np = _numpy()
    if np is not None:
        name, keys, pos, has_gauss, gauss = np.random.get_state()
        state["numpy"] = [name, keys.tolist(), int(pos), int(has_gauss), float(gauss)]
    return state


def set_rng_state(state: Mapping[str, Any]) -> None:
    """Restore what ``rng_state`` returned."""
    torch.set_rng_state(_unhex(state["torch"]))
    version, internal, gauss = state["python"]
    random.setstate((version, tuple(internal), gauss))
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state_all([_unhex(s) for s in state["cuda"]])
    np = _numpy()
    if np is not None and "numpy" in state:
        name, keys, pos, has_gauss, gauss = state["numpy"]
        np.random.set_state((name, np.array(keys, dtype=np.uint32), pos, has_gauss, gauss))


def generator_states(model: torch.nn.Module) -> list[str]:
    """The states of the generators ``model``'s modules hold (``self.g =
    torch.Generator()``), in module order: a resumed run's forward draws on from there
    (they were made again from their seed at ``__init__``)."""
    from mbcompile.passes.generators import generators_of

    return [_hex(g.get_state()) for g in generators_of(model)]


def set_generator_states(model: torch.nn.Module, states: list[str] | None) -> None:
    """Restore what ``generator_states`` returned (None: a checkpoint written before they
    were kept, left as they are)."""
    from mbcompile.passes.generators import generators_of

    if states is None:
        return
    generators = generators_of(model)
    if len(generators) != len(states):
        from mbcompile.training.checkpoint import CheckpointError

        raise CheckpointError(
            f"the checkpoint holds the states of {len(states)} torch.Generator objects of "
            f"the model, and {type(model).__name__} holds {len(generators)}: resume with "
            "the model the checkpoint was written with")
    for g, state in zip(generators, states):
        g.set_state(_unhex(state))


def broadcast_rng_state(group: Any) -> None:
    """Give every rank of ``group`` rank 0's host RNG states (torch CPU, Python, numpy).

    Ranks draw different numbers inside the model (dropout over shares of other sizes),
    so their global RNGs drift apart; a data pass started from them would shuffle the
    data differently on each rank, and the ranks' shares would no longer make up one
    global batch. Each rank's CUDA generators stay its own.
    """
    import torch.distributed as dist

    state = rng_state()
    state.pop("cuda", None)
    box = [state]
    dist.broadcast_object_list(box, src=dist.get_global_rank(group, 0), group=group)
    set_rng_state(box[0])


@contextlib.contextmanager
def preserved_rng() -> Iterator[None]:
    """Run the body without changing any RNG state (compiling, writing checkpoints), so
    that a resumed run, which compiles at another step, draws the same numbers."""
    state = rng_state()
    try:
        yield
    finally:
        set_rng_state(state)
