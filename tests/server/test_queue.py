"""The resume-when-free queue in storage: waits resumed a higher priority first and first come first
served within one, cancelled by a person or by a plain pause or resume, a refused resume back in
the queue, one resume per job however many passes race, room held for a job respected; on SQLite
and PostgreSQL."""

from __future__ import annotations

import threading
import time
from typing import Any

import pytest
from sqlalchemy import event, text, update
from sqlalchemy.orm import Session

from flexium import protocol, wire
from flexium.server import errors, storage
from flexium.server.db import Database
from flexium.server.models import Process
from flexium.server.policies.migrate_auto import migrate_auto
from flexium.server.policies.resume_when_free import QueueOutcome
from flexium.server.storage.devices import host_devices
from flexium.server.storage.drains import create_drain
from flexium.server.storage.processes import find_process
from flexium.server.storage.reservations import hold_room, lock_hosts
from flexium.server.storage.targets import target_refusal
from support.queue import HOST, admin, gpus_report, paused, queue, resumed, run, waits
from support.server import GIB
from support.storage import NOW, STALE, add_process, all_at_once, make_workspace, next_for, report, sweep_at


def test_a_higher_priority_first_and_first_come_first_served_within_one(db: Database) -> None:
    ws, _ = make_workspace(db)
    gpus_report(db, ws, NOW, 139 * GIB, 139 * GIB)
    paused(db, ws, "early")
    paused(db, ws, "urgent", priority=protocol.PRIORITIES["high"])
    paused(db, ws, "late")
    for t, process_id in enumerate(("early", "urgent", "late")):
        created = queue(db, ws, process_id, now=NOW + t)
        assert created.wait.state == "waiting" and created.commands == []
    order = waits(db, ws)
    assert [order[p].position for p in ("urgent", "early", "late")] == [1, 2, 3]
    assert resumed(run(db, NOW + 5)) == []

    gpus_report(db, ws, NOW + 6, 100 * GIB, 139 * GIB)  # room for one (30 GiB and the headroom)
    assert resumed(run(db, NOW + 6)) == ["urgent"]
    gpus_report(db, ws, NOW + 7, 100 * GIB, 70 * GIB)  # GPU 1 frees room for two more
    assert resumed(run(db, NOW + 7)) == ["early", "late"]
    commands = {c.process_id: c for c in db.run(storage.list_commands, write=False, workspace_id=ws)}
    assert commands["urgent"].target_uuid == "GPU-0000" and commands["early"].target_uuid == "GPU-0001"
    assert commands["early"].reason is not None and commands["early"].reason.startswith("resume when free: GPU 1 had")
    senders = db.run(
        storage.command_senders,
        write=False,
        workspace_id=ws,
        process_ids=["early"],
        command_ids=[commands["early"].id],
    )
    assert senders[commands["early"].id].token_name == "policy: resume when free"


def test_a_job_that_fits_now_goes_ahead_of_an_earlier_one_of_its_priority_that_fits_nowhere(db: Database) -> None:
    """No head-of-line blocking: a small job does not wait behind a big one of its priority; it never
    goes ahead of one of a higher priority."""
    ws, _ = make_workspace(db)
    gpus_report(db, ws, NOW, 139 * GIB)
    paused(db, ws, "big", footprint=60 * GIB)
    paused(db, ws, "small", footprint=10 * GIB)
    paused(db, ws, "urgent-big", footprint=60 * GIB, priority=protocol.PRIORITIES["high"])
    paused(db, ws, "low-small", footprint=10 * GIB, priority=protocol.PRIORITIES["low"])
    for t, process_id in enumerate(("big", "small", "urgent-big", "low-small")):
        queue(db, ws, process_id, now=NOW + t)
    gpus_report(db, ws, NOW + 5, 100 * GIB)  # 40 GiB free: room for a small one, not for a big one
    assert resumed(run(db, NOW + 5)) == []  # the high-priority big one waits for it: nobody passes it
    db.run(
        storage.cancel_wait,
        write=True,
        workspace_id=ws,
        actor=admin(ws),
        wait_id=waits(db, ws)["urgent-big"].id,
        now=NOW + 6,
    )
    assert resumed(run(db, NOW + 6)) == ["small"]  # ahead of the big one of its priority
    assert waits(db, ws)["big"].state == "waiting" and waits(db, ws)["low-small"].state == "waiting"


