"""GPU tests: run by ci/gpu-tests.sh on a machine with 1+ NVIDIA GPUs. Tests that move a job to
another GPU (or fill GPU 1) request the `two_gpus` fixture (those among four GPUs `four_gpus`)
and are skipped, reported as not run, where NVML sees fewer; NVML's count must agree with
`nvidia-smi -L`, and with FLEXIUM_EXPECT_GPUS where that is set, or no test runs. Every job runs
in a fresh process (checkpoint state is process-wide): the training jobs of bench/jobs/
(support/gpu.py's run_job, support/torchrun.py), and a test's own checks through
support/fresh_process.py's run_in_fresh_process; this pytest process only reads NVML. The
fixtures are here; what the tests share besides is in tests/support/gpu.py."""

from __future__ import annotations

import json
import subprocess
import sys
from collections.abc import Iterator
from typing import Any

import pytest

from support.gpu import FILL_GPU, gpu_count_problem, need_gpus


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    for item in items:
        item.add_marker(pytest.mark.gpu)
    if config.option.collectonly:
        return
    from flexium.engine import nvml

    problem = gpu_count_problem(len(nvml.host_gpus()))
    if problem is not None:  # before any test runs: a wrong count would excuse skips or fail every test
        pytest.exit(f"the GPU tests do not start: {problem}", returncode=pytest.ExitCode.TESTS_FAILED)


@pytest.fixture
def gpu_filler() -> Iterator[Any]:
    procs: list[subprocess.Popen[str]] = []

    def fill(index: int, leave_free_gib: float) -> dict[str, Any]:
        proc = subprocess.Popen(
            [sys.executable, str(FILL_GPU), str(index), str(leave_free_gib)],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            text=True,
        )
        procs.append(proc)
        assert proc.stdout is not None
        return json.loads(proc.stdout.readline())

    yield fill
    for proc in procs:
        assert proc.stdin is not None
        proc.stdin.close()
        proc.wait(timeout=60)


@pytest.fixture(scope="session")
def host_gpus() -> list[Any]:
    from flexium.engine import nvml

    gpus = nvml.host_gpus()
    assert len(gpus) >= 1, f"the GPU tests need a GPU, NVML sees {len(gpus)}"
    return gpus


@pytest.fixture
def two_gpus(host_gpus: list[Any]) -> list[Any]:
    """For tests that move a job to another GPU."""
    return need_gpus(host_gpus, 2)


@pytest.fixture
def four_gpus(host_gpus: list[Any]) -> list[Any]:
    """For tests that move the ranks of a job among four GPUs."""
    return need_gpus(host_gpus, 4)
