"""ddp_job.py under torchrun for the GPU tests of distributed jobs: run it (its ranks' events
parsed), check the operations its control thread ran (--plan), and where each rank held memory
after each; and the same job attached to a real server and moved by the `flexium` command."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
from typing import Any, Callable, Optional, TypeVar

import pytest

from conftest import HERE, _keep_log

T = TypeVar("T")


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
    return [*command, str(HERE / "ddp_job.py"), *args]


def torchrun(
    *args: str, nccl: Optional[str], env: Optional[dict[str, str]] = None, timeout: float = 420, ranks: int = 2
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
        ended = _end_group(proc, lambda seconds: proc.communicate(timeout=seconds))
        stdout, stderr = ended if ended is not None else proc.communicate()
    described = ("ddp_job.py", f"{ranks} ranks", *args)
    _keep_log(described, {"LD_PRELOAD": nccl or "", **(env or {})}, proc.returncode, stdout, stderr)
    if hung:
        pytest.fail(f"the job did not end within {timeout:g} s ({' '.join(described)}): {stderr[-3000:]}")
    events = [json.loads(line) for line in stdout.splitlines() if line.startswith("{")]
    return TorchrunJob(proc.returncode, events, stderr, ranks)


def _end_group(proc: subprocess.Popen[str], settle: Callable[[float], T]) -> Optional[T]:
    """Ends a job started in its own process group, torchrun and every rank: SIGABRT first (with
    PYTHONFAULTHANDLER each rank writes its stacks), SIGKILL if ``settle`` (which waits for it,
    draining its output) times out after 20 s. ``settle``'s result; None if it was killed."""
    try:
        os.killpg(proc.pid, signal.SIGABRT)
        try:
            return settle(20)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
    except ProcessLookupError:  # every process of the group has ended already
        pass
    return None


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


def check_placements(job: TorchrunJob, uuids: list[str], expected: dict[int, list[Optional[int]]]) -> None:
    """After each operation every rank held memory on the one GPU ``expected`` says (an index of
    ``uuids``, NVML's order), or on none (None: paused), and on no GPU it left."""
    for rank, where in expected.items():
        ops = job.of(rank, "op")
        assert len(ops) == len(where), ops
        for op, index in zip(ops, where, strict=True):
            assert held_on(op) == ([] if index is None else [uuids[index]]), (rank, op["kind"], op["held"])


class ServedJob:
    """ddp_job.py under torchrun attached to a real server (its own, in ``tmp``), moved by the
    `flexium` command; ``finish`` compares every rank's loss trace with ``reference``'s.
    A context manager: the job and the server end with it."""

    def __init__(
        self, tmp: Any, ranks: int, job_args: tuple[str, ...], *, env: dict[str, str], nccl: Optional[str]
    ) -> None:
        from live_server import ProcessOutput, ServerProcess, clean_env

        self.world = ranks
        self.server = ServerProcess(tmp / "server").start()
        home = tmp / "home"
        home.mkdir()
        base = clean_env(home)
        base.update(env, FLEXIUM_SERVER=f"127.0.0.1:{self.server.port}/default", FLEXIUM_TOKEN=self.server.token or "")
        base.pop("LD_PRELOAD", None)
        self.cli_env = dict(base)
        job_env = {**base, "FLEXIUM_TOKEN": self.server.issue_job_token()}
        if nccl:
            job_env["LD_PRELOAD"] = nccl
        self.job = subprocess.Popen(
            torchrun_argv(ranks, *job_args),
            env=job_env,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
            start_new_session=True,  # as torchrun(): a job that fails a test ends with every rank
        )
        self.output = ProcessOutput(self.job)

    def __enter__(self) -> "ServedJob":
        from live_server import wait_until

        try:
            for rank in range(self.world):
                self.output.wait_for(rf'^\{{"event": "ready", "rank": {rank}', 180)
            found = wait_until(self._movable, 120, f"{self.world} ranks registered as movable with their job")
        except BaseException:
            self.__exit__()  # a job that never became movable ends too: __exit__ only follows a return
            raise
        self.rank0 = found[0]["process_id"]
        self.pids = [p["pid"] for p in found]
        return self

    def __exit__(self, *exc: object) -> None:
        if self.job.poll() is None:
            _end_group(self.job, lambda seconds: self.job.wait(timeout=seconds))
            self.job.wait()
        self.server.stop()

    def cli(self, *args: str) -> subprocess.CompletedProcess[str]:
        from live_server import flexium_command

        return subprocess.run(
            [*flexium_command(), *args], env=self.cli_env, capture_output=True, text=True, timeout=300
        )

    def ranks(self) -> list[dict[str, Any]]:
        done = self.cli("ps", "--json")
        assert done.returncode == 0, done.stderr
        return sorted((p for p in json.loads(done.stdout) if p.get("job")), key=lambda p: p["job"]["rank"])

    def _movable(self) -> Optional[list[dict[str, Any]]]:
        found = self.ranks()
        ok = len(found) == self.world and all(p["capabilities"].get("job_operations") for p in found)
        return found if ok else None

    def command(self, *args: str) -> dict[str, Any]:
        """``flexium ARGS --json``: one job operation, succeeded on every rank."""
        done = self.cli(*args, "--json")
        assert done.returncode == 0, (
            f"flexium {' '.join(args)}: {done.stdout}\n{done.stderr}\n{self.output.text[-4000:]}"
        )
        operation = json.loads(done.stdout)
        assert operation["state"] == "succeeded" and len(operation["commands"]) == self.world, operation
        return operation

    def held(self) -> list[list[str]]:
        """The GPUs (UUIDs) each rank holds memory on now, by NVML, in rank order."""
        from flexium.engine import nvml

        gpus = nvml.host_gpus()
        return [sorted(gpu.uuid for gpu in gpus if (gpu.used_by(pid) or 0) > 0) for pid in self.pids]

    def finish(self, reference: TorchrunJob, steps: int) -> None:
        """The job trained its ``steps`` to the end, every rank bit-identical to ``reference``."""
        assert self.job.wait(timeout=300) == 0, self.output.text[-4000:]
        lines = [json.loads(line) for line in self.output.lines if line.startswith('{"event": "step"')]
        for rank in range(self.world):
            trace = [e["loss"] for e in lines if e["rank"] == rank]
            assert len(trace) == steps and trace == reference.losses(rank)[:steps], f"rank {rank} differs"