def test_a_job_passed_over_for_its_patience_is_passed_no_more(db: Database) -> None:
    """No starvation: once the big job has waited the backfill patience (10 s here), the room freed
    on the GPUs it waits for collects for it, and the small job queued after it waits its turn."""
    ws, _ = make_workspace(db)
    gpus_report(db, ws, NOW, 139 * GIB)
    paused(db, ws, "big", footprint=60 * GIB)
    paused(db, ws, "small", footprint=10 * GIB)
    queue(db, ws, "big", now=NOW)
    queue(db, ws, "small", now=NOW + 1)
    gpus_report(db, ws, NOW + 10, 100 * GIB)
    assert resumed(run(db, NOW + 10, patience=10.0)) == []
    gpus_report(db, ws, NOW + 11, 40 * GIB)
    assert resumed(run(db, NOW + 11, patience=10.0)) == ["big", "small"]


def test_a_person_cancels_a_wait_and_a_plain_resume_takes_the_job_out(db: Database) -> None:
    ws, _ = make_workspace(db)
    gpus_report(db, ws, NOW, 139 * GIB)
    paused(db, ws, "a")
    paused(db, ws, "b")
    wait_a = queue(db, ws, "a").wait
    queue(db, ws, "b")
    cancelled = db.run(storage.cancel_wait, write=True, workspace_id=ws, actor=admin(ws), wait_id=wait_a.id, now=NOW)
    assert cancelled.state == "cancelled" and cancelled.note == "cancelled by alice"
    with pytest.raises(errors.InvalidState, match="only a waiting one"):
        db.run(storage.cancel_wait, write=True, workspace_id=ws, actor=admin(ws), wait_id=wait_a.id, now=NOW)

    db.run(
        storage.create_commands_audited,
        write=True,
        workspace_id=ws,
        actor=admin(ws),
        kind="resume",
        process_id="b",
        now=NOW + 1,
        stale_after=STALE,
    )
    assert waits(db, ws) == {}
    ended = {w.process_id: w for w in db.run(storage.list_waits, write=False, workspace_id=ws, now=NOW, live=False)}
    assert ended["b"].state == "cancelled" and ended["b"].note == "replaced by a resume sent by alice"
    actions = [(e.action, e.process_id) for e in db.run(storage.list_audit, write=False, workspace_id=ws)]
    assert ("wait.cancelled", "a") in actions and ("wait.cancelled", "b") in actions
    assert actions.count(("wait.created", "a")) == 1


def test_queued_again_replaces_the_earlier_wait(db: Database) -> None:
    ws, _ = make_workspace(db)
    gpus_report(db, ws, NOW, 139 * GIB, 139 * GIB)
    paused(db, ws, "a")
    first = queue(db, ws, "a").wait
    second = queue(db, ws, "a", gpu="cuda:1").wait
    assert second.id != first.id and second.gpu_uuid == "GPU-0001" and second.gpu_index == 1
    assert list(waits(db, ws)) == ["a"]
    # The listing says the GPU by its index on its host too (read once for the whole list).
    [listed] = db.run(storage.list_waits, write=False, workspace_id=ws, now=NOW)
    assert (listed.gpu_uuid, listed.gpu_index) == ("GPU-0001", 1) and first.gpu_index is None


def test_a_job_queued_again_keeps_its_place(db: Database) -> None:
    """Asked again for the same GPU, the wait stays as it is (a new reason noted); for another GPU it is
    replaced by one queued when the job was first: either way the job keeps its place."""
    ws, _ = make_workspace(db)
    gpus_report(db, ws, NOW, 139 * GIB, 139 * GIB)
    paused(db, ws, "first")
    paused(db, ws, "second")
    earlier = queue(db, ws, "first", now=NOW + 1)
    assert earlier.queued_before is None
    queue(db, ws, "second", now=NOW + 2)
    again = queue(db, ws, "first", now=NOW + 3, reason="still needed")
    assert again.wait.id == earlier.wait.id and again.queued_before == NOW + 1 and again.wait.why == "still needed"
    assert [w.process_id for w in sorted(waits(db, ws).values(), key=lambda w: w.position or 0)] == ["first", "second"]
    moved = queue(db, ws, "first", gpu="cuda:1", now=NOW + 4)
    assert moved.wait.id != earlier.wait.id and moved.wait.gpu_uuid == "GPU-0001" and moved.queued_before == NOW + 1
    order = waits(db, ws)
    assert (order["first"].position, order["second"].position) == (1, 2)


