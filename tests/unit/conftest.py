"""Unit tests keep nothing pinned between pauses unless a test asks for it (tests/unit/
test_kept_staging.py does), and never write the machine's pinned-memory ledger."""

import os
import tempfile
from collections.abc import Iterator
from pathlib import Path

import pytest

from flexium.engine.fast import pinned_budget


@pytest.fixture(autouse=True)
def no_kept_staging() -> Iterator[None]:
    # Not through monkeypatch: fixtures of the tests that check their own monkeypatching undone
    # would see ours undone only after them.
    before_env, before_dir = os.environ.get(pinned_budget.ENV), pinned_budget.LEDGER_DIR
    os.environ[pinned_budget.ENV] = "0"
    with tempfile.TemporaryDirectory() as folder:
        pinned_budget.LEDGER_DIR = Path(folder, "pinned-ledger")
        try:
            yield
        finally:
            pinned_budget.LEDGER_DIR = before_dir
            if before_env is None:
                os.environ.pop(pinned_budget.ENV, None)
            else:
                os.environ[pinned_budget.ENV] = before_env
