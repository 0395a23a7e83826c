"""GPU tests: run by ci/gpu-tests.sh on a machine with 1+ NVIDIA GPUs. Tests that move a job to
another GPU (or fill GPU 1) request the `two_gpus` fixture (those among four GPUs `four_gpus`)
and are skipped, reported as not run, where NVML sees fewer. Every job runs in a fresh process
(checkpoint state is process-wide): the training jobs of bench/jobs/ (run_job, torchrun_jobs.py),
and a test's own checks through fresh_process.run_in_fresh_process; this pytest process only
reads NVML."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Iterable, Iterator, Optional

import pytest

from fresh_process import keep_log

HERE = Path(__file__).parent
# The jobs the benchmark runs too: the training job, the torchrun ranks', another process filling a GPU.
JOBS = HERE.resolve().parents[1] / "bench" / "jobs"
TRAIN_JOB = JOBS / "train_job.py"
RANK_JOB = JOBS / "rank_job.py"
FILL_GPU = JOBS / "fill_gpu.py"
GIB = 1 << 30
# Memory a GPU may show beyond its idle reading once the job has left it (driver bookkeeping).
RESIDUE_SLACK = 64 << 20


def uuid_of(host_gpus: list[Any], index: int) -> str:
    return next(gpu.uuid for gpu in host_gpus if gpu.index == index)


def assert_left(op: dict[str, Any], uuid: str, idle: dict[str, int]) -> None:
    """After `op` the job holds nothing on `uuid`, which is back to its idle reading."""
    reading = op["nvml"][uuid]
    assert reading["ours"] == 0, f"after {op['op']} the job still holds {reading['ours']} bytes on {uuid}"
    assert reading["used"] <= idle[uuid] + RESIDUE_SLACK, (
        f"after {op['op']} {uuid} shows {reading['used'] >> 20} MiB used, idle was {idle[uuid] >> 20} MiB"
    )


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    for item in items:
        item.add_marker(pytest.mark.gpu)


@dataclass
class JobRun:
    returncode: int
    events: list[dict[str, Any]]
    stderr: str
    ops: list[dict[str, Any]] = field(default_factory=list)

    def one(self, name: str) -> dict[str, Any]:
        found = [e for e in self.events if e["event"] == name]
        assert found, f"job printed no '{name}' event; stderr tail:\n{self.stderr[-3000:]}"
        return found[-1]


def run_job(*args: str, env: Optional[dict[str, str]] = None, timeout: float = 480) -> JobRun:
    """Runs the training job (bench/jobs/train_job.py) in a fresh process."""
    full_env = {**os.environ, "PYTHONUNBUFFERED": "1", **(env or {})}
    proc = subprocess.run(
        [sys.executable, str(TRAIN_JOB), *args],
        capture_output=True,
        text=True,
        timeout=timeout,
        env=full_env,
    )
    events = job_events(proc.stdout.splitlines())
    run = JobRun(proc.returncode, events, proc.stderr, [e for e in events if e["event"] == "op"])
    keep_log(args, env, proc.returncode, proc.stdout, proc.stderr)
    return run


def nccl_with_suspend() -> str:
    """The libnccl.so.2 with ncclCommSuspend (NCCL 2.29.7+) that jobs of several processes preload:
    torch 2.11's own NCCL 2.28.9 has none."""
    path = os.environ.get("FLEXIUM_TEST_NCCL_LIB", "")
    if not os.path.exists(path):
        pytest.fail(
            "FLEXIUM_TEST_NCCL_LIB does not name a libnccl.so.2 with ncclCommSuspend (NCCL 2.29.7+): run through "
            "ci/gpu-tests.sh with FLEXIUM_NCCL_LIB naming one (ci/build-nccl.sh) or FLEXIUM_NCCL_SOURCE its "
            "source tarball"
        )
    return path


def job_events(lines: Iterable[str]) -> list[dict[str, Any]]:
    """A job's JSON event lines, parsed; other output is skipped (a framework may print dicts of
    its own)."""
    return [json.loads(line) for line in lines if line.startswith('{"event"')]


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


def need_gpus(host_gpus: list[Any], count: int) -> list[Any]:
    """The host's GPUs; the test is skipped (not run, never passed: listed as such, see
    tests/conftest.py) where NVML sees fewer than ``count``."""
    if len(host_gpus) < count:
        pytest.skip(f"needs {count} GPUs, NVML sees {len(host_gpus)}")
    return host_gpus


@pytest.fixture
def two_gpus(host_gpus: list[Any]) -> list[Any]:
    """For tests that move a job to another GPU."""
    return need_gpus(host_gpus, 2)


@pytest.fixture
def four_gpus(host_gpus: list[Any]) -> list[Any]:
    """For tests that move the ranks of a job among four GPUs."""
    return need_gpus(host_gpus, 4)
