"""The rule that fails a run with a skipped test (tests/conftest.py), checked on real pytest runs
of small test folders that use the root conftest itself: a test or a whole module skipped for want
of GPUs is let through where FLEXIUM_ALLOW_SKIPS_FOR_GPUS=1 says so (ci/gpu-tests.sh), nothing else
is, and a run in which no test passed is never green; the same when the run is spread over
pytest-xdist's workers, as ci/test.sh runs the suites."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT_CONFTEST = Path(__file__).parents[1] / "conftest.py"
PASSES = "def test_passes():\n    assert 1 + 1 == 2\n"
HIDDEN = "\n\ndef test_hidden():\n    pass\n"
MISSING_EXTRA = (
    'import pytest\npytest.importorskip("no_such_module", reason="the server extra is not installed")\n' + HIDDEN
)
MODULE_NEEDS_GPUS = 'import pytest\npytest.skip("needs 2 GPUs, NVML sees 1", allow_module_level=True)\n' + HIDDEN
TEST_NEEDS_GPUS = 'import pytest\n\n\ndef test_moves():\n    pytest.skip("needs 4 GPUs, NVML sees 2")\n'
TEST_NEEDS_NOTHING_MORE = 'import pytest\n\n\ndef test_moves():\n    pytest.skip("needs 2 GPUs, NVML sees 4")\n'


def _run(
    tmp_path: Path, modules: dict[str, str], *, allow_for_gpus: bool, workers: int = 0
) -> subprocess.CompletedProcess[str]:
    shutil.copy(ROOT_CONFTEST, tmp_path / "conftest.py")
    for name, text in modules.items():
        (tmp_path / name).write_text(text)
    env = {k: v for k, v in os.environ.items() if not k.startswith("FLEXIUM_ALLOW_SKIPS")}
    if allow_for_gpus:
        env["FLEXIUM_ALLOW_SKIPS_FOR_GPUS"] = "1"
    return subprocess.run(
        [
            sys.executable,
            "-m",
            "pytest",
            "-q",
            "-p",
            "no:cacheprovider",
            "-o",
            "addopts=",
            "--rootdir",
            str(tmp_path),
            *(["-n", str(workers)] if workers else []),
            str(tmp_path),
        ],
        cwd=tmp_path,
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
    )


@pytest.mark.parametrize(
    "modules, allow_for_gpus, green",
    [
        pytest.param({"test_a.py": PASSES}, False, True, id="all-passed"),
        pytest.param({"test_a.py": PASSES, "test_b.py": MISSING_EXTRA}, False, False, id="module-skipped"),
        pytest.param({"test_a.py": PASSES, "test_b.py": MISSING_EXTRA}, True, False, id="module-skipped-not-for-gpus"),
        pytest.param({"test_a.py": PASSES, "test_b.py": MODULE_NEEDS_GPUS}, True, True, id="module-needs-gpus"),
        pytest.param(
            {"test_a.py": PASSES, "test_b.py": MODULE_NEEDS_GPUS}, False, False, id="module-needs-gpus-not-allowed"
        ),
        pytest.param({"test_a.py": PASSES, "test_b.py": TEST_NEEDS_GPUS}, True, True, id="test-needs-gpus"),
        pytest.param({"test_a.py": PASSES, "test_b.py": TEST_NEEDS_NOTHING_MORE}, True, False, id="gpus-were-there"),
        pytest.param({"test_b.py": TEST_NEEDS_GPUS, "test_c.py": MODULE_NEEDS_GPUS}, True, False, id="nothing-ran"),
    ],
)
def test_a_run_is_green_only_when_what_it_was_meant_to_run_passed(
    tmp_path: Path, modules: dict[str, str], allow_for_gpus: bool, green: bool
) -> None:
    done = _run(tmp_path, modules, allow_for_gpus=allow_for_gpus)
    assert (done.returncode == 0) == green, done.stdout + done.stderr
    if not green:
        assert "FAILED" in done.stdout, done.stdout


@pytest.mark.parametrize(
    "modules, green",
    [
        pytest.param({"test_a.py": PASSES, "test_b.py": PASSES, "test_c.py": PASSES}, True, id="all-passed"),
        pytest.param(
            {"test_a.py": PASSES, "test_b.py": PASSES, "test_c.py": MISSING_EXTRA}, False, id="module-skipped"
        ),
        pytest.param(
            {"test_a.py": PASSES, "test_b.py": PASSES, "test_c.py": TEST_NEEDS_GPUS}, False, id="test-skipped"
        ),
    ],
)
def test_spread_over_workers_a_skip_on_any_of_them_fails_the_run(
    tmp_path: Path, modules: dict[str, str], green: bool
) -> None:
    done = _run(tmp_path, modules, allow_for_gpus=False, workers=2)
    assert "bringing up nodes" in done.stdout, done.stdout + done.stderr  # xdist ran it
    assert (done.returncode == 0) == green, done.stdout + done.stderr
    if not green:
        assert "FAILED" in done.stdout and "test_c.py" in done.stdout, done.stdout


def test_the_failure_names_the_hidden_module(tmp_path: Path) -> None:
    done = _run(tmp_path, {"test_a.py": PASSES, "test_b.py": MISSING_EXTRA}, allow_for_gpus=False)
    assert "test_b.py" in done.stdout and "the server extra is not installed" in done.stdout, done.stdout