def test_what_cannot_be_queued_is_refused_before_anything_changes(db: Database) -> None:
    ws, _ = make_workspace(db)
    gpus_report(db, ws, NOW, 0, 0)
    add_process(db, ws, "running")
    paused(db, ws, "a")
    refusals: list[tuple[str, dict[str, Any], type[errors.ApiError], str]] = [
        ("running", {}, errors.InvalidState, "it is RUNNING; pause it first"),
        ("nope", {}, errors.NotFound, "not found"),
        ("a", {"host": "elsewhere"}, errors.TargetRefused, "resumes only on GPUs of its own host"),
        ("a", {"gpu": "cuda:9"}, errors.TargetRefused, "sees 2 GPU"),
        ("a", {"gpu": "cuda:x"}, errors.InvalidRequest, "not cuda:N"),
    ]
    for process_id, request, error, message in refusals:
        with pytest.raises(error, match=message):
            queue(db, ws, process_id, **request)
    assert waits(db, ws) == {}
    with pytest.raises(errors.Stale):
        queue(db, ws, "a", now=NOW + STALE + 1)


def test_a_refused_resume_waits_again_for_a_newer_report(db: Database) -> None:
    """The job's room check refused (a neighbour came back between the report and the resume):
    the job waits again, and the report it was refused on does not send it again."""
    ws, _ = make_workspace(db)
    gpus_report(db, ws, NOW, 139 * GIB)
    paused(db, ws, "a")
    queue(db, ws, "a")
    gpus_report(db, ws, NOW + 1, 0)
    [resume] = [c for done in run(db, NOW + 1).dispatched for c in done.commands]
    next_for(db, ws, "a", now=NOW + 1.1)
    report(db, ws, resume.id, "running", now=NOW + 1.2)
    refusal = "cuda:0 has 4.00 GiB free; the paused job needs 30.00 GiB: it stays paused"
    report(db, ws, resume.id, "failed", now=NOW + 1.3, error=refusal, process={"state": "PAUSED"})
    wait = waits(db, ws)["a"]
    assert wait.state == "waiting" and wait.dispatches == 1 and wait.note is not None and refusal in wait.note
    assert resumed(run(db, NOW + 1.4)) == []  # the report it was refused on
    gpus_report(db, ws, NOW + 2, 0)
    assert resumed(run(db, NOW + 2)) == ["a"]
    assert waits(db, ws)["a"].dispatches == 2


def test_a_resume_that_succeeds_ends_the_wait(db: Database) -> None:
    ws, _ = make_workspace(db)
    gpus_report(db, ws, NOW, 0)
    paused(db, ws, "a")
    created = queue(db, ws, "a")
    [resume] = created.commands  # room now: resumed at once
    assert created.wait.state == "dispatched" and created.wait.command_id == resume.id
    next_for(db, ws, "a")
    report(db, ws, resume.id, "succeeded", process={"state": "RUNNING"})
    wait = db.run(storage.get_wait, write=False, workspace_id=ws, wait_id=created.wait.id, now=NOW)
    assert wait.state == "done" and wait.finished_at == NOW


def test_one_resume_however_many_passes_race(db: Database) -> None:
    ws, _ = make_workspace(db)
    gpus_report(db, ws, NOW, 139 * GIB)
    for i in range(3):
        paused(db, ws, f"job-{i}", footprint=10 * GIB)
        queue(db, ws, f"job-{i}")
    gpus_report(db, ws, NOW + 1, 0)
    outcomes: list[QueueOutcome] = []
    failures = all_at_once(6, lambda _i: outcomes.append(run(db, NOW + 1)))
    assert failures == []
    assert sorted(p for outcome in outcomes for p in resumed(outcome)) == ["job-0", "job-1", "job-2"]
    commands = db.run(storage.list_commands, write=False, workspace_id=ws)
    assert sorted(c.process_id for c in commands) == ["job-0", "job-1", "job-2"]


