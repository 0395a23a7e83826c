"""bench/jobs/rank_job.py under torchrun for the GPU tests of distributed jobs: run it (its ranks' events
parsed), check the operations its control thread ran (--plan), and where each rank held memory
after each; and whether the same job attached to a server (served_job.py) trained as an undisturbed
run did."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from typing import Any

import pytest

from support.fresh_process import end_process_group, keep_log
from support.gpu import RANK_JOB, RESIDUE_SLACK


class TorchrunJob:
    def __init__(self, returncode: int, events: list[dict[str, Any]], stderr: str, world: int) -> None:
        self.returncode = returncode
        self.events = events
        self.stderr = stderr
        self.world = world

    def of(self, rank: int, event: str) -> list[dict[str, Any]]:
        return [e for e in self.events if e["rank"] == rank and e["event"] == event]

    def losses(self, rank: int) -> list[str]:
        return [e["loss"] for e in self.of(rank, "step")]


def torchrun_argv(ranks: int, *args: str) -> list[str]:
    command = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", str(ranks)]
    return [*command, str(RANK_JOB), *args]


def torchrun(
    *args: str, nccl: str | None, env: dict[str, str] | None = None, timeout: float = 420, ranks: int = 2
) -> TorchrunJob:
    full_env = {**os.environ, "PYTHONUNBUFFERED": "1", **(env or {})}
    full_env.pop("LD_PRELOAD", None)
    if nccl is not None:
        full_env["LD_PRELOAD"] = nccl
    proc = subprocess.Popen(
        torchrun_argv(ranks, *args),
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env=full_env,
        start_new_session=True,  # its own process group: a hung job's ranks are killed with torchrun
    )
    hung = False
    try:
        stdout, stderr = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        hung = True
        ended = end_process_group(proc, lambda seconds: proc.communicate(timeout=seconds))
        stdout, stderr = ended if ended is not None else proc.communicate()
    described = ("rank_job.py", f"{ranks} ranks", *args)
    keep_log(described, {"LD_PRELOAD": nccl or "", **(env or {})}, proc.returncode, stdout, stderr)
    if hung:
        pytest.fail(f"the job did not end within {timeout:g} s ({' '.join(described)}): {stderr[-3000:]}")
    events = [json.loads(line) for line in stdout.splitlines() if line.startswith('{"event"')]
    return TorchrunJob(proc.returncode, events, stderr, ranks)


def check_ops(job: TorchrunJob, kinds: list[str]) -> None:
    """Every rank ran these operations, all succeeded, and its ballast came through intact."""
    assert job.returncode == 0, job.stderr[-4000:]
    for rank in range(job.world):
        ops = job.of(rank, "op")
        assert [op["kind"] for op in ops] == kinds, ops
        failed = [op for op in ops if not op["ok"]]
        assert not failed, failed
        done = job.of(rank, "done")[0]
        assert done["ballast_intact"]


def steps_at_ops(job: TorchrunJob) -> list[tuple[int, ...]]:
    """Each rank's stop steps, of the operations that stop the job at one (pause, migrate)."""
    stops = [
        tuple(op["stopped_at"] for op in job.of(rank, "op") if op["kind"] != "resume") for rank in range(job.world)
    ]
    assert all(step is not None for ranks in stops for step in ranks), stops
    return stops


def held_on(op: dict[str, Any]) -> list[str]:
    """The GPUs (UUIDs) a rank held memory on after an operation, by NVML."""
    return sorted(uuid for uuid, held in op["held"].items() if held > 0)


def check_placements(job: TorchrunJob, uuids: list[str], expected: dict[int, list[int | None]]) -> None:
    """After each operation every rank held memory on the one GPU ``expected`` says (an index of
    ``uuids``, NVML's order), or on none (None: paused), and on no GPU it left."""
    for rank, where in expected.items():
        ops = job.of(rank, "op")
        assert len(ops) == len(where), ops
        for op, index in zip(ops, where, strict=True):
            assert held_on(op) == ([] if index is None else [uuids[index]]), (rank, op["kind"], op["held"])


def check_left_idle(
    job: TorchrunJob, uuids: list[str], expected: dict[int, list[int | None]], idle: dict[str, int]
) -> None:
    """After each operation every GPU no rank is on (``expected``, as check_placements reads it)
    shows its idle reading in every rank's NVML reading, a pause's taken while paused: nothing left
    where a rank was (a copier's context, NCCL's buffers, its memory)."""
    for rank in range(job.world):
        paused = iter(job.of(rank, "paused"))
        for index, op in enumerate(job.of(rank, "op")):
            occupied = {uuids[where[index]] for where in expected.values() if where[index] is not None}
            reading = next(paused) if op["kind"] == "pause" else op
            left = {
                uuid: reading["used"][uuid] >> 20
                for uuid in uuids
                if uuid not in occupied and reading["used"][uuid] > idle[uuid] + RESIDUE_SLACK
            }
            assert not left, f"rank {rank} after {op['kind']} #{index + 1}: MiB used where no rank is: {left}"


def check_traces(events: list[dict[str, Any]], reference: TorchrunJob, steps: int) -> None:
    """Every rank of a job (its printed ``events``) trained its ``steps``, each loss bit-identical
    to ``reference``'s."""
    for rank in range(reference.world):
        trace = [e["loss"] for e in events if e["event"] == "step" and e["rank"] == rank]
        assert len(trace) == steps and trace == reference.losses(rank)[:steps], f"rank {rank} differs"
