"""The user's stack of each node the capture traces, without formatting torch's frames.

fx's ``record_stack_traces`` formats every frame of every node's stack (some forty, each
with its source line read), and the capture then keeps only the user's few
(``user_stack``): about half the cost of tracing the model. ``traced_stack`` walks the
same frames, filters them as fx and ``user_stack`` do, and formats only the kept ones,
so each node's ``stack_trace`` is the same text for a fraction of the cost
(``tests/test_trace_stacks.py`` compares the two on every node).

>>> traced_stack(sys._getframe())   # inside a traced forward
'  File "model.py", line 12, in forward\\n    return self.fc(x)'
"""

from __future__ import annotations

import functools
import os
import re
import traceback
import types

import torch
from torch.fx.experimental.symbolic_shapes import uninteresting_files

__all__ = ["FX_STACK", "traced_stack", "user_stack"]

_TORCH_DIR = os.path.dirname(torch.__file__) + os.sep
_TRACER = os.path.join(os.path.dirname(os.path.abspath(__file__)), "fx_tracer.py")
_FRAME = re.compile(r'  File "([^"]+)", line \d+, in [^\n]*\n(?:    [^\n]*\n?)?')
#: fx prints a frame repeated more often than this in a row this many times (``traceback``)
_REPEATS = getattr(traceback, "_RECURSIVE_CUTOFF", 3)

#: ``traced_stack``'s answer where only fx's own text will do: a stack with no frame of
#: the user's (``user_stack`` then keeps all of it), or a frame the text could not name
FX_STACK = object()


@functools.lru_cache(maxsize=4096)  # every node's stack names the same few files
def _tracer_frame(path: str) -> bool:
    """torch's own frames, and the capture's tracer (its call_module override)."""
    path = os.path.abspath(path)
    return path.startswith(_TORCH_DIR) or path == _TRACER


def user_stack(stack_trace: str) -> str:
    """The recorded stack without torch's own frames (fx's printouts then show the user's line)."""
    frames = [m for m in _FRAME.finditer("  " + stack_trace.lstrip())]
    kept = [m.group(0) for m in frames if not _tracer_frame(m.group(1))]
    return "".join(kept).rstrip("\n") if kept else stack_trace


def traced_stack(frame: types.FrameType | None) -> str | None | object:
    """``user_stack`` of the stack fx would record for a node made under ``frame``: None
    where fx records none (no ``forward`` on the stack), ``FX_STACK`` where fx's own
    recording must run. fx keeps the frames from the outermost ``forward`` on, less
    ``uninteresting_files``, and prints a frame repeated in a row at most three times."""
    frames: list[tuple[str, int | None, str]] = []
    while frame is not None:
        code = frame.f_code
        frames.append((code.co_filename, frame.f_lineno, code.co_name))
        frame = frame.f_back
    frames.reverse()
    first = next((i for i, f in enumerate(frames) if f[2] == "forward"), None)
    if first is None:
        return None
    boring = uninteresting_files()
    frames = [f for f in frames[first:] if f[0] not in boring]
    if not frames:
        return None
    shown, run, last = [], 0, None
    for f in frames:
        run = run + 1 if f == last else 1
        last = f
        if run <= _REPEATS:
            shown.append(f)
    kept = [f for f in shown if not _tracer_frame(f[0])]
    if not kept or any(n is None or '"' in p for p, n, _ in kept):
        return FX_STACK
    text = "".join("".join(traceback.format_list([traceback.FrameSummary(p, n, name)]))
                   for p, n, name in kept)
    return text.rstrip("\n")