def test_room_held_for_a_job_is_not_taken_by_the_others(db: Database) -> None:
    ws, _ = make_workspace(db)
    gpus_report(db, ws, NOW, 139 * GIB)
    paused(db, ws, "holder")
    paused(db, ws, "urgent", priority=protocol.PRIORITIES["high"])
    held = queue(db, ws, "holder", gpu="0").wait
    queue(db, ws, "urgent", now=NOW + 1)
    db.run(
        hold_room,
        write=True,
        workspace_id=ws,
        host=HOST,
        gpu_uuid="GPU-0000",
        nbytes=31 * GIB,
        wait_id=held.id,
        holder="process 'holder'",
        now=NOW,
        ttl=60.0,
    )
    gpus_report(db, ws, NOW + 2, 100 * GIB)  # 40 GiB free: the 31 GiB held leave 9
    assert resumed(run(db, NOW + 2)) == ["holder"]
    assert waits(db, ws)["urgent"].state == "waiting"
    gpus_report(db, ws, NOW + 3, 60 * GIB)
    assert resumed(run(db, NOW + 3)) == ["urgent"]


def test_a_priority_set_by_an_admin_moves_the_job_in_the_queue(db: Database) -> None:
    ws, _ = make_workspace(db)
    gpus_report(db, ws, NOW, 139 * GIB)
    paused(db, ws, "a")
    paused(db, ws, "b")
    queue(db, ws, "a")
    queue(db, ws, "b", now=NOW + 1)
    shown = db.run(
        storage.set_priority,
        write=True,
        workspace_id=ws,
        actor=admin(ws),
        process_id="b",
        priority=protocol.PRIORITIES["high"],
        now=NOW,
        stale_after=STALE,
    )
    assert shown.priority == 90 and shown.wait_id is not None
    assert [w.process_id for w in waits(db, ws).values()] == ["b", "a"]
    gpus_report(db, ws, NOW + 2, 100 * GIB)
    assert resumed(run(db, NOW + 2)) == ["b"]
    # The job's own word at a registration again does not undo the admin's.
    add_process(db, ws, "b", state="PAUSED", memory=0, footprint_bytes=30 * GIB, devices=[], priority=10)
    assert (
        db.run(storage.get_process, write=False, workspace_id=ws, process_id="b", now=NOW, stale_after=STALE).priority
        == 90
    )


def test_a_job_of_several_ranks_resumes_when_each_rank_has_room_at_home(db: Database) -> None:
    ws, _ = make_workspace(db)
    gpus_report(db, ws, NOW, 139 * GIB, 0)
    caps = {"pause_resume": True, "migration": True, "job_operations": True}
    for rank in (1, 0):
        paused(
            db,
            ws,
            f"rank-{rank}",
            home=rank,
            capabilities=caps,
            job={"key": "run-1", "rank": rank, "world_size": 2},
        )
    created = queue(db, ws, "rank-1")
    assert created.wait.process_id == "rank-0" and created.wait.job_key == "run-1" and not created.commands
    with pytest.raises(errors.InvalidRequest, match="resumes where its ranks paused"):
        queue(db, ws, "rank-0", gpu="1")
    gpus_report(db, ws, NOW + 1, 0, 0)
    outcome = run(db, NOW + 1)
    assert sorted(resumed(outcome)) == ["rank-0", "rank-1"]
    assert {c.job.operation_id for done in outcome.dispatched for c in done.commands if c.job} != set()


def test_a_job_that_runs_again_without_the_queue_leaves_it(db: Database) -> None:
    ws, _ = make_workspace(db)
    gpus_report(db, ws, NOW, 139 * GIB)
    paused(db, ws, "a")
    queue(db, ws, "a")
    add_process(db, ws, "a", devices=[])  # registers again RUNNING (resumed by its own code)
    outcome = run(db, NOW + 1)
    [(_ws, wait)] = outcome.cancelled
    assert wait.state == "cancelled" and "RUNNING" in (wait.note or "")


