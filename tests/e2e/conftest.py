"""Fixtures of the end-to-end tests (helpers in tests/support/e2e.py)."""

from __future__ import annotations

import signal
from collections.abc import Iterator
from pathlib import Path

import pytest

pytest.importorskip("fastapi", reason='the server extra is not installed: pip install ".[server]"')
pytest.importorskip("torch", reason="the training processes need torch (a CPU build)")

from support.e2e import Server  # noqa: E402


@pytest.fixture(scope="module")
def module_tmp(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("e2e")


@pytest.fixture(scope="module")
def server(module_tmp: Path) -> Iterator[Server]:
    with Server(module_tmp).serving(signal.SIGKILL) as srv:
        yield srv
