"""Making room for a paused job (``flexium resume JOB --make-room``): the fewest jobs of lower
priority on one GPU are paused (the lowest priorities among equally few), never one of equal or
higher priority; the room is held for the job, which the queue resumes there first, and the jobs
paused wait to resume when free; a refusal says why, GPU by GPU, and changes nothing. On SQLite
and PostgreSQL."""

from __future__ import annotations

import threading
import time
from typing import Any

import pytest

from flexium import protocol, wire
from flexium.server import errors, storage
from flexium.server.db import Database
from flexium.server.policies.resume_when_free import queue_resume
from flexium.server.settings import BACKFILL_PATIENCE_S
from support.queue import admin, gpus_report, paused, queue, resumed, run, waits
from support.server import GIB
from support.storage import NOW, STALE, add_process, make_workspace, next_for, report, sweep_at

LOW, NORMAL, HIGH = (protocol.PRIORITIES[name] for name in ("low", "normal", "high"))


def running(db: Database, ws: int, process_id: str, *, memory: int, priority: int, gpu: int = 0, **fields: Any) -> None:
    add_process(db, ws, process_id, memory=memory, gpu_index=gpu, devices=[], priority=priority, **fields)


def pauses(created: wire.WaitCreated) -> list[str]:
    return sorted(c.process_id for c in created.commands if c.kind == "pause")


def test_the_fewest_jobs_of_the_lowest_priorities_are_paused(db: Database) -> None:
    ws, _ = make_workspace(db)
    running(db, ws, "low-20", memory=20 * GIB, priority=LOW)
    running(db, ws, "low-30", memory=30 * GIB, priority=LOW)
    running(db, ws, "normal-40", memory=40 * GIB, priority=NORMAL)
    running(db, ws, "high-45", memory=45 * GIB, priority=HIGH)
    gpus_report(db, ws, NOW, 138 * GIB, 138 * GIB)
    paused(db, ws, "urgent", footprint=45 * GIB, priority=HIGH)
    # 2 GiB free, 45.5 needed: two of the three lower jobs; the two low ones free 50.
    created = queue(db, ws, "urgent", make_room=True)
    assert pauses(created) == ["low-20", "low-30"]
    wait = created.wait
    # It waits for any GPU, as asked (no --gpu): the room held on the one chosen brings it there.
    assert wait.state == "waiting" and wait.gpu_uuid is None and wait.reservation is not None
    assert wait.reservation.gpu_uuid == "GPU-0000"
    assert wait.reservation.bytes == 45 * GIB + protocol.ROOM_MARGIN_BYTES
    for command in created.commands:
        assert command.reason is not None and "make room: process 'urgent' (priority high)" in command.reason
    queued = waits(db, ws)
    assert queued["low-20"].reason.startswith("paused to make room for process 'urgent'")
    not_yet = "not paused yet (RUNNING): its pause is under way; it waits in the queue once paused"
    assert queued["low-20"].note == not_yet
    assert queued["low-20"].gpu_uuid is None and queued["low-20"].priority == LOW

    # The pauses end; the next report shows their room: the job resumes there before anyone else.
    for command in created.commands:
        next_for(db, ws, command.process_id)
        report(db, ws, command.id, "succeeded", process={"state": "PAUSED", "memory_bytes": 0})
    assert waits(db, ws)["low-20"].note is None  # paused now: it waits as any other
    gpus_report(db, ws, NOW + 5, 88 * GIB, 138 * GIB)
    outcome = run(db, NOW + 5)
    assert resumed(outcome) == ["urgent"]
    [resume] = outcome.dispatched[0].commands
    assert resume.reason is not None and resume.reason.startswith("make room: the room made for it: GPU 0 had ")
    assert waits(db, ws)["low-20"].state == "waiting"


def test_one_job_of_a_higher_priority_goes_before_two_of_lower(db: Database) -> None:
    ws, _ = make_workspace(db)
    running(db, ws, "low-20", memory=20 * GIB, priority=LOW)
    running(db, ws, "low-30", memory=30 * GIB, priority=LOW)
    running(db, ws, "normal-60", memory=60 * GIB, priority=NORMAL)
    gpus_report(db, ws, NOW, 138 * GIB, 138 * GIB)
    paused(db, ws, "urgent", footprint=45 * GIB, priority=HIGH)
    assert pauses(queue(db, ws, "urgent", make_room=True)) == ["normal-60"]


