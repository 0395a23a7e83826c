"""GPU tests: run by ci/gpu-tests.sh on a machine with 1+ NVIDIA GPUs. Tests that move a job to
another GPU (or fill GPU 1) request the `two_gpus` fixture (those among four GPUs `four_gpus`)
and are skipped, reported as not run, where NVML sees fewer. Every job runs in a fresh process (checkpoint state is
process-wide); this pytest process only reads NVML."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Iterable, Iterator, Optional, TypeVar

import pytest

HERE = Path(__file__).parent
GIB = 1 << 30
# Memory a GPU may show beyond its idle reading once the job has left it (driver bookkeeping).
RESIDUE_SLACK = 64 << 20
T = TypeVar("T")


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


def run_job(
    *args: str, env: Optional[dict[str, str]] = None, timeout: float = 480, script: str = "train_job.py"
) -> JobRun:
    """Runs tests/gpu/<script> (train_job.py unless named) in a fresh process."""
    full_env = {**os.environ, "PYTHONUNBUFFERED": "1", **(env or {})}
    proc = subprocess.run(
        [sys.executable, str(HERE / script), *args],
        capture_output=True,
        text=True,
        timeout=timeout,
        env=full_env,
    )
    events = job_events(proc.stdout.splitlines())
    run = JobRun(proc.returncode, events, proc.stderr, [e for e in events if e["event"] == "op"])
    _keep_log((script, *args) if script != "train_job.py" else args, env, proc.returncode, proc.stdout, proc.stderr)
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


def _keep_log(args: tuple[str, ...], env: Optional[dict[str, str]], code: int, stdout: str, stderr: str) -> None:
    """Every job's output, appended to one file in $OUT, survives a run that is cut short."""
    folder = Path(os.environ.get("OUT") or HERE.parent.parent / "gpu-results")
    folder.mkdir(parents=True, exist_ok=True)
    with open(folder / "jobs.log", "a") as log:
        log.write(
            f"\n===== job {' '.join(args)} env={env or {}} exit={code}\n{stdout}\n----- stderr\n{stderr[-40000:]}\n"
        )


def end_process_group(proc: subprocess.Popen[str], settle: Callable[[float], T]) -> Optional[T]:
    """Ends a job started in its own process group (``start_new_session``), its launcher and every
    process: SIGABRT first (with PYTHONFAULTHANDLER each writes its Python stacks), SIGKILL if
    ``settle`` (which waits for it, draining its output) times out after 20 s. ``settle``'s result;
    None if it was killed."""
    try:
        os.killpg(proc.pid, signal.SIGABRT)
        try:
            return settle(20)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
    except ProcessLookupError:  # every process of the group has ended already
        pass
    return None


@pytest.fixture
def gpu_filler() -> Iterator[Any]:
    procs: list[subprocess.Popen[str]] = []

    def fill(index: int, leave_free_gib: float) -> dict[str, Any]:
        proc = subprocess.Popen(
            [sys.executable, str(HERE / "fill_gpu.py"), str(index), str(leave_free_gib)],
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
