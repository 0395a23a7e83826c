"""The whole-job protocol (engine/distributed/job_operation.py, rendezvous.py) between two ranks on threads over
one store, with the engine's part of each rank stood in for: every rank ends in the same state, and NCCL comes back
on every rank that does not stay paused, when one rank's part is slower than another waits for it (a stage is met
or given up once, for every rank) and when one rank's part raises instead of answering."""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from typing import Any

import pytest

from flexium.engine.distributed import job_operation
from flexium.engine.distributed.job_operation import Deadlines, JobOperation, RankActions
from flexium.engine.distributed.rendezvous import OK, Rendezvous
from flexium.engine.operations import GpuIdentity, OperationKind, OperationResult
from flexium.errors import OperationFailedError
from support.engine import DictStore

GPU = GpuIdentity(0, "GPU-a", "fake", 1 << 30, "0000:00:00.0", 0)
DEADLINES = Deadlines(agree_s=5, meet_s=5, move_s=0.5)


class Communicator:
    name = "c"

    def __init__(self, suspended: bool = False) -> None:
        self.suspended = suspended

    def suspend(self) -> None:
        self.suspended = True

    def resume(self) -> None:
        self.suspended = False

    def is_suspended(self) -> bool:
        return self.suspended


def result(kind: OperationKind) -> OperationResult:
    return OperationResult(kind=kind, path="driver", ok=True, logical_device="cuda:0", source=GPU, target=None)


@pytest.fixture(autouse=True)
def no_watchdog_wait(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(job_operation, "WATCHDOG_LOOKS_S", 0.0)


def both(run: Callable[[int], None]) -> None:
    threads = [threading.Thread(target=run, args=(rank,)) for rank in (0, 1)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(20)
    assert not any(thread.is_alive() for thread in threads)


def pause_job(pause_of: Callable[[int], Callable[[], OperationResult]]) -> dict[int, dict[str, Any]]:
    """Both ranks pause as a whole; each rank's paused state, result and communicator after it."""
    store, out = DictStore(), {}

    def run(rank: int) -> None:
        state = {"paused": False}
        communicator = Communicator()
        own = pause_of(rank)

        def pause() -> OperationResult:
            done = own()
            state["paused"] = True
            return done

        def resume_in_place() -> OperationResult:
            state["paused"] = False
            return result(OperationKind.RESUME)

        actions = RankActions(source=GPU, logical_device="cuda:0", pause=pause, resume_in_place=resume_in_place)
        ended = job_operation.migrate_or_pause(
            JobOperation(1, OperationKind.PAUSE, rank, 2),
            Rendezvous(store, 1, rank=rank, world_size=2),
            actions,
            DEADLINES,
            find_communicators=lambda: [communicator],
            check=lambda _n: OK,
        )
        out[rank] = {"paused": state["paused"], "ok": ended.ok, "nccl_suspended": communicator.suspended}

    both(run)
    return out


def slow(seconds: float) -> Callable[[], OperationResult]:
    def pause() -> OperationResult:
        time.sleep(seconds)
        return result(OperationKind.PAUSE)

    return pause


def test_a_rank_that_pauses_just_after_the_other_gave_up_rolls_back_too() -> None:
    out = pause_job(lambda rank: slow(0.7 if rank == 1 else 0.0))  # longer than rank 0 waits for it
    assert out[0]["paused"] == out[1]["paused"] and out[0]["ok"] == out[1]["ok"], out
    assert not out[0]["paused"] and not any(rank["nccl_suspended"] for rank in out.values()), out


def test_ranks_that_pause_within_the_deadline_all_pause() -> None:
    out = pause_job(lambda rank: slow(0.1 * rank))
    assert all(rank["paused"] and rank["ok"] and rank["nccl_suspended"] for rank in out.values()), out


def test_a_rank_whose_pause_raises_answers_and_every_rank_trains_on_with_nccl() -> None:
    def refused() -> OperationResult:
        raise OperationFailedError("pause refused at phase 'prepare' before anything was locked: x", step="prepare")

    out = pause_job(lambda rank: refused if rank == 1 else slow(0.0))
    assert not out[0]["paused"] and not out[0]["ok"] and not out[1]["ok"], out
    assert not any(rank["nccl_suspended"] for rank in out.values()), out


def test_a_rank_that_restores_just_after_the_other_gave_up_is_paused_again_too() -> None:
    store, out = DictStore(), {}

    def run(rank: int) -> None:
        state = {"paused": True}
        communicator = Communicator(suspended=True)

        def resume() -> OperationResult:
            time.sleep(0.7 if rank == 1 else 0.0)
            state["paused"] = False
            return result(OperationKind.RESUME)

        def pause_again() -> OperationResult:
            state["paused"] = True
            return result(OperationKind.PAUSE)

        actions = RankActions(source=GPU, logical_device="cuda:0", resume=resume, pause_again=pause_again)
        job_operation.resume(
            JobOperation(2, OperationKind.RESUME, rank, 2),
            Rendezvous(store, 2, rank=rank, world_size=2),
            actions,
            DEADLINES,
            find_communicators=lambda: [communicator],
            check=lambda _n: OK,
        )
        out[rank] = state["paused"]

    both(run)
    assert out == {0: True, 1: True}, out
