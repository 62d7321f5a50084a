"""Suite-wide: one intra-op thread, slow tests first, and a guard that no test leaves a
rule registered or a module trusted behind it.

The suite runs under pytest-xdist (``-n auto --dist loadgroup`` in pyproject.toml): one
worker per core, so each worker and every process it starts (spawned ranks, ``mbcompile``
subprocesses) uses one intra-op thread. The test models are tiny; a second thread buys
nothing, and its spin-waiting on a busy 2-core machine made small ops up to 100x slower.
"""

from __future__ import annotations

import json
import os
import random
import shutil
import tempfile
from collections.abc import Iterator
from typing import Any

import pytest

# Before torch is imported here or in any child process (children inherit the variable):
# torch reads it once, for its default thread count. An explicit setting is kept.
os.environ.setdefault("OMP_NUM_THREADS", "1")

_HASHSEED_FLAG = "MBCOMPILE_TESTS_SET_PYTHONHASHSEED"
_GROUPS_DIR = "MBCOMPILE_TESTS_XDIST_GROUPS"  # where the workers write their tests' groups


def pytest_configure(config: pytest.Config) -> None:
    """Under xdist every worker must collect the same tests in the same order, and a test
    parametrized over a set of strings is ordered by the hash seed: the workers share one
    seed, drawn here for the run. The workers then drop it from their environment, so
    that the processes a test starts (tests/test_determinism.py compares fresh ones) draw
    their own, as they do without xdist.

    ``--dist loadgroup`` groups by a suffix that xdist adds to the node ids, which no
    longer takes effect on pytest 9.2 (pytest-xdist issue 1386): the groups would be
    split silently. So the workers write each test's group to a file and the controller's
    scheduler (_GroupScheduling) reads it."""
    if hasattr(config, "workerinput"):  # an xdist worker
        if os.environ.pop(_HASHSEED_FLAG, None):
            os.environ.pop("PYTHONHASHSEED", None)
        return
    if not getattr(config.option, "tx", None):  # no xdist workers
        return
    if "PYTHONHASHSEED" not in os.environ:
        os.environ["PYTHONHASHSEED"] = str(random.randrange(1, 2**32))
        os.environ[_HASHSEED_FLAG] = "1"
    if config.pluginmanager.has_plugin("xdist") and config.getvalue("dist") == "loadgroup":
        folder = tempfile.mkdtemp(prefix="mbcompile-xdist-groups-")
        os.environ[_GROUPS_DIR] = folder  # the workers inherit it
        config.add_cleanup(lambda: shutil.rmtree(folder, ignore_errors=True))
        config.pluginmanager.register(_GroupScheduling(folder), "mbcompile-xdist-groups")


class _GroupScheduling:
    """``--dist loadgroup`` whose groups come from the workers' files, not node ids."""

    def __init__(self, folder: str) -> None:
        self.folder = folder

    @pytest.hookimpl(tryfirst=True)
    def pytest_xdist_make_scheduler(self, config: pytest.Config, log: Any) -> Any:
        from xdist.scheduler import LoadGroupScheduling

        folder = self.folder

        class Scheduling(LoadGroupScheduling):
            groups: dict[str, str] | None = None

            def schedule(self) -> None:  # every worker has collected, and written its file
                if self.groups is None:
                    self.groups = {}
                    for name in sorted(os.listdir(folder)):
                        with open(os.path.join(folder, name)) as f:
                            self.groups.update(json.load(f))
                super().schedule()

            def _split_scope(self, nodeid: str) -> str:
                group = (self.groups or {}).get(nodeid)
                return f"@{group}" if group else super()._split_scope(nodeid)

        return Scheduling(config, log)


def _write_groups(units: dict[pytest.Item, str]) -> None:
    """In an xdist worker: each grouped test's group, for _GroupScheduling."""
    folder, worker = os.environ.get(_GROUPS_DIR), os.environ.get("PYTEST_XDIST_WORKER")
    if not folder or not worker:
        return
    groups = {item.nodeid: unit for item, unit in units.items() if unit != item.nodeid}
    path = os.path.join(folder, f"{worker}.json")
    with open(f"{path}.tmp", "w") as f:
        json.dump(groups, f)
    os.replace(f"{path}.tmp", path)


# Module-scoped fixtures that cost seconds (a compile, a spawn of ranks, a wheel build):
# the tests that use one go to the same xdist worker (one work unit of --dist loadgroup),
# so that the fixture runs once, not once per worker. Keyed by "<file>::<fixture>".
SHARED_FIXTURES = {
    "tests/test_cli.py::fits",
    "tests/test_cost.py::costs",
    "tests/test_explore.py::costs",
    "tests/test_fsdp_memory.py::measured",
    "tests/test_layering.py::lazy_probe",
    "tests/test_packaging.py::wheel",
    "tests/test_two_phase.py::mixtral",
}


@pytest.hookimpl(tryfirst=True)  # before xdist reads the xdist_group marks
def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    units = {}  # item -> its work unit: its xdist group, else itself
    for item in items:
        path = item.nodeid.split("::", 1)[0]
        for name in getattr(item, "fixturenames", ()):
            key = f"{path}::{name}"
            if key in SHARED_FIXTURES:
                stem = path.rsplit("/", 1)[-1].removesuffix(".py")
                item.add_marker(pytest.mark.xdist_group(f"{stem}.{name}"))
                break
        # as xdist names a group: a test with several marks joins their names
        names = {str(m.args[0] if m.args else m.kwargs.get("name", "default"))
                 for m in item.iter_markers("xdist_group")}
        units[item] = "_".join(sorted(names)) or item.nodeid
    _write_groups(units)
    # Slow tests (mostly spawned ranks and subprocesses) first: under xdist they start
    # while the many short tests fill the other worker, instead of ending the run alone.
    # A group is slow if one of its tests is, and moves as a whole; the sort is stable, so
    # the order within each class is the collection order.
    slow = {units[item] for item in items if item.get_closest_marker("slow") is not None}
    items.sort(key=lambda item: units[item] not in slow)


@pytest.fixture(scope="session", autouse=True)
def _one_intra_op_thread() -> None:
    """In case torch was imported before this file set OMP_NUM_THREADS (by a plugin)."""
    if os.environ.get("OMP_NUM_THREADS") == "1":
        import torch

        torch.set_num_threads(1)


@pytest.fixture
def float64_default() -> Iterator[None]:
    """torch's default dtype is float64 for the test (the equivalence tests' precision)."""
    import torch

    before = torch.get_default_dtype()
    torch.set_default_dtype(torch.float64)
    yield
    torch.set_default_dtype(before)


@pytest.fixture(autouse=True)
def _rule_table_unchanged() -> Iterator[None]:
    from mbcompile.passes.rules import TABLE  # here: the xdist controller needs no torch

    before = TABLE.snapshot()
    yield
    changes = TABLE.changes_since(before)
    TABLE.restore(before)  # one test's residue must not fail the next
    assert not changes, f"the test left the batch-rule table changed: {changes}"
