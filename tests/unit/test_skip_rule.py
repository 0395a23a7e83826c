"""The rule that fails a run with a skipped test (tests/conftest.py): a test skipped for want of
GPUs is let through where FLEXIUM_ALLOW_SKIPS_FOR_GPUS=1 says so (ci/gpu-tests.sh), and nothing
else is."""

from __future__ import annotations

import importlib.util
from pathlib import Path
from types import ModuleType, SimpleNamespace
from typing import Any

import pytest


def _rule() -> ModuleType:
    spec = importlib.util.spec_from_file_location("root_conftest", Path(__file__).parents[1] / "conftest.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _skipped(reason: str) -> Any:
    return SimpleNamespace(skipped=True, longrepr=("tests/gpu/test_x.py", 3, f"Skipped: {reason}"), nodeid=reason)


@pytest.mark.parametrize(
    "reason, let_through",
    [
        ("needs 4 GPUs, NVML sees 2", True),
        ("needs 2 GPUs, NVML sees 1", True),
        ("needs 2 GPUs, NVML sees 4", False),  # a machine that has them: a skip then is a fault
        ("the server extra is not installed", False),
    ],
)
def test_only_a_skip_for_want_of_gpus_is_let_through(
    monkeypatch: pytest.MonkeyPatch, reason: str, let_through: bool
) -> None:
    rule = _rule()
    monkeypatch.setenv(rule.ALLOW_SKIPS_FOR_GPUS_ENV, "1")
    rule.pytest_runtest_logreport(_skipped(reason))
    assert rule._skipped == ([] if let_through else [reason])


def test_without_the_setting_every_skip_counts(monkeypatch: pytest.MonkeyPatch) -> None:
    rule = _rule()
    monkeypatch.delenv(rule.ALLOW_SKIPS_FOR_GPUS_ENV, raising=False)
    rule.pytest_runtest_logreport(_skipped("needs 4 GPUs, NVML sees 2"))
    assert rule._skipped == ["needs 4 GPUs, NVML sees 2"]
