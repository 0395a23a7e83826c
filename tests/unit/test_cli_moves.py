"""A command for one process followed until it ends, as `flexium migrate | pause | resume` print
it, which no end-to-end job on the CPU reaches: progress while it is under way (a line on stderr at
each change of state and every PROGRESS_EVERY_S while it stays the same; nothing with --json), and
the outcome as the process measured it; and a job operation's progress, rank by rank."""

from __future__ import annotations

import time
from typing import Any

import pytest

from flexium import simulated, wire
from flexium.cli import jobs, moves, waiting
from flexium.client import ServerError
from support.commands import command_info


class LongPolls:
    """Answers ``ApiClient.wait_command`` (GET /commands/{id}?wait=S) with the next scripted
    state; a repeated state is answered only after the whole wait, as the server does when
    nothing changes."""

    def __init__(self, states: list[str]) -> None:
        self.states = states
        self.waits: list[float] = []

    def wait_command(self, command_id: int, *, wait: float, **_: Any) -> wire.CommandInfo:
        assert command_id == 7
        self.waits.append(wait)
        state = self.states.pop(0)
        if state == "running" and self.states and self.states[0] == "running":
            time.sleep(wait)
        return command(state)


def command(state: str) -> wire.CommandInfo:
    return command_info(7, "pause", "gpu-1a2b3c4d", state)


