"""ci/test.sh's own behaviour, on stub commands (the real ones take half an hour): `--quick` runs
the lint and the unit tests alone, spread over FLEXIUM_TEST_WORKERS pytest processes, and every
run ends with the time each stage took, a failed one too."""

from __future__ import annotations

import os
import stat
import subprocess
from pathlib import Path

SCRIPT = Path(__file__).resolve().parents[2] / "ci" / "test.sh"


def _stub_venv(tmp: Path, failing: str = "") -> Path:
    """A venv whose python, ruff and clang-format record their arguments and succeed (``failing``
    fails; ``failing="pytest"``: python running pytest prints a test's failure as pytest's summary
    does, and fails)."""
    bin_dir = tmp / "venv" / "bin"
    bin_dir.mkdir(parents=True)
    (bin_dir / "activate").write_text('export PATH="$(dirname "${BASH_SOURCE[0]}"):$PATH"\n')
    for name in ("python", "ruff", "clang-format"):
        stub = bin_dir / name
        script = f'#!/bin/sh\necho "{name} $*" >> "$CALLS"\n'
        if name == "python" and failing == "pytest":
            failure = "FAILED tests/unit/test_x.py::test_y - AssertionError: why"
            script += f'case "$*" in *pytest*) echo "{failure}"; exit 1;; esac\n'
        stub.write_text(script + f"exit {1 if name == failing else 0}\n")
        stub.chmod(stub.stat().st_mode | stat.S_IEXEC)
    return bin_dir.parent


def _run(tmp: Path, *args: str, failing: str = "") -> tuple[subprocess.CompletedProcess[str], list[str]]:
    calls = tmp / "calls.txt"
    env = {
        **os.environ,
        "FLEXIUM_TEST_VENV": str(_stub_venv(tmp, failing)),
        "CALLS": str(calls),
        "FLEXIUM_TEST_WORKERS": "3",
    }
    done = subprocess.run(["bash", str(SCRIPT), *args], env=env, capture_output=True, text=True, timeout=60)
    return done, calls.read_text().splitlines() if calls.exists() else []


def test_quick_runs_the_lint_and_the_unit_tests_and_says_how_long_each_took(tmp_path: Path) -> None:
    done, calls = _run(tmp_path, "--quick", "-k", "config")
    assert done.returncode == 0, done.stdout + done.stderr
    assert "ruff check ." in calls
    quick = "python -m pytest -q --tb=short -x -n 3 --dist loadfile --no-loadscope-reorder --durations=10"
    assert f"{quick} tests/unit -k config" in calls
    assert not any("mypy" in call or "tests/server" in call or "tests/e2e" in call for call in calls), calls
    # flexium is importable here (the stub says so): --quick does not build it again
    assert not any("--no-build-isolation" in call for call in calls), calls
    summary = done.stdout.split("== time per stage\n")[1].splitlines()
    assert [line.split(" s  ", 1)[1] for line in summary] == [
        "lint: ruff check, ruff format --check, clang-format",
        "installing build tools, torch (CPU) and test dependencies",
        "unit tests (quick: -x)",
        "total",
    ]


def test_a_failed_stage_still_gets_its_time(tmp_path: Path) -> None:
    done, _calls = _run(tmp_path, "--quick", failing="ruff")
    assert done.returncode == 1
    summary = done.stdout.split("== time per stage\n")[1].splitlines()
    assert [line.split(" s  ", 1)[1] for line in summary] == [
        "lint: ruff check, ruff format --check, clang-format",
        "total",
    ]


def test_a_failed_suite_is_named_again_at_the_end(tmp_path: Path) -> None:
    done, _calls = _run(tmp_path, "--quick", failing="pytest")
    assert done.returncode == 1
    tail = done.stdout.split("== what failed")[1]
    assert "FAILED tests/unit/test_x.py::test_y - AssertionError: why" in tail.split("== time per stage")[0]
