"""Puts tests/ on sys.path so that test modules can `import fake_driver`, and fails a run in
which a test was skipped: a skipped test never passed, so CI and ci/gpu-tests.sh must not count
it. ``FLEXIUM_ALLOW_SKIPS=1`` lets a run pass with skips, listed (ci/gpu-tests.sh sets it on a
machine with one GPU, where the two-GPU tests cannot run)."""

import os
import sys
from pathlib import Path

import pytest

_TESTS_DIR = str(Path(__file__).resolve().parent)
if _TESTS_DIR not in sys.path:
    sys.path.insert(0, _TESTS_DIR)

ALLOW_SKIPS_ENV = "FLEXIUM_ALLOW_SKIPS"
_skipped: list[str] = []


def pytest_runtest_logreport(report: pytest.TestReport) -> None:
    if report.skipped and not hasattr(report, "wasxfail"):
        _skipped.append(report.nodeid)


def pytest_sessionfinish(session: pytest.Session, exitstatus: int) -> None:
    if _skipped and os.environ.get(ALLOW_SKIPS_ENV) != "1" and exitstatus == 0:
        session.exitstatus = 1


def pytest_terminal_summary(terminalreporter: pytest.TerminalReporter) -> None:
    if _skipped and os.environ.get(ALLOW_SKIPS_ENV) != "1":
        terminalreporter.write_line(
            f"FAILED: {len(_skipped)} test(s) skipped, and a skipped test never passed "
            f"(set {ALLOW_SKIPS_ENV}=1 only where they cannot run): " + ", ".join(_skipped[:10]),
            red=True,
        )
