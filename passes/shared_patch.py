"""A patch of torch's that captures on several threads share.

A capture watches a torch method while it traces (``Function.apply`` in
``custom_functions.py``, ``Tensor.detach_`` and kin in ``export_autograd.py``). Captures may
run on several threads at once: the patch is installed by the first in progress and
removed by the last, whatever the order in which the threads finish, and each thread
reports to its own innermost capture; other threads' calls find no capture and go
straight to torch.

>>> patch = SharedPatch(install, remove)
>>> with patch.entered(recorder):      # install() on the first entry, on any thread
...     patch.current()                  # this thread's innermost: recorder
"""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Callable, Iterator
from typing import Any

__all__ = ["SharedPatch"]


class SharedPatch:
    """``install()`` while any thread is inside ``entered``; ``current()``: what this
    thread entered last (None outside)."""

    def __init__(self, install: Callable[[], None], remove: Callable[[], None]) -> None:
        self._install, self._remove = install, remove
        self._lock = threading.Lock()
        self._users = 0  # captures in progress, on any thread: the patch stays while one is
        self._local = threading.local()  # .stack: this thread's captures, innermost last

    def current(self) -> Any:
        stack = getattr(self._local, "stack", None)
        return stack[-1] if stack else None

    @contextlib.contextmanager
    def entered(self, item: Any) -> Iterator[None]:
        with self._lock:
            if self._users == 0:
                self._install()
            self._users += 1
        stack = self._local.__dict__.setdefault("stack", [])
        stack.append(item)
        try:
            yield
        finally:
            stack.pop()
            with self._lock:
                self._users -= 1
                if self._users == 0:
                    self._remove()
