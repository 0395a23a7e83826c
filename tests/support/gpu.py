"""What the GPU tests (tests/gpu) share: the training job of bench/jobs/ run in a fresh process and
its events (run_job, reference), the host's GPUs as NVML reads them (their count checked against
nvidia-smi and FLEXIUM_EXPECT_GPUS), and the NCCL that jobs of several processes preload. Fixtures
(host_gpus, two_gpus, four_gpus, gpu_filler) are in tests/gpu/conftest.py."""

from __future__ import annotations

import functools
import json
import os
import subprocess
import sys
import time
from collections.abc import Iterable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest

from support.fresh_process import keep_log

# The jobs the benchmark runs too: the training job, the torchrun ranks', another process filling a GPU.
JOBS = Path(__file__).resolve().parents[2] / "bench" / "jobs"
TRAIN_JOB = JOBS / "train_job.py"
RANK_JOB = JOBS / "rank_job.py"
FILL_GPU = JOBS / "fill_gpu.py"
# A job written with one framework (the GPU tests' own).
FRAMEWORK_JOB = Path(__file__).resolve().parent / "jobs" / "framework_job.py"
GIB = 1 << 30
# Memory a GPU may show beyond its idle reading once the job has left it (driver bookkeeping).
RESIDUE_SLACK = 64 << 20
JOB_TIMEOUT = 360  # past train_job.py's own hang dump (300 s), which then lands in the log
# The number of GPUs the caller expects the machine to show (ci/gpu-tests.sh passes it through).
EXPECT_GPUS_ENV = "FLEXIUM_EXPECT_GPUS"


def uuid_of(host_gpus: list[Any], index: int) -> str:
    return next(gpu.uuid for gpu in host_gpus if gpu.index == index)


def idle_used() -> dict[str, int]:
    """Each GPU's used memory now, with no job of ours running."""
    from flexium.engine import nvml

    return {gpu.uuid: gpu.memory_used for gpu in nvml.host_gpus()}


def assert_left(op: dict[str, Any], uuid: str, idle: dict[str, int]) -> None:
    """After `op` the job holds nothing on `uuid`, which is back to its idle reading."""
    reading = op["nvml"][uuid]
    assert reading["ours"] == 0, f"after {op['op']} the job still holds {reading['ours']} bytes on {uuid}"
    assert reading["used"] <= idle[uuid] + RESIDUE_SLACK, (
        f"after {op['op']} {uuid} shows {reading['used'] >> 20} MiB used, idle was {idle[uuid] >> 20} MiB"
    )


def beyond_idle(idle: dict[str, int], occupied: Iterable[str]) -> dict[str, int]:
    """The GPUs outside ``occupied`` that show more memory used now than at their idle reading, by
    NVML: UUID -> MiB used."""
    from flexium.engine import nvml

    taken = set(occupied)
    return {
        gpu.uuid: gpu.memory_used >> 20
        for gpu in nvml.host_gpus()
        if gpu.uuid not in taken and gpu.memory_used > idle[gpu.uuid] + RESIDUE_SLACK
    }


def assert_back_to_idle(idle: dict[str, int], occupied: Iterable[str], after: str, within_s: float = 10.0) -> None:
    """Within ``within_s`` of ``after``, every GPU outside ``occupied`` (the GPUs a job is on) is
    back to its idle reading: nothing left where the job was (a copier's context, NCCL's buffers, a
    process's memory)."""
    deadline = time.monotonic() + within_s
    while (left := beyond_idle(idle, occupied)) and time.monotonic() < deadline:
        time.sleep(0.5)
    idle_mib = {uuid: idle[uuid] >> 20 for uuid in left}
    assert not left, f"after {after} GPUs the job is not on show MiB used {left}, idle {idle_mib}"


def torch_nccl_version() -> str:
    """The NCCL torch ships, as flexium names it ("2.28.9" in torch 2.11), read by torch in a fresh
    process: this one only reads NVML."""
    code = "import torch; print('.'.join(map(str, torch.cuda.nccl.version()[:3])))"
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr[-2000:]
    return done.stdout.strip()


def listed_by_nvidia_smi() -> int | str:
    """The GPUs `nvidia-smi -L` lists (a "GPU N: ..." line each; a MIG device's line is indented), or
    why it could not tell."""
    try:
        done = subprocess.run(["nvidia-smi", "-L"], capture_output=True, text=True, timeout=60)
    except (OSError, subprocess.TimeoutExpired) as exc:
        return f"nvidia-smi -L did not run ({exc})"
    if done.returncode != 0:
        return f"nvidia-smi -L failed (exit {done.returncode}): {(done.stderr or done.stdout).strip()[-300:]}"
    return sum(1 for line in done.stdout.splitlines() if line.startswith("GPU "))


def gpu_count_problem(nvml_count: int) -> str | None:
    """Why the count of GPUs that excuses skipped tests ("needs 2 GPUs, NVML sees 1") cannot be
    trusted, or None. It comes from flexium's own NVML reading (engine/nvml.py), code under test: a
    regression that under-counted would turn every test that needs more GPUs into an excused skip.
    So nvidia-smi must list as many, and FLEXIUM_EXPECT_GPUS, where the caller sets it, must name
    that count."""
    listed = listed_by_nvidia_smi()
    if isinstance(listed, str):
        return f"{listed}: the GPU count NVML gives ({nvml_count}) cannot be checked against it"
    if listed != nvml_count:
        return f"flexium's NVML reading sees {nvml_count} GPU(s), nvidia-smi -L lists {listed}"
    expected = os.environ.get(EXPECT_GPUS_ENV, "")
    if expected and not expected.isdigit():
        return f"{EXPECT_GPUS_ENV}={expected!r} is not a number of GPUs"
    if expected and int(expected) != listed:
        return f"{EXPECT_GPUS_ENV}={expected}, but this machine shows {listed} GPU(s) (NVML and nvidia-smi -L agree)"
    return None


def need_gpus(host_gpus: list[Any], count: int) -> list[Any]:
    """The host's GPUs; the test is skipped (not run, never passed: listed as such, see
    tests/conftest.py) where NVML sees fewer than ``count``."""
    if len(host_gpus) < count:
        pytest.skip(f"needs {count} GPUs, NVML sees {len(host_gpus)}")
    return host_gpus


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


def run_job(*args: str, env: dict[str, str] | None = None, timeout: float = 480) -> JobRun:
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


def ok_run(run: JobRun) -> JobRun:
    assert run.returncode == 0, f"exit {run.returncode}; stderr tail:\n{run.stderr[-3000:]}"
    return run


@functools.cache
def reference(*args: str) -> tuple[str, ...]:
    """The loss trace of an undisturbed run with these flags (one run per flag set per session)."""
    run = ok_run(run_job(*args, timeout=JOB_TIMEOUT))
    assert run.one("ready")["pool_active"] is True, run.one("ready")["pool_reason"]
    return tuple(run.one("done")["losses"])


def summary(ops: list[dict[str, Any]]) -> str:
    """What went wrong, short: each op's outcome, path, notes and error."""
    lines = []
    for op in ops:
        result = op.get("result") or {}
        lines.append(
            f"{op['op']} {op.get('target')}: ok={op['ok']} path={op.get('path', result.get('path'))} "
            f"requested={op.get('requested_path')} notes={result.get('notes')} "
            f"error={op.get('error_type')}: {op.get('error') or result.get('error')}"
        )
    return "\n".join(lines)


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
