"""Suite-wide guard: no test leaves a rule registered or a module trusted behind it."""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from mbcompile.passes.batch_rules import TABLE


@pytest.fixture(autouse=True)
def _rule_table_unchanged() -> Iterator[None]:
    before = TABLE.snapshot()
    yield
    changes = TABLE.changes_since(before)
    TABLE.restore(before)  # one test's residue must not fail the next
    assert not changes, f"the test left the batch-rule table changed: {changes}"