def test_a_job_of_equal_or_higher_priority_is_never_paused(db: Database) -> None:
    ws, _ = make_workspace(db)
    running(db, ws, "normal-60", memory=60 * GIB, priority=NORMAL)
    running(db, ws, "high-70", memory=70 * GIB, priority=HIGH)
    running(db, ws, "low-5", memory=5 * GIB, priority=LOW, gpu=1)
    gpus_report(db, ws, NOW, 138 * GIB, 138 * GIB)
    paused(db, ws, "mine", footprint=40 * GIB, priority=NORMAL)
    with pytest.raises(errors.TargetRefused) as refused:
        queue(db, ws, "mine", make_room=True)
    message = refused.value.message
    assert message.startswith("cannot make room for process 'mine' (priority normal) on host 'node1': ")
    assert "GPU 0: 2.0 GiB free of the 40.5 GiB it needs, no job of lower priority to pause there" in message
    assert "jobs of its priority or higher hold 130.0 GiB" in message
    assert (
        "GPU 1: 2.0 GiB free of the 40.5 GiB it needs, pausing every job of lower priority there frees 5.0" in message
    )
    assert message.endswith(
        "Jobs of its priority or higher are never paused for it: give it a higher priority, or let it wait in the "
        "queue for room without pausing others (flexium resume --when-free; flexium run without --make-room)"
    )
    assert waits(db, ws) == {}
    assert db.run(storage.list_commands, write=False, workspace_id=ws) == []


def test_room_already_free_resumes_at_once(db: Database) -> None:
    ws, _ = make_workspace(db)
    gpus_report(db, ws, NOW, 138 * GIB, 20 * GIB)
    paused(db, ws, "mine", footprint=40 * GIB)
    created = queue(db, ws, "mine", make_room=True)
    [resume] = created.commands
    assert resume.kind == "resume" and resume.target_uuid == "GPU-0001" and created.wait.state == "dispatched"


def test_a_job_of_several_ranks_is_paused_whole_for_room(db: Database) -> None:
    ws, _ = make_workspace(db)
    caps = {"pause_resume": True, "migration": True, "job_operations": True}
    for rank in (0, 1):
        running(
            db,
            ws,
            f"rank-{rank}",
            memory=50 * GIB,
            priority=LOW,
            gpu=rank,
            capabilities=caps,
            job={"key": "run-1", "rank": rank, "world_size": 2},
        )
    gpus_report(db, ws, NOW, 138 * GIB, 138 * GIB)
    paused(db, ws, "urgent", footprint=40 * GIB, priority=HIGH)
    created = queue(db, ws, "urgent", make_room=True, gpu="1")
    assert pauses(created) == ["rank-0", "rank-1"]
    assert {c.job.operation_id for c in created.commands if c.job} != set()
    assert waits(db, ws)["rank-0"].job_key == "run-1"


def test_two_make_rooms_at_once_on_one_gpu_hold_its_room_once(db: Database) -> None:
    """Two servers making room on one GPU at the same moment: the second waits for the first's
    transaction and counts the room it held (on PostgreSQL the host's GPU rows are read locked;
    SQLite has one writer)."""
    ws, _ = make_workspace(db)
    gpus_report(db, ws, NOW, 80 * GIB)
    for name in ("first", "second"):
        paused(db, ws, name, footprint=40 * GIB, priority=HIGH, visible_gpus=["GPU-0000"])
    second: list[BaseException | wire.WaitCreated] = []

    def make_room_for_the_second() -> None:
        try:
            second.append(queue(db, ws, "second", now=NOW + 1, make_room=True))
        except errors.ApiError as exc:
            second.append(exc)

    with db.session(write=True) as session:
        first = queue_resume(
            session=session,
            workspace_id=ws,
            actor=admin(ws),
            request=wire.WaitRequest(process_id="first", make_room=True),
            now=NOW + 1,
            stale_after=STALE,
            reservation_ttl=protocol.RESERVATION_TTL_S,
            backfill_patience=BACKFILL_PATIENCE_S,
        )
        racing = threading.Thread(target=make_room_for_the_second)
        racing.start()
        time.sleep(1.0)  # the second's make-room is under way, its room read as the database has it
    racing.join(30)
    assert first.answer.wait.reservation is not None
    [refused] = second
    assert isinstance(refused, errors.TargetRefused), refused
    assert "GPU 0: 20.0 GiB free of the 40.5 GiB it needs" in refused.message  # the first resumes there