def test_the_queues_view_is_four_reads_however_long_the_queue(db: Database) -> None:
    ws, _ = make_workspace(db)
    gpus_report(db, ws, NOW, 139 * GIB, 139 * GIB)
    for n in range(12):
        paused(db, ws, f"job-{n}")
        queue(db, ws, f"job-{n}", gpu="1" if n == 3 else None)
    caps = {"pause_resume": True, "migration": True, "job_operations": True}
    for rank in (0, 1):
        paused(
            db, ws, f"rank-{rank}", home=rank, capabilities=caps, job={"key": "run-1", "rank": rank, "world_size": 2}
        )
    queue(db, ws, "rank-0")
    statements: list[str] = []

    def count(*args: Any) -> None:
        statements.append(args[2])

    event.listen(db.engine, "before_cursor_execute", count)
    try:
        view = db.run(storage.queue_view, write=False)
    finally:
        event.remove(db.engine, "before_cursor_execute", count)
    assert len([s for s in statements if s.lstrip().upper().startswith("SELECT")]) == 4
    assert view.hosts == frozenset({(ws, HOST)})
    assert len(view.watches) == 14
    assert view.watches[(ws, "job-0")].gpus == ["GPU-0000", "GPU-0001"]
    assert view.watches[(ws, "job-3")].gpus == ["GPU-0001"]
    assert view.watches[(ws, "rank-1")].gpus == ["GPU-0001"]
    assert view.watches[(ws, "rank-0")].wait_id == view.watches[(ws, "rank-1")].wait_id


def test_a_drain_written_in_a_session_is_seen_by_the_drains_it_read_before(db: Database) -> None:
    ws, _ = make_workspace(db)
    gpus_report(db, ws, NOW, 0, 0)
    paused(db, ws, "p")

    def judged_before_and_after_a_drain(*, session: Session) -> list[str | None]:
        proc = find_process(session=session, workspace_id=ws, process_id="p")
        gpu0 = host_devices(session=session, workspace_id=ws, host=HOST)["GPU-0000"]
        before = target_refusal(proc=proc, dev=gpu0, kind="resume", now=NOW, stale_after=STALE)
        create_drain(
            session=session, workspace_id=ws, actor=admin(ws), request=wire.DrainRequest(host=HOST, gpu="0"), now=NOW
        )
        return [before, target_refusal(proc=proc, dev=gpu0, kind="resume", now=NOW, stale_after=STALE)]

    before, after = db.run(judged_before_and_after_a_drain, write=True)
    assert before is None and after is not None and after.startswith("drained by alice")


@pytest.mark.parametrize("database_kind", ["postgresql"], indirect=True)
def test_a_person_queueing_a_job_takes_its_hosts_lock_before_its_row(db: Database) -> None:
    """A pass over the host holds the host's lock and then locks the job's row (to send it a command): a
    person's resume of that job must not hold the row while it waits for the host, or the two deadlock."""
    ws, _ = make_workspace(db)
    paused(db, ws, "p", footprint=30 * GIB)
    queued: list[Any] = []
    with db.session(write=True) as pass_session:
        lock_hosts(session=pass_session, hosts=[(ws, HOST)])  # a pass holds the host
        person = threading.Thread(target=lambda: queued.append(queue(db, ws, "p", now=NOW + 1)))
        person.start()
        time.sleep(0.5)  # the person's resume waits for the host's lock
        pass_session.execute(text("SET LOCAL lock_timeout = '2s'"))
        find_process(session=pass_session, workspace_id=ws, process_id="p", for_update=True)  # not held by the person
    person.join(30)
    assert len(queued) == 1 and queued[0].wait.process_id == "p"


@pytest.mark.parametrize("database_kind", ["postgresql"], indirect=True)
def test_two_picks_of_a_target_at_once_never_promise_one_room_twice(db: Database) -> None:
    ws, _ = make_workspace(db)
    add_process(db, ws, "a", memory=40 * GIB, gpu_index=0, devices=[], n_gpus=4)
    add_process(db, ws, "b", memory=40 * GIB, gpu_index=0, devices=[], n_gpus=4)
    gpus_report(db, ws, NOW, 80 * GIB, 90 * GIB, 140 * GIB, 140 * GIB)  # GPU 1 has room for one of them
    picked: dict[str, Any] = {}

    def pick(process_id: str, session: Session) -> None:
        try:
            (command,) = migrate_auto(
                session=session, workspace_id=ws, actor=admin(ws), process_id=process_id, now=NOW + 1, stale_after=STALE
            )
            picked[process_id] = command.target_uuid
        except errors.TargetRefused as exc:
            picked[process_id] = exc

    with db.session(write=True) as first:
        pick("a", first)
        second = threading.Thread(target=lambda: db.run(lambda session: pick("b", session), write=True))
        second.start()
        time.sleep(0.5)  # the second pick waits for the host's lock until the first one's command is committed
    second.join(30)
    assert picked["a"] == "GPU-0001" and picked["b"] != "GPU-0001", picked


