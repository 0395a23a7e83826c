"""The GPU count that excuses the GPU tests' skips ("needs 2 GPUs, NVML sees 1") is checked before
any of them runs (tests/gpu/conftest.py, support/gpu.py's gpu_count_problem): flexium's own NVML
reading must agree with `nvidia-smi -L`, and with FLEXIUM_EXPECT_GPUS where the caller sets it. On
the CPU, with a fake nvidia-smi on PATH and the fake driver's NVML: the check itself, and real
pytest runs of tests/gpu that stop at once."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path

import pytest

from support.fake_driver import subprocess_env
from support.gpu import EXPECT_GPUS_ENV, gpu_count_problem

TESTS_DIR = Path(__file__).resolve().parents[1]
UUIDS = ["GPU-abd0dca1-a3be-0f47-9eb2-1a628cb5f856", "GPU-c77e9498-0c5b-4e5a-8a43-2d3a1e3f0b11"]


def fake_nvidia_smi(folder: Path, gpus: int, *, exit_code: int = 0) -> Path:
    """A folder holding an `nvidia-smi` that lists `gpus` GPUs for -L, as the real one prints
    them (a MIG device indented under its GPU)."""
    lines = [f"GPU {i}: NVIDIA H200 (UUID: {UUIDS[i % 2]}{i})" for i in range(gpus)]
    if gpus:
        lines.insert(1, "  MIG 1g.18gb     Device  0: (UUID: MIG-6e5a3f0c-1111-5d2a-9c3b-0a1b2c3d4e5f)")
    listing = "\n".join(lines)
    folder.mkdir(exist_ok=True)
    tool = folder / "nvidia-smi"
    tool.write_text(
        f'#!/bin/sh\n[ "$1" = "-L" ] || exit 2\ncat <<"EOF"\n{listing}\nEOF\n'
        f'[ {exit_code} -eq 0 ] || echo "NVIDIA-SMI has failed" >&2\nexit {exit_code}\n'
    )
    tool.chmod(0o755)
    return folder


@pytest.fixture
def on_path(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Callable[..., None]:
    def put(gpus: int, *, exit_code: int = 0) -> None:
        folder = fake_nvidia_smi(tmp_path / f"bin-{gpus}-{exit_code}", gpus, exit_code=exit_code)
        monkeypatch.setenv("PATH", f"{folder}{os.pathsep}{os.environ['PATH']}")

    monkeypatch.delenv(EXPECT_GPUS_ENV, raising=False)
    return put


def test_a_count_nvidia_smi_confirms_is_trusted(on_path: Callable[..., None], monkeypatch: pytest.MonkeyPatch) -> None:
    on_path(2)
    assert gpu_count_problem(2) is None
    monkeypatch.setenv(EXPECT_GPUS_ENV, "2")
    assert gpu_count_problem(2) is None


def test_a_count_nvidia_smi_contradicts_is_not(on_path: Callable[..., None]) -> None:
    on_path(2)
    assert gpu_count_problem(1) == "flexium's NVML reading sees 1 GPU(s), nvidia-smi -L lists 2"


def test_a_count_that_cannot_be_checked_is_not_trusted(
    on_path: Callable[..., None], monkeypatch: pytest.MonkeyPatch
) -> None:
    on_path(2, exit_code=9)
    problem = str(gpu_count_problem(2))
    assert problem.startswith("nvidia-smi -L failed (exit 9): NVIDIA-SMI has failed") and "(2)" in problem
    monkeypatch.setenv("PATH", "/nonexistent")
    assert str(gpu_count_problem(2)).startswith("nvidia-smi -L did not run (")


def test_the_expected_count_must_be_what_the_machine_shows(
    on_path: Callable[..., None], monkeypatch: pytest.MonkeyPatch
) -> None:
    on_path(2)
    monkeypatch.setenv(EXPECT_GPUS_ENV, "4")
    assert gpu_count_problem(2) == (
        "FLEXIUM_EXPECT_GPUS=4, but this machine shows 2 GPU(s) (NVML and nvidia-smi -L agree)"
    )
    monkeypatch.setenv(EXPECT_GPUS_ENV, "two")
    assert gpu_count_problem(2) == "FLEXIUM_EXPECT_GPUS='two' is not a number of GPUs"


def _gpu_tests(tmp_path: Path, *, nvml: int, listed: int, expect: str | None) -> subprocess.CompletedProcess[str]:
    """pytest on tests/gpu (every test deselected) with the fake driver's NVML seeing ``nvml`` GPUs
    and a fake nvidia-smi listing ``listed``."""
    env = subprocess_env(FAKE_CUDA_GPUS=nvml)
    env["PATH"] = f"{fake_nvidia_smi(tmp_path / 'bin', listed)}{os.pathsep}{env['PATH']}"
    env.pop(EXPECT_GPUS_ENV, None)
    if expect is not None:
        env[EXPECT_GPUS_ENV] = expect
    env["FLEXIUM_ALLOW_SKIPS_FOR_GPUS"] = "1"
    return subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-o", "addopts=", "-k", "no_test_is_named_so"]
        + [str(TESTS_DIR / "gpu")],
        cwd=TESTS_DIR.parent,
        env=env,
        capture_output=True,
        text=True,
        timeout=240,
    )


@pytest.mark.parametrize(
    "nvml, listed, expect, says",
    [
        pytest.param(1, 2, None, "flexium's NVML reading sees 1 GPU(s), nvidia-smi -L lists 2", id="nvml-undercounts"),
        pytest.param(2, 2, "4", "FLEXIUM_EXPECT_GPUS=4, but this machine shows 2 GPU(s)", id="fewer-than-expected"),
    ],
)
def test_a_gpu_run_with_an_untrusted_count_stops_before_any_test(
    tmp_path: Path, nvml: int, listed: int, expect: str | None, says: str
) -> None:
    done = _gpu_tests(tmp_path, nvml=nvml, listed=listed, expect=expect)
    output = done.stdout + done.stderr
    assert done.returncode == pytest.ExitCode.TESTS_FAILED, output
    assert f"the GPU tests do not start: {says}" in output, output


def test_a_gpu_run_with_a_trusted_count_goes_on_to_its_tests(tmp_path: Path) -> None:
    done = _gpu_tests(tmp_path, nvml=2, listed=2, expect="2")
    output = done.stdout + done.stderr
    assert "do not start" not in output and re.search(r"\d+ deselected", output), output