def test_the_reason_given_is_kept_on_the_wait_and_carried_by_the_commands_sent_for_it(db: Database) -> None:
    ws, _ = make_workspace(db)
    running(db, ws, "low-50", memory=50 * GIB, priority=LOW)
    gpus_report(db, ws, NOW, 138 * GIB)
    paused(db, ws, "urgent", footprint=40 * GIB, priority=HIGH, visible_gpus=["GPU-0000"])
    created = queue(db, ws, "urgent", make_room=True, reason="the demo at 3")
    assert created.wait.why == "the demo at 3" and waits(db, ws)["low-50"].why is None
    [pause] = created.commands
    assert pause.reason is not None and pause.reason.endswith("; why: the demo at 3")
    next_for(db, ws, "low-50")
    report(db, ws, pause.id, "succeeded", process={"state": "PAUSED", "memory_bytes": 0})
    gpus_report(db, ws, NOW + 5, 88 * GIB)
    [resumed_now] = run(db, NOW + 5).dispatched
    [resume] = resumed_now.commands
    assert resume.reason is not None and resume.reason.endswith("queued by alice; why: the demo at 3")
    queued = db.run(storage.list_audit, write=False, workspace_id=ws)
    assert any(e.action == "wait.created" and e.detail.endswith("; why: the demo at 3") for e in queued)


def test_asked_again_while_its_room_is_held_nothing_more_is_paused(db: Database) -> None:
    """A second ``--make-room`` for a job whose room is held (its pauses perhaps under way) answers
    with its wait: the room held for it is its own, not a deficit that pauses more jobs."""
    ws, _ = make_workspace(db)
    running(db, ws, "low-50", memory=50 * GIB, priority=LOW)
    running(db, ws, "normal-60", memory=60 * GIB, priority=NORMAL)
    gpus_report(db, ws, NOW, 138 * GIB, 138 * GIB)
    paused(db, ws, "urgent", footprint=45 * GIB, priority=HIGH, visible_gpus=["GPU-0000"])
    first = queue(db, ws, "urgent", make_room=True)
    assert pauses(first) == ["low-50"] and first.wait.reservation is not None
    for now in (NOW + 1, NOW + 2):  # the pause still under way, then done and not yet shown
        again = queue(db, ws, "urgent", now=now, make_room=True)
        assert again.commands == [], again.commands
        assert again.wait.id == first.wait.id and again.wait.reservation == first.wait.reservation
        [pause] = first.commands
        if now == NOW + 1:
            next_for(db, ws, "low-50")
            report(db, ws, pause.id, "succeeded", process={"state": "PAUSED", "memory_bytes": 0})
    assert "normal-60" not in waits(db, ws)  # never paused, so never queued


def test_room_is_held_while_the_pauses_that_make_it_are_under_way(db: Database) -> None:
    """A job may take its pause late (a command waits for it up to its own time): the hold does not
    run out before the room it waits for shows; once the pauses ended it runs its time and goes."""
    ws, _ = make_workspace(db)
    ttl = protocol.RESERVATION_TTL_S
    running(db, ws, "low-50", memory=50 * GIB, priority=LOW)
    gpus_report(db, ws, NOW, 130 * GIB, 138 * GIB)
    paused(db, ws, "urgent", footprint=45 * GIB, priority=HIGH)
    first = queue(db, ws, "urgent", make_room=True)
    assert pauses(first) == ["low-50"] and first.wait.reservation is not None
    assert first.wait.reservation.expires_at == NOW + ttl

    def held() -> float | None:
        reservation = waits(db, ws)["urgent"].reservation
        return None if reservation is None else reservation.expires_at

    late = NOW + ttl * 0.75  # within half its time of running out, the pause not taken yet
    sweep_at(db, late, command_ttl=10 * ttl)
    assert held() == late + ttl
    sweep_at(db, late + 5, command_ttl=10 * ttl)  # not renewed at every sweep, only near its end
    assert held() == late + ttl
    [pause] = first.commands
    next_for(db, ws, "low-50", now=late + 10)
    report(db, ws, pause.id, "succeeded", process={"state": "PAUSED", "memory_bytes": 0}, now=late + 20)
    sweep_at(db, late + ttl * 0.75, command_ttl=10 * ttl)  # its pause ended: it runs the time it has
    assert held() == late + ttl
    assert sweep_at(db, late + ttl, command_ttl=10 * ttl).released == [(ws, "node1")]
    assert held() is None