def test_each_change_and_every_interval_between_are_said(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    monkeypatch.setattr(waiting, "PROGRESS_EVERY_S", 0.3)
    polls = LongPolls(["delivered", "running", "running", "running", "succeeded"])
    queued = command("queued")
    title = "pause gpu-1a2b3c4d"
    final = waiting.wait_command(polls, queued, 30.0, progress=waiting.command_progress(title, queued))  # type: ignore[arg-type]
    assert final.state == "succeeded"
    lines = capsys.readouterr().err.splitlines()
    said = [line.split("command 7 ")[1].split()[0].rstrip(";") for line in lines]
    assert said[:3] == ["queued", "delivered", "running"], lines
    assert "next optimizer step" in lines[2] and lines[2].endswith(" s)")
    # The running state lasted two long-polls of 0.3 s: said again once in between, not at each poll.
    assert said[3:] == ["running"], lines
    assert all(line.startswith("pause gpu-1a2b3c4d: command 7 ") for line in lines)
    assert max(polls.waits) <= 0.3


def test_without_progress_the_wait_is_one_long_poll(capsys: pytest.CaptureFixture[str]) -> None:
    polls = LongPolls(["succeeded"])
    final = waiting.wait_command(polls, command("queued"), 30.0)  # type: ignore[arg-type]
    assert final.state == "succeeded" and polls.waits == [30.0]
    assert capsys.readouterr().err == ""


def test_a_job_operation_says_each_rank_at_each_change(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    monkeypatch.setattr(waiting, "PROGRESS_EVERY_S", 60.0)

    def operation(*states: str) -> wire.JobOperationInfo:
        ranks = [
            command(state).model_copy(
                update={
                    "job": wire.JobCommandInfo(operation_id=3, job_key="run-7f3a", rank=rank, world_size=2, moves={})
                }
            )
            for rank, state in enumerate(states)
        ]
        return wire.JobOperationInfo(
            id=3,
            job_key="run-7f3a",
            kind="pause",
            world_size=2,
            moves={},
            created_at=0.0,
            state="running",
            finished_at=None,
            commands=ranks,
        )

    show = waiting.job_progress("pause job run-7f3a (2 ranks)")
    for states in (("queued", "queued"), ("running", "queued"), ("running", "queued"), ("running", "running")):
        show(operation(*states))
    assert capsys.readouterr().err.splitlines() == [
        "pause job run-7f3a (2 ranks): rank 0 queued, rank 1 queued (0 s)",
        "pause job run-7f3a (2 ranks): rank 0 running, rank 1 queued (0 s)",
        "pause job run-7f3a (2 ranks): rank 0 running, rank 1 running (0 s)",
    ]


class NoProcess:
    def get_process(self, process_id: str) -> wire.ProcessInfo:
        raise ServerError("gone", code="not_found")


def test_the_outcome_shows_the_operation_as_the_process_measured_it(capsys: pytest.CaptureFixture[str]) -> None:
    done = command("succeeded").model_copy(
        update={
            "started_at": 0.5,
            "finished_at": 1.0,
            "result": wire.OperationReport(
                kind="pause",
                path="fast",
                ok=True,
                steps=[
                    wire.StepReport(step="copy", seconds=0.25),
                    wire.StepReport(step="restore", seconds=0.001, ok=False),
                    wire.StepReport(step="rollback_copy", seconds=9.0, rollback=True),
                ],
                bytes_moved=2 * 10**9,
                seconds=0.5,
                notes=["driver path: not this time"],
            ),
        }
    )
    moves._print_outcome(NoProcess(), "pause gpu-1a2b3c4d", done)  # type: ignore[arg-type]
    out = capsys.readouterr().out
    line = "  operation 500 ms, fast path, phases (copy 250 ms, restore 1.0 ms FAILED); 1.9 GiB moved, 4.0 GB/s\n"
    assert line in out
    assert "  note: driver path: not this time\n" in out and "rollback_copy" not in out


class SimulatedProcess:
    def get_process(self, process_id: str) -> wire.ProcessInfo:
        return wire.ProcessInfo.model_validate(
            {
                "process_id": process_id,
                "host": "demo",
                "user": "ann",
                "pid": 4242,
                "state": "RUNNING",
                "reported_state": "RUNNING",
                "stale": False,
                "gpu_uuid": "GPU-bbbb",
                "gpu_model": simulated.SIMULATED_MODEL,
                "gpu_index": 1,
                "logical_device": "cuda:0",
                "physical_device": "cuda:1",
                "visible_gpus": ["GPU-aaaa", "GPU-bbbb"],
                "torch_version": "2.13.0",
                "driver_version": simulated.SIMULATED_DRIVER,
                "flexium_version": "0.4.0",
                "capabilities": {"pause_resume": True, "migration": True},
                "memory_bytes": simulated.JOB_BYTES,
                "footprint_bytes": 0,
                "started_at": 0.0,
                "registered_at": 0.0,
                "last_seen": 1.0,
                "cmdline": "python -m flexium.cli.demo_job",
                "active_command": None,
            }
        )


def test_an_outcome_on_simulated_gpus_says_so_and_gives_no_rate(capsys: pytest.CaptureFixture[str]) -> None:
    done = command("succeeded").model_copy(
        update={
            "kind": "migrate",
            "started_at": 0.5,
            "finished_at": 1.0,
            "result": wire.OperationReport(
                kind="migrate",
                path="driver",
                ok=True,
                steps=[wire.StepReport(step="checkpoint", seconds=0.0004)],
                bytes_moved=simulated.JOB_BYTES,
                seconds=0.0009,
            ),
        }
    )
    moves._print_outcome(SimulatedProcess(), "migrate gpu-1a2b3c4d to cuda:1", done)  # type: ignore[arg-type]
    out = capsys.readouterr().out
    assert out.startswith("migrate gpu-1a2b3c4d to cuda:1: succeeded in 1.00 s on simulated GPUs\n"), out
    assert (
        "  simulated operation 0.9 ms, driver path, phases (checkpoint 0.4 ms); 6.0 GiB of simulated memory moved\n"
        in out
    )
    assert "GB/s" not in out and "the process is RUNNING on cuda:1" in out


def test_a_job_operation_on_simulated_gpus_says_so(capsys: pytest.CaptureFixture[str]) -> None:
    class Listing(SimulatedProcess):
        def list_processes(self, state: str | None = None) -> list[wire.ProcessInfo]:
            return [self.get_process("gpu-rank0000")]

    rank_command = command("succeeded").model_copy(
        update={
            "process_id": "gpu-rank0000",
            "job": wire.JobCommandInfo(operation_id=3, job_key="run-7f3a", rank=0, world_size=1, moves={}),
            "result": wire.OperationReport(kind="pause", path="driver", ok=True, seconds=0.5),
        }
    )
    operation = wire.JobOperationInfo(
        id=3,
        job_key="run-7f3a",
        kind="pause",
        world_size=1,
        moves={},
        created_at=0.0,
        state="succeeded",
        finished_at=1.0,
        commands=[rank_command],
    )
    api = Listing()
    jobs._print_job_outcome(api, jobs._job_title(api, operation), operation)  # type: ignore[arg-type]
    out = capsys.readouterr().out
    assert out.startswith("pause job run-7f3a (1 rank): succeeded in 1.00 s on simulated GPUs (job operation 3)\n")
    assert "500 ms simulated" in out, out
