"""Puts tests/ on sys.path so that test modules can `import fake_driver`, and fails a run in
which a test was skipped: a skipped test never passed, so CI and ci/gpu-tests.sh must not count
it. ``FLEXIUM_ALLOW_SKIPS=1`` lets a run pass with skips, listed.
``FLEXIUM_ALLOW_SKIPS_FOR_GPUS=1`` (ci/gpu-tests.sh) lets it pass with the tests skipped for want
of GPUs alone ("needs 4 GPUs, NVML sees 2", ``tests/gpu/conftest.py``), listed; any other skip
still fails it."""

import os
import re
import sys
from pathlib import Path

import pytest

_TESTS_DIR = str(Path(__file__).resolve().parent)
if _TESTS_DIR not in sys.path:
    sys.path.insert(0, _TESTS_DIR)

ALLOW_SKIPS_ENV = "FLEXIUM_ALLOW_SKIPS"
ALLOW_SKIPS_FOR_GPUS_ENV = "FLEXIUM_ALLOW_SKIPS_FOR_GPUS"
FEWER_GPUS = re.compile(r"needs (\d+) GPUs, NVML sees (\d+)")
_skipped: list[str] = []


def _for_want_of_gpus(report: pytest.TestReport) -> bool:
    reason = report.longrepr[2] if isinstance(report.longrepr, tuple) else str(report.longrepr)
    found = FEWER_GPUS.search(reason)
    return found is not None and int(found.group(2)) < int(found.group(1))


def pytest_runtest_logreport(report: pytest.TestReport) -> None:
    if report.skipped and not hasattr(report, "wasxfail"):
        if os.environ.get(ALLOW_SKIPS_FOR_GPUS_ENV) == "1" and _for_want_of_gpus(report):
            return
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