@pytest.mark.parametrize("ending", ["failed", "expired"])
def test_a_pause_that_fails_to_make_the_room_lets_go_of_it_and_says_why(db: Database, ending: str) -> None:
    """The job refuses its pause (not enough host memory, say) or never takes it: it runs on where the
    room was to be made. The room held for the waiting job goes (nothing else is kept from that GPU for
    room that will not come), the wait says why and waits on in the queue, and the paused job's own wait
    to resume says its pause failed and why."""
    ws, _ = make_workspace(db)
    running(db, ws, "low-50", memory=50 * GIB, priority=LOW)
    gpus_report(db, ws, NOW, 130 * GIB, 138 * GIB)
    paused(db, ws, "urgent", footprint=45 * GIB, priority=HIGH)
    made = queue(db, ws, "urgent", make_room=True)
    [pause] = made.commands
    assert made.wait.reservation is not None
    if ending == "failed":
        next_for(db, ws, "low-50", now=NOW + 1)
        refusal = "pausing needs 51.00 GiB of host memory; this machine has 22.28 GiB available"
        report(db, ws, pause.id, "failed", error=refusal, now=NOW + 2)
        why = f"failed: {refusal}"
    else:
        sweep_at(db, NOW + 200, command_ttl=100.0)
        why = "expired: not started within 100 s"
    urgent = waits(db, ws)["urgent"]
    assert urgent.state == "waiting" and urgent.reservation is None, urgent
    assert urgent.note is not None and urgent.note.startswith(
        f"room not made: pausing low-50 (command {pause.id}) {why}"
    )
    assert (
        db.run(storage.list_devices, write=False, workspace_id=ws, now=NOW + 3, stale_after=STALE)
        .hosts[0]
        .devices[0]
        .memory_reserved
        == 0
    )
    victim = db.run(storage.list_waits, write=False, workspace_id=ws, now=NOW + 3, process_id="low-50", live=False)
    assert (
        victim
        and victim[0].state == "cancelled"
        and victim[0].note == f"its pause, command {pause.id}, {why}; it runs on"
    )
    # Asked without --gpu, it waits for any GPU, not the one room was to be made on: the other one frees first.
    assert urgent.gpu_uuid is None
    if ending == "failed":  # (an expired pause is noticed minutes later, when the job's reports are stale)
        gpus_report(db, ws, NOW + 4, 130 * GIB, 0)
        assert resumed(run(db, NOW + 4)) == ["urgent"], waits(db, ws)["urgent"].note


def test_a_failed_pause_lets_go_only_of_the_room_it_was_making(db: Database) -> None:
    """Two make-rooms on one GPU, each pausing a job of its own: the second's pause fails. Only the room held
    for the second goes; the first's, made by a pause that went through, stays held for it."""
    ws, _ = make_workspace(db)
    running(db, ws, "low-50", memory=50 * GIB, priority=LOW)
    running(db, ws, "low-40", memory=40 * GIB, priority=LOW)
    gpus_report(db, ws, NOW, 130 * GIB, 138 * GIB)
    paused(db, ws, "urgent-a", footprint=45 * GIB, priority=HIGH)
    paused(db, ws, "urgent-b", footprint=45 * GIB, priority=HIGH)
    first = queue(db, ws, "urgent-a", make_room=True)
    second = queue(db, ws, "urgent-b", make_room=True, now=NOW + 1)
    assert pauses(first) == ["low-40"] and pauses(second) == ["low-50"], (pauses(first), pauses(second))
    [failing] = second.commands
    next_for(db, ws, "low-50", now=NOW + 2)
    report(db, ws, failing.id, "failed", error="pausing needs more host memory", now=NOW + 3)
    held = waits(db, ws, now=NOW + 4)
    assert held["urgent-a"].reservation is not None and held["urgent-b"].reservation is None
    assert (held["urgent-b"].note or "").startswith(f"room not made: pausing low-50 (command {failing.id}) failed")


def test_room_is_not_made_for_a_job_on_a_gpu_a_higher_priority_job_waits_for(db: Database) -> None:
    """A higher priority is never delayed by a lower one: making room for a normal job where a high-priority
    paused job, first in line, waits for room is refused there, naming that job; with the high job's wait
    gone, the same request makes its room."""
    ws, _ = make_workspace(db)
    running(db, ws, "low-80", memory=80 * GIB, priority=LOW)
    running(db, ws, "high-40", memory=40 * GIB, priority=HIGH)
    gpus_report(db, ws, NOW, 120 * GIB)  # one GPU of 140 GiB: 20 free
    paused(db, ws, "urgent", footprint=70 * GIB, priority=HIGH, visible_gpus=["GPU-0000"])
    paused(db, ws, "normal", footprint=30 * GIB, priority=NORMAL, visible_gpus=["GPU-0000"])
    urgent = queue(db, ws, "urgent", now=NOW).wait
    assert urgent.state == "waiting"
    with pytest.raises(errors.TargetRefused) as refused:
        queue(db, ws, "normal", now=NOW + 1, make_room=True)
    assert "GPU 0: process 'urgent' of a higher priority waits for it first" in refused.value.message
    assert waits(db, ws, NOW + 1).get("normal") is None  # nothing stored: no wait, no pause
    cancelled = db.run(
        storage.cancel_wait, write=True, workspace_id=ws, actor=admin(ws), wait_id=urgent.id, now=NOW + 2
    )
    assert cancelled.state == "cancelled"
    made = queue(db, ws, "normal", now=NOW + 3, make_room=True)
    assert [c.process_id for c in made.commands if c.kind == "pause"] == ["low-80"]