@pytest.mark.parametrize("gpu", ["auto", "any"])
def test_auto_as_the_gpu_asked_for_is_the_first_gpu_with_room(db: Database, gpu: str) -> None:
    """`--gpu auto`, as migrate's and flexium run's targets say it (and 'any', a wait's first word for it)."""
    ws, _ = make_workspace(db)
    gpus_report(db, ws, NOW, 139 * GIB, 139 * GIB)
    paused(db, ws, "job")
    created = queue(db, ws, "job", gpu=gpu)
    assert created.wait.state == "waiting" and created.wait.gpu_uuid is None
    gpus_report(db, ws, NOW + 1, 139 * GIB, 100 * GIB)
    assert resumed(run(db, NOW + 1)) == ["job"]


def _heard(db: Database, process_id: str, now: float) -> None:
    """The job's heartbeat at ``now``: it is alive and paused."""
    with db.session(write=True) as session:
        session.execute(update(Process).where(Process.process_id == process_id).values(last_seen=now))


def test_a_wait_for_a_gpu_its_host_stopped_reporting_says_why_then_ends_once_the_gpu_is_forgotten(
    db: Database,
) -> None:
    """Its host no longer reports the GPU the wait names (taken out, or hidden): while the server
    still knows it, the wait says why it cannot go there; once the server forgets it, the wait ends
    saying so and what to do, rather than wait for a GPU that is not coming back."""
    ws, _ = make_workspace(db)
    gpus_report(db, ws, NOW, 139 * GIB, 139 * GIB)
    paused(db, ws, "pinned")
    assert queue(db, ws, "pinned", gpu="1").wait.state == "waiting"
    later = NOW + 2 * STALE
    gpus_report(db, ws, later, 0)  # GPU 0 alone now
    _heard(db, "pinned", later)
    assert resumed(run(db, later)) == []
    assert waits(db, ws, later)["pinned"].note == "GPU 1: no fresh report from its host"
    forgotten = NOW + 700  # past the server's remove_after (600 s here) for GPU 1
    gpus_report(db, ws, forgotten, 0)
    _heard(db, "pinned", forgotten)
    sweep_at(db, forgotten)
    outcome = run(db, forgotten)
    [(_ws, ended)] = outcome.cancelled
    assert ended.process_id == "pinned" and ended.state == "cancelled"
    assert ended.note == (
        "the GPU it waits for (GPU-0001) is no longer reported by host 'node1': queue it again for a GPU the "
        "host has (flexium resume pinned --when-free)"
    )


def test_a_higher_priority_job_whose_resume_was_refused_keeps_its_gpu_from_lower_ones(db: Database) -> None:
    """Refused by its job's own room check, it waits for a newer report; meanwhile a job of lower
    priority does not take the room it waits for, as it did not before the refusal."""
    ws, _ = make_workspace(db)
    gpus_report(db, ws, NOW, 100 * GIB, 139 * GIB)
    paused(db, ws, "high-50", footprint=50 * GIB, priority=protocol.PRIORITIES["high"])
    paused(db, ws, "low-35", footprint=35 * GIB, priority=protocol.PRIORITIES["low"])
    queue(db, ws, "high-50", now=NOW)
    queue(db, ws, "low-35", now=NOW + 1)
    assert resumed(run(db, NOW + 2)) == []  # 40 GiB free: the low job waits behind the high one
    gpus_report(db, ws, NOW + 3, 60 * GIB, 139 * GIB)
    outcome = run(db, NOW + 3)
    assert resumed(outcome) == ["high-50"]
    [command] = [c for done in outcome.dispatched for c in done.commands]
    next_for(db, ws, "high-50", now=NOW + 4)
    report(db, ws, command.id, "failed", now=NOW + 5, error="room check: 49.0 GiB free on GPU 0 for 50.5 GiB")
    gpus_report(db, ws, NOW + 5, 60 * GIB, 139 * GIB)  # no newer than the refusal: the high job waits
    assert resumed(run(db, NOW + 5)) == []
    queued = waits(db, ws, NOW + 5)
    assert queued["high-50"].state == "waiting" and queued["low-35"].state == "waiting"
    gpus_report(db, ws, NOW + 6, 60 * GIB, 139 * GIB)  # newer: the high job is tried again, first
    assert resumed(run(db, NOW + 6)) == ["high-50"]
