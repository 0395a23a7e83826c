"""Puts tests/ on sys.path so that tests import the helpers they share from tests/support
(`from support.fake_driver import FakeDriver`), and fails a run in which a test was skipped or
nothing passed: a skipped test never passed, so CI and ci/gpu-tests.sh must not count it. A skip
at collection (a module's `pytest.importorskip`, a module-level `pytest.skip`) counts like a
test's own: it hides every test of the module.
``FLEXIUM_ALLOW_SKIPS=1`` lets a run pass with skips, listed.
``FLEXIUM_ALLOW_SKIPS_FOR_GPUS=1`` (ci/gpu-tests.sh) lets it pass with the tests skipped for want
of GPUs alone ("needs 4 GPUs, NVML sees 2", ``tests/gpu/conftest.py``), listed; any other skip
still fails it. Neither lets a run in which no test passed be green."""

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
_passed = 0
_verdict = ""  # why the run fails though every test that ran passed


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    """The order in which pytest-xdist's workers are handed the test files (ci/test.sh: --dist
    loadfile --no-loadscope-reorder): files marked ``started_first`` first, then the others by how
    many tests they hold, most first (xdist's own order otherwise). A file of two tests of minutes
    each (the OpenAPI fuzz) came last in xdist's order and kept one worker busy alone for two
    minutes after the others had finished. A run without workers keeps pytest's order."""
    if not os.environ.get("PYTEST_XDIST_WORKER"):
        return
    by_file: dict[str, list[pytest.Item]] = {}
    for item in items:
        by_file.setdefault(item.nodeid.split("::", 1)[0], []).append(item)

    def order(tests: list[pytest.Item]) -> tuple[bool, int]:
        return tests[0].get_closest_marker("started_first") is None, -len(tests)

    files = sorted(by_file.values(), key=order)
    items[:] = [item for tests in files for item in tests]


def _reason(report: pytest.TestReport | pytest.CollectReport) -> str:
    return report.longrepr[2] if isinstance(report.longrepr, tuple) else str(report.longrepr)


def _for_want_of_gpus(report: pytest.TestReport | pytest.CollectReport) -> bool:
    found = FEWER_GPUS.search(_reason(report))
    return found is not None and int(found.group(2)) < int(found.group(1))


def _note_skip(report: pytest.TestReport | pytest.CollectReport) -> None:
    if os.environ.get(ALLOW_SKIPS_FOR_GPUS_ENV) == "1" and _for_want_of_gpus(report):
        return
    _skipped.append(f"{report.nodeid} ({_reason(report).removeprefix('Skipped: ')})")


def pytest_runtest_logreport(report: pytest.TestReport) -> None:
    global _passed
    if report.skipped and not hasattr(report, "wasxfail"):
        _note_skip(report)
    elif report.when == "call" and report.passed:
        _passed += 1


def pytest_collectreport(report: pytest.CollectReport) -> None:
    if report.skipped:
        _note_skip(report)


def _problem(session: pytest.Session) -> str:
    if session.config.option.collectonly:
        return ""
    if _skipped and os.environ.get(ALLOW_SKIPS_ENV) != "1":
        return (
            f"{len(_skipped)} test(s) or module(s) skipped, and a skipped test never passed "
            f"(set {ALLOW_SKIPS_ENV}=1 only where they cannot run): " + ", ".join(_skipped[:10])
        )
    if _passed == 0:
        return "no test passed: a run in which nothing ran is not green"
    return ""


def pytest_sessionfinish(session: pytest.Session, exitstatus: int) -> None:
    global _verdict
    _verdict = _problem(session)
    if exitstatus == 0 and _verdict:
        session.exitstatus = 1


def pytest_terminal_summary(terminalreporter: pytest.TerminalReporter) -> None:
    if _verdict:
        terminalreporter.write_line(f"FAILED: {_verdict}", red=True)
