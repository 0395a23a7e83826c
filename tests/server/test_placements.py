"""flexium run's placements: a job not started yet is placed on the GPU of its host with the most
room (or the one it names), or waits in the queue's order, after the paused jobs waiting before it,
until a report shows the room; placed, its room is held until its job registers and takes it; with
make-room, jobs of lower priority are paused for it; one whose flexium run stopped asking ends. On
SQLite and PostgreSQL."""

from __future__ import annotations

from typing import Any

import pytest
from sqlalchemy import update

from flexium import protocol, wire
from flexium.server import errors, storage
from flexium.server.db import Database
from flexium.server.models import Placement, Process
from flexium.server.policies.placement import PlacementOutcome, place_job, report_placement, run_placement_pass
from flexium.server.settings import BACKFILL_PATIENCE_S
from flexium.server.storage.drains import create_drain
from support.queue import HOST, admin, gpus_report, paused, queue, resumed, run, waits
from support.server import GIB, gpu
from support.storage import NOW, STALE, add_process, make_workspace, next_for, report

LOW, NORMAL, HIGH = (protocol.PRIORITIES[name] for name in ("low", "normal", "high"))
TTL = protocol.RESERVATION_TTL_S
SINCE = NOW - 3600  # the server has answered for an hour


def _devices(*used: int) -> list[wire.GpuReport]:
    return [wire.GpuReport.model_validate(gpu(i, used=u)) for i, u in enumerate(used)]


def place(db: Database, ws: int, *used: int, now: float = NOW, role: str = "admin", **request: Any) -> PlacementOutcome:
    actor = admin(ws)
    if role != "admin":
        actor = storage.AuthInfo(workspace_id=ws, workspace="team", token_id=2, role=role, token_name="job")
    request.setdefault("host", HOST)
    outcome: PlacementOutcome = db.run(
        place_job,
        write=True,
        workspace_id=ws,
        actor=actor,
        request=wire.PlacementRequest(devices=_devices(*used), **request),
        now=now,
        stale_after=STALE,
        reservation_ttl=TTL,
        answering_since=SINCE,
        backfill_patience=BACKFILL_PATIENCE_S,
    )
    return outcome


def ask(db: Database, ws: int, placement_id: int, *used: int, now: float) -> wire.PlacementInfo:
    outcome: PlacementOutcome = db.run(
        report_placement,
        write=True,
        workspace_id=ws,
        actor=admin(ws),
        placement_id=placement_id,
        report=wire.PlacementReport(devices=_devices(*used)),
        now=now,
        stale_after=STALE,
        reservation_ttl=TTL,
        answering_since=SINCE,
        backfill_patience=BACKFILL_PATIENCE_S,
    )
    return outcome.placement


def test_a_job_goes_to_the_gpu_with_the_most_room_and_its_room_is_held(db: Database) -> None:
    ws, _ = make_workspace(db)
    placed = place(db, ws, 100 * GIB, 20 * GIB, 60 * GIB, memory_bytes=40 * GIB).placement
    assert placed.state == "placed" and placed.placed_uuid == "GPU-0001" and placed.placed_index == 1
    assert placed.reservation is not None
    assert placed.reservation.bytes == 40 * GIB + protocol.ROOM_MARGIN_BYTES
    assert placed.note is not None and placed.note.startswith("placed on GPU 1: 120.0 GiB free for 40.0 GiB")
    # The next one does not count on the room held for the first.
    second = place(db, ws, 100 * GIB, 20 * GIB, 60 * GIB, memory_bytes=70 * GIB, now=NOW + 1).placement
    assert second.placed_uuid == "GPU-0002"


def test_the_gpu_it_names_or_nothing(db: Database) -> None:
    ws, _ = make_workspace(db)
    named = place(db, ws, 0, 130 * GIB, memory_bytes=20 * GIB, gpu_uuid="GPU-0001").placement
    assert named.state == "waiting" and named.placed_uuid is None and named.gpu_index == 1
    assert named.note is not None and "GPU 1: 10.0 GiB free" in named.note
    with pytest.raises(errors.TargetRefused, match="not a GPU of host 'node1'"):
        place(db, ws, 0, 0, gpu_uuid="GPU-0009")


def test_a_job_waits_until_a_report_shows_the_room(db: Database) -> None:
    ws, _ = make_workspace(db)
    waiting = place(db, ws, 130 * GIB, 130 * GIB, memory_bytes=40 * GIB).placement
    assert waiting.state == "waiting" and waiting.position == 1
    assert waiting.note is not None and waiting.note.startswith("waits for 40.5 GiB")
    assert ask(db, ws, waiting.id, 130 * GIB, 130 * GIB, now=NOW + 1).state == "waiting"
    placed = ask(db, ws, waiting.id, 130 * GIB, 10 * GIB, now=NOW + 2)
    assert placed.state == "placed" and placed.placed_uuid == "GPU-0001"


def test_a_job_that_fits_goes_ahead_of_an_earlier_one_until_that_one_waited_its_patience(db: Database) -> None:
    """Within a priority, a job that fits now is placed ahead of an earlier one that fits nowhere
    yet, until that one has waited BACKFILL_PATIENCE_S; a higher priority always goes first."""
    ws, _ = make_workspace(db)
    first = place(db, ws, 130 * GIB, memory_bytes=40 * GIB).placement
    second = place(db, ws, 130 * GIB, memory_bytes=1 * GIB, now=NOW + 1).placement
    assert second.state == "placed"  # not held up by the big one
    patient = NOW + BACKFILL_PATIENCE_S
    assert ask(db, ws, first.id, 130 * GIB, now=patient).state == "waiting"
    third = place(db, ws, 130 * GIB, memory_bytes=1 * GIB, now=patient).placement
    assert (
        third.state == "waiting"
        and third.note is not None
        and "a job before it in the queue waits for it" in third.note
    )
    urgent = place(db, ws, 130 * GIB, memory_bytes=1 * GIB, priority=HIGH, now=patient + 1).placement
    assert urgent.state == "placed"
    listed = db.run(storage.list_placements, write=False, workspace_id=ws, actor=admin(ws), now=patient + 2)
    # (the second ended meanwhile: its flexium run stopped asking)
    assert [(p.id, p.state) for p in listed] == [(urgent.id, "placed"), (first.id, "waiting"), (third.id, "waiting")]


def _heard(db: Database, ws: int, process_id: str, now: float) -> None:
    """The process's last beat at ``now``."""
    with db.session(write=True) as session:
        session.execute(
            update(Process).where(Process.workspace_id == ws, Process.process_id == process_id).values(last_seen=now)
        )


def test_a_paused_job_waiting_before_it_goes_first_once_it_waited_its_patience(db: Database) -> None:
    ws, _ = make_workspace(db)
    gpus_report(db, ws, NOW, 130 * GIB, 130 * GIB)
    paused(db, ws, "earlier", footprint=50 * GIB)  # fits no GPU on any report here
    queue(db, ws, "earlier")
    backfilled = place(db, ws, 130 * GIB, 100 * GIB, memory_bytes=5 * GIB, now=NOW + 1).placement
    assert backfilled.state == "placed"  # it fits now; the paused job fits nowhere yet
    patient = NOW + BACKFILL_PATIENCE_S
    _heard(db, ws, "earlier", patient - 1)  # a paused job still beats: its wait counts
    later = place(db, ws, 130 * GIB, 100 * GIB, memory_bytes=5 * GIB, now=patient).placement
    assert later.state == "waiting"
    assert later.note is not None and "a job before it in the queue waits for it" in later.note
    urgent = place(db, ws, 130 * GIB, 100 * GIB, memory_bytes=5 * GIB, priority=HIGH, now=patient + 1).placement
    assert urgent.state == "placed" and urgent.placed_uuid == "GPU-0001"


def _job_token(db: Database, ws: int, minted_by: storage.AuthInfo | None) -> storage.AuthInfo:
    token = db.run(storage.issue_token, write=True, workspace_id=ws, role="job", minted_by=minted_by, now=NOW)
    return storage.AuthInfo(workspace_id=ws, workspace="team", token_id=token.id, role="job", token_name="")


def _take(db: Database, ws: int, actor: storage.AuthInfo, placement_id: int, now: float = NOW) -> wire.PlacementInfo:
    db.run(
        storage.take_placement,
        write=True,
        workspace_id=ws,
        actor=actor,
        placement_id=placement_id,
        process_id="gpu-run",
        now=now,
    )
    info: wire.PlacementInfo = db.run(
        storage.get_placement, write=False, workspace_id=ws, actor=admin(ws), placement_id=placement_id, now=NOW
    )
    return info


def test_its_job_registering_takes_the_room(db: Database) -> None:
    ws, _ = make_workspace(db)
    placed = place(db, ws, 0, memory_bytes=10 * GIB).placement
    add_process(db, ws, "gpu-run")
    taken = _take(db, ws, admin(ws), placed.id)
    assert taken.state == "started" and taken.process_id == "gpu-run"
    # Held on, less what the job's reports show, until the hold's time ends: a job registers before it allocates.
    assert taken.reservation is not None and "process gpu-run started" in taken.reservation.holder


def test_only_the_token_it_was_made_for_takes_it(db: Database) -> None:
    """flexium run hands its job a job token minted with the token that asked for the placement."""
    ws, _ = make_workspace(db)
    placed = place(db, ws, 0, memory_bytes=10 * GIB).placement
    add_process(db, ws, "gpu-run")
    stranger = _job_token(db, ws, minted_by=None)
    left = _take(db, ws, stranger, placed.id)
    assert left.state == "placed" and left.process_id is None and left.reservation is not None
    refused = db.run(storage.list_audit, write=False, workspace_id=ws)[0]
    assert (refused.action, refused.outcome, refused.token_id) == ("placement.taken", "refused", stranger.token_id)
    taken = _take(db, ws, _job_token(db, ws, minted_by=admin(ws)), placed.id)
    assert taken.state == "started" and taken.process_id == "gpu-run"


def test_the_sweep_places_a_job_whose_room_a_report_showed(db: Database) -> None:
    """Room that a job's heartbeat shows is taken at the next sweep, not only when flexium run asks
    again; a placement whose flexium run stopped asking ends there too."""
    ws, _ = make_workspace(db)
    waiting = place(db, ws, 130 * GIB, 130 * GIB, memory_bytes=40 * GIB).placement
    gone = place(db, ws, 130 * GIB, 130 * GIB, memory_bytes=40 * GIB, host="node2").placement
    gpus_report(db, ws, NOW + 1, 130 * GIB, 10 * GIB)
    db.run(
        run_placement_pass,
        write=True,
        now=NOW + 1,
        stale_after=STALE,
        reservation_ttl=TTL,
        answering_since=SINCE,
        backfill_patience=BACKFILL_PATIENCE_S,
    )
    placed = db.run(
        storage.get_placement, write=False, workspace_id=ws, actor=admin(ws), placement_id=waiting.id, now=NOW + 1
    )
    assert placed.state == "placed" and placed.placed_uuid == "GPU-0001"
    db.run(
        run_placement_pass,
        write=True,
        now=NOW + STALE + 1,
        stale_after=STALE,
        reservation_ttl=TTL,
        answering_since=SINCE,
        backfill_patience=BACKFILL_PATIENCE_S,
    )
    ended = db.run(storage.get_placement, write=False, workspace_id=ws, actor=admin(ws), placement_id=gone.id, now=NOW)
    assert ended.state == "cancelled" and ended.note is not None and "stopped asking" in ended.note


def test_one_whose_flexium_run_stopped_asking_ends(db: Database) -> None:
    ws, _ = make_workspace(db)
    gone = place(db, ws, 130 * GIB, memory_bytes=40 * GIB).placement
    later = place(db, ws, 130 * GIB, memory_bytes=1 * GIB, now=NOW + STALE + 1).placement
    assert later.state == "placed"
    ended = db.run(storage.get_placement, write=False, workspace_id=ws, actor=admin(ws), placement_id=gone.id, now=NOW)
    assert ended.state == "cancelled" and ended.note is not None and "stopped asking" in ended.note


def test_closing_it_cancels_a_waiting_one_and_releases_a_placed_ones_room(db: Database) -> None:
    ws, _ = make_workspace(db)
    placed = place(db, ws, 0, memory_bytes=10 * GIB).placement
    waiting = place(db, ws, 0, gpu_uuid="GPU-0000", memory_bytes=135 * GIB).placement
    for placement, state in ((placed, "ended"), (waiting, "cancelled")):
        closed = db.run(
            storage.close_placement, write=True, workspace_id=ws, actor=admin(ws), placement_id=placement.id, now=NOW
        )
        assert closed.state == state and closed.reservation is None


def test_making_room_pauses_jobs_of_lower_priority_for_it(db: Database) -> None:
    ws, _ = make_workspace(db)
    add_process(db, ws, "low-50", memory=50 * GIB, gpu_index=0, devices=[], priority=LOW)
    add_process(db, ws, "high-60", memory=60 * GIB, gpu_index=1, devices=[], priority=HIGH)
    outcome = place(
        db, ws, 130 * GIB, 130 * GIB, memory_bytes=40 * GIB, priority=NORMAL, make_room=True, reason="a deadline"
    )
    assert [c.process_id for c in outcome.pauses] == ["low-50"]
    assert outcome.pauses[0].reason is not None and outcome.pauses[0].reason.endswith("; why: a deadline")
    assert outcome.placement.why == "a deadline"
    placement = outcome.placement
    # It waits for any GPU, as asked (no --gpu): the room held on the one chosen brings it there.
    assert placement.state == "waiting" and placement.gpu_uuid is None and placement.reservation is not None
    assert placement.reservation.gpu_uuid == "GPU-0000"
    # Another job's placement does not take the room made for it.
    other = place(db, ws, 80 * GIB, 130 * GIB, memory_bytes=40 * GIB, priority=HIGH, now=NOW + 1).placement
    assert other.state == "waiting"
    assert ask(db, ws, placement.id, 80 * GIB, 130 * GIB, now=NOW + 2).state == "placed"


def test_making_room_counts_the_room_already_held_for_another(db: Database) -> None:
    """Two make-rooms on one GPU: the second counts the room the first holds, for a job not started
    or a paused one, and is refused where only that room is free."""
    ws, _ = make_workspace(db)
    first = place(db, ws, 80 * GIB, memory_bytes=40 * GIB, priority=HIGH, make_room=True)
    assert first.pauses == () and first.placement.reservation is not None
    with pytest.raises(errors.TargetRefused, match="GPU 0: 19.5 GiB free of the 40.5 GiB it needs"):
        place(db, ws, 80 * GIB, memory_bytes=40 * GIB, priority=HIGH, make_room=True, now=NOW + 1)
    paused(db, ws, "paused-40", footprint=40 * GIB, priority=HIGH, visible_gpus=["GPU-0000"])
    with pytest.raises(errors.TargetRefused, match="GPU 0: 19.5 GiB free"):
        queue(db, ws, "paused-40", now=NOW + 2, make_room=True)


def test_making_room_takes_an_admin(db: Database) -> None:
    ws, _ = make_workspace(db)
    with pytest.raises(errors.Forbidden, match="admin"):
        place(db, ws, 0, memory_bytes=1 * GIB, make_room=True, role="job")


def test_nothing_is_placed_on_a_drained_gpu(db: Database) -> None:
    ws, _ = make_workspace(db)
    gpus_report(db, ws, NOW, 0, 100 * GIB)
    drain = wire.DrainRequest(host=HOST, gpu=0)
    db.run(create_drain, write=True, workspace_id=ws, actor=admin(ws), request=drain, now=NOW)
    placed = place(db, ws, 0, 100 * GIB, memory_bytes=10 * GIB).placement
    assert placed.state == "placed" and placed.placed_uuid == "GPU-0001"
    named = place(db, ws, 0, 100 * GIB, gpu_uuid="GPU-0000").placement
    assert named.state == "waiting" and named.note is not None and "drained by alice" in named.note


def test_a_job_placed_on_a_gpu_drained_before_it_started_is_placed_again_elsewhere(db: Database) -> None:
    """Placed, its flexium run starts the job at its next ask: a drain in between sends it to another GPU
    with room (its room on the drained one given back), or back to waiting, saying why."""
    ws, _ = make_workspace(db)
    placed = place(db, ws, 130 * GIB, 0, 60 * GIB, memory_bytes=10 * GIB).placement
    assert placed.state == "placed" and placed.placed_uuid == "GPU-0001"
    drain = wire.DrainRequest(host=HOST, gpu=1)
    db.run(create_drain, write=True, workspace_id=ws, actor=admin(ws), request=drain, now=NOW + 0.1)
    moved = ask(db, ws, placed.id, 130 * GIB, 0, 60 * GIB, now=NOW + 0.5)
    assert moved.state == "placed" and moved.placed_uuid == "GPU-0002", moved
    assert moved.reservation is not None and moved.reservation.gpu_uuid == "GPU-0002"
    db.run(
        create_drain,
        write=True,
        workspace_id=ws,
        actor=admin(ws),
        request=wire.DrainRequest(host=HOST, gpu=2),
        now=NOW + 1,
    )
    back = ask(db, ws, placed.id, 130 * GIB, 0, 60 * GIB, now=NOW + 1.5)
    assert back.state == "waiting" and back.reservation is None and back.placed_uuid is None, back
    assert back.note is not None and "drained" in back.note, back.note


# A job registers (flexium.init) before it allocates: its room stays held, less what its reports show, until the
# hold's time ends, so that neither another placement nor a paused job is given it meanwhile.


def test_the_room_of_a_job_that_registered_stays_held_until_its_memory_shows(db: Database) -> None:
    ws, _ = make_workspace(db)
    first = place(db, ws, 0, memory_bytes=100 * GIB).placement
    assert first.state == "placed" and first.placed_uuid == "GPU-0000"
    second = place(db, ws, 0, memory_bytes=100 * GIB, now=NOW + 1).placement
    assert second.state == "waiting"
    add_process(db, ws, "gpu-run", memory=0, gpu_index=0, n_gpus=1, now=NOW + 2)  # nothing allocated yet
    assert _take(db, ws, admin(ws), first.id).state == "started"
    assert ask(db, ws, second.id, 0, now=NOW + 3).state == "waiting"  # the 140 GiB GPU holds one of them
    paused(db, ws, "waiter", footprint=100 * GIB, visible_gpus=["GPU-0000"])
    assert queue(db, ws, "waiter", now=NOW + 4).wait.state == "waiting"
    gpus_report(db, ws, NOW + 5, 0)
    assert resumed(run(db, NOW + 5)) == []
    # The queue lists the started one while its room is held: room it counts as taken.
    live = db.run(storage.list_placements, write=False, workspace_id=ws, actor=admin(ws), now=NOW + 6)
    assert [(p.id, p.state, p.reservation is not None) for p in live] == [
        (first.id, "started", True),
        (second.id, "waiting", False),
    ]
    # Its memory shows: it holds nothing more, though its reservation lives on, so the queue lists it no
    # more, as the devices show nothing reserved.
    with db.session(write=True) as session:
        session.execute(update(Process).where(Process.process_id == "gpu-run").values(memory_bytes=100 * GIB))
    live = db.run(storage.list_placements, write=False, workspace_id=ws, actor=admin(ws), now=NOW + 7)
    assert [(p.id, p.state) for p in live] == [(second.id, "waiting")]
    [host] = db.run(storage.list_devices, write=False, workspace_id=ws, now=NOW + 7, stale_after=STALE).hosts
    assert host.devices[0].memory_reserved == 0
    every = db.run(storage.list_placements, write=False, workspace_id=ws, actor=admin(ws), now=NOW + 7, live=False)
    assert {(p.id, p.reservation is not None) for p in every} == {(first.id, False), (second.id, False)}


def test_a_started_jobs_room_is_held_for_a_while_from_its_registration_not_from_its_placement(db: Database) -> None:
    """A job registers at flexium.init(), then loads its data: the room its memory has not taken is
    held STARTED_HOLD_S from its registration, then given up."""
    ws, _ = make_workspace(db)
    first = place(db, ws, 0, memory_bytes=100 * GIB).placement
    registered = NOW + TTL - 10  # just before the placement's own hold would end
    add_process(db, ws, "gpu-run", memory=0, gpu_index=0, n_gpus=1, now=registered)
    taken = _take(db, ws, admin(ws), first.id, now=registered)
    assert taken.reservation is not None and taken.reservation.expires_at == registered + protocol.STARTED_HOLD_S
    still = registered + protocol.STARTED_HOLD_S - 10
    paused(db, ws, "waiter", footprint=100 * GIB, visible_gpus=["GPU-0000"], now=still)
    assert queue(db, ws, "waiter", now=still).wait.state == "waiting"
    gpus_report(db, ws, still, 0)
    assert resumed(run(db, still)) == []  # past the placement's five minutes, the room is still the job's
    after = registered + protocol.STARTED_HOLD_S + 1
    gpus_report(db, ws, after, 0)
    assert resumed(run(db, after)) == ["waiter"]


def test_a_placed_jobs_room_is_held_a_full_time_from_each_ask_while_it_starts(db: Database) -> None:
    """Its job may take long to start (a slow import, a dataset to open): while its flexium run asks,
    every few seconds, the room stays held, and a job of lower priority waiting for it does not get it."""
    ws, _ = make_workspace(db)
    placed = place(db, ws, 100 * GIB, memory_bytes=30 * GIB).placement
    assert placed.state == "placed" and placed.reservation is not None
    assert placed.reservation.expires_at == NOW + TTL
    paused(db, ws, "low-30", footprint=30 * GIB, priority=LOW)
    queue(db, ws, "low-30", now=NOW + 1)
    for now in (NOW + TTL / 2, NOW + TTL, NOW + TTL * 1.5):  # past the hold's first time
        asked = ask(db, ws, placed.id, 100 * GIB, now=now)
        assert asked.state == "placed" and asked.reservation is not None
        assert asked.reservation.expires_at == now + TTL
        gpus_report(db, ws, now, 100 * GIB)
        assert resumed(run(db, now)) == []
    assert waits(db, ws)["low-30"].state == "waiting"


def test_a_placement_whose_room_is_not_made_waits_on_without_a_hold_and_says_why(db: Database) -> None:
    """The job paused to make its room refuses its pause: it runs on, so that room will not come. The
    placement holds none any more (the GPU shows nothing reserved) and its note says why, after what the
    placing pass notes of its wait from then on; it waits for room as any other."""
    ws, _ = make_workspace(db)
    add_process(db, ws, "low-50", memory=50 * GIB, gpu_index=0, devices=[], priority=LOW, n_gpus=1)
    out = place(db, ws, 130 * GIB, memory_bytes=40 * GIB, priority=NORMAL, make_room=True)
    (pause,) = out.pauses
    assert out.placement.reservation is not None
    next_for(db, ws, "low-50", now=NOW + 1)
    report(db, ws, pause.id, "failed", error="pausing needs more host memory than is available", now=NOW + 2)
    with db.session(write=False) as session:
        row = session.get(Placement, out.placement.id)
        assert row is not None and row.reservation_id is None
        assert row.note is not None and row.note.startswith(
            f"room not made: pausing low-50 (command {pause.id}) failed"
        )
    asked = ask(db, ws, out.placement.id, 130 * GIB, now=NOW + 3)
    assert asked.state == "waiting" and asked.reservation is None, asked
    waits_for = "waits for 40.5 GiB (its 40.0 GiB and headroom): GPU 0: 10.0 GiB free; "
    assert asked.note is not None and asked.note.startswith(waits_for), asked.note
    assert f"; room not made: pausing low-50 (command {pause.id}) failed: pausing needs" in asked.note
    again = ask(db, ws, out.placement.id, 130 * GIB, now=NOW + 4)
    assert again.note is not None and again.note.count("room not made") == 1, again.note
    # Asked without --gpu, it waits for any GPU, not the one room was to be made on: another one frees first.
    assert again.gpu_uuid is None
    assert ask(db, ws, out.placement.id, 130 * GIB, 0, now=NOW + 5).state == "placed"
    [host] = db.run(storage.list_devices, write=False, workspace_id=ws, now=NOW + 3, stale_after=STALE).hosts
    assert host.devices[0].memory_reserved == 0


def test_room_made_for_a_placement_is_held_a_full_time_from_its_placing(db: Database) -> None:
    """The pauses that made its room may take a while: placed, its job starts now, and the room
    made for it is held from then, not from when it was made."""
    ws, _ = make_workspace(db)
    add_process(db, ws, "low-50", memory=50 * GIB, gpu_index=0, devices=[], priority=LOW, n_gpus=1)
    out = place(db, ws, 130 * GIB, memory_bytes=40 * GIB, priority=NORMAL, make_room=True)
    (pause,) = out.pauses
    assert out.placement.reservation is not None and out.placement.reservation.expires_at == NOW + TTL
    later = NOW + TTL * 0.9
    next_for(db, ws, "low-50", now=later - 2)
    report(db, ws, pause.id, "succeeded", now=later - 1)
    placed = ask(db, ws, out.placement.id, 80 * GIB, now=later)
    assert placed.state == "placed" and placed.reservation is not None
    assert placed.reservation.id == out.placement.reservation.id and placed.reservation.expires_at == later + TTL


def test_the_devices_show_the_room_held_and_the_drains(db: Database) -> None:
    """`flexium devices` and its API say what is held on each GPU for jobs not on it yet (a placed job's
    room, until its memory shows) and which GPU is drained, why and until what: the room the queue and
    the placements count as taken, which the GPU's own report does not show."""
    ws, _ = make_workspace(db)
    placed = place(db, ws, 0, 100 * GIB, memory_bytes=30 * GIB).placement
    assert placed.placed_uuid == "GPU-0000"
    drain = wire.DrainRequest(host=HOST, gpu=1)
    db.run(create_drain, write=True, workspace_id=ws, actor=admin(ws), request=drain, now=NOW)
    [host] = db.run(storage.list_devices, write=False, workspace_id=ws, now=NOW + 1, stale_after=STALE).hosts
    held, drained = host.devices
    assert held.memory_reserved == 30 * GIB + protocol.ROOM_MARGIN_BYTES and held.drained is None
    assert drained.memory_reserved == 0 and drained.drained is not None
    assert drained.drained.startswith("drained by alice (drain 1) until `flexium undrain node1:1`"), drained.drained
    # Its job registered and its memory shows: held no more than what has not shown yet.
    add_process(db, ws, "gpu-run", memory=20 * GIB, gpu_index=0, n_gpus=2, devices=[], now=NOW + 2)
    _take(db, ws, admin(ws), placed.id)
    [host] = db.run(storage.list_devices, write=False, workspace_id=ws, now=NOW + 3, stale_after=STALE).hosts
    assert host.devices[0].memory_reserved == 10 * GIB


def test_a_refused_make_room_says_what_is_held_for_jobs_not_started_yet(db: Database) -> None:
    """The GPU's report shows its room free; a placed job's hold takes it: the refusal says so, and what
    to do instead."""
    ws, _ = make_workspace(db)
    assert place(db, ws, 0, memory_bytes=100 * GIB, gpu_uuid="GPU-0000").placement.state == "placed"
    with pytest.raises(errors.TargetRefused) as refused:
        place(db, ws, 0, memory_bytes=60 * GIB, gpu_uuid="GPU-0000", make_room=True, now=NOW + 1)
    message = refused.value.message
    assert "GPU 0: 39.5 GiB free of the 60.5 GiB it needs, 100.5 GiB more held for jobs not on it yet" in message
    assert message.endswith(
        "give it a higher priority, or let it wait in the queue for room without pausing others "
        "(flexium resume --when-free; flexium run without --make-room)"
    )


def test_the_jobs_paused_to_make_room_are_not_resumed_into_it_when_its_job_registers(db: Database) -> None:
    ws, _ = make_workspace(db)
    add_process(db, ws, "low-50", memory=50 * GIB, gpu_index=0, devices=[], priority=LOW, n_gpus=1)
    out = place(db, ws, 130 * GIB, memory_bytes=40 * GIB, priority=NORMAL, make_room=True)
    (pause,) = out.pauses
    next_for(db, ws, "low-50", now=NOW + 1)
    report(db, ws, pause.id, "running", now=NOW + 1)
    report(db, ws, pause.id, "succeeded", now=NOW + 2)
    placed = ask(db, ws, out.placement.id, 80 * GIB, now=NOW + 3)
    assert placed.state == "placed"
    add_process(db, ws, "gpu-run", memory=0, gpu_index=0, n_gpus=1, devices=[], now=NOW + 4)  # nothing allocated yet
    _take(db, ws, admin(ws), placed.id)
    gpus_report(db, ws, NOW + 5, 80 * GIB)
    assert resumed(run(db, NOW + 5)) == []


def test_a_paused_job_of_lower_priority_leaves_the_room_to_a_placement_waiting_before_it(db: Database) -> None:
    """A higher priority is never delayed by a lower one: the queue's pass, which runs first when room
    shows, does not hand a paused job of lower priority the GPU a higher-priority placement waits for."""
    ws, _ = make_workspace(db)
    high = place(db, ws, 100 * GIB, memory_bytes=60 * GIB, priority=HIGH).placement
    assert high.state == "waiting"
    paused(db, ws, "low", footprint=50 * GIB, priority=LOW, visible_gpus=["GPU-0000"])
    assert queue(db, ws, "low", now=NOW + 1).wait.state == "waiting"
    gpus_report(db, ws, NOW + 20, 60 * GIB)  # 80 GiB free: room for one of them
    assert resumed(run(db, NOW + 20)) == []
    assert ask(db, ws, high.id, 60 * GIB, now=NOW + 20).state == "placed"


def test_a_paused_job_gone_silent_holds_up_no_placement(db: Database) -> None:
    """The queue passes over a wait whose job is silent (it could not resume now): so do the placements, which
    would otherwise wait behind it until the job is forgotten (15 minutes); it counts again once heard."""
    ws, _ = make_workspace(db)
    gpus_report(db, ws, NOW, 139 * GIB, 139 * GIB)
    paused(db, ws, "ghost", footprint=30 * GIB, priority=HIGH)  # heard at NOW
    assert queue(db, ws, "ghost", now=NOW).wait.state == "waiting"
    later = NOW + STALE + 10  # ghost is silent by then
    placed = place(db, ws, 10 * GIB, 0, memory_bytes=10 * GIB, priority=NORMAL, now=later).placement
    assert placed.state == "placed" and placed.placed_uuid == "GPU-0001", placed.note
    assert waits(db, ws, later)["ghost"].state == "waiting"
    # Heard again, it is ahead of a later placement as before.
    paused(db, ws, "heard", footprint=131 * GIB, priority=HIGH, now=later)
    assert queue(db, ws, "heard", now=later).wait.state == "waiting"
    behind = place(db, ws, 10 * GIB, 0, memory_bytes=10 * GIB, priority=NORMAL, now=later + 1).placement
    assert behind.state == "waiting" and "a job before it in the queue waits for it" in (behind.note or ""), behind


def test_the_report_a_placement_brings_serves_the_paused_jobs_waiting_before_it_first(db: Database) -> None:
    """flexium run's request stores its host's GPUs: the queue's pass over them runs before the placements',
    so that a later job of the same priority does not take the room an earlier paused one fits in."""
    ws, _ = make_workspace(db)
    gpus_report(db, ws, NOW, 140 * GIB)
    paused(db, ws, "earlier", footprint=30 * GIB, visible_gpus=["GPU-0000"])
    assert queue(db, ws, "earlier").wait.state == "waiting"
    out = place(db, ws, 100 * GIB, memory_bytes=30 * GIB, now=NOW + 1)  # the report shows 40 GiB free
    assert [done.wait.process_id for done in out.queued.dispatched] == ["earlier"]
    assert out.placement.state == "waiting"


def test_paused_jobs_and_placements_are_numbered_in_one_queue(db: Database) -> None:
    """The queue's one order (a higher priority first, first come first served within one) numbers the paused
    jobs' waits and flexium run's placements of a host together: no two say they are next."""
    ws, _ = make_workspace(db)
    paused(db, ws, "paused-normal", footprint=100 * GIB, priority=NORMAL)
    assert queue(db, ws, "paused-normal", now=NOW).wait.position == 1
    high = place(db, ws, 130 * GIB, 130 * GIB, memory_bytes=100 * GIB, priority=HIGH, now=NOW + 1).placement
    low = place(db, ws, 130 * GIB, 130 * GIB, memory_bytes=100 * GIB, priority=LOW, now=NOW + 2).placement
    assert (high.position, low.position) == (1, 3)
    [listed_wait] = db.run(storage.list_waits, write=False, workspace_id=ws, now=NOW + 3)
    listed = db.run(storage.list_placements, write=False, workspace_id=ws, actor=admin(ws), now=NOW + 3)
    assert listed_wait.position == 2 and [(p.id, p.position) for p in listed] == [(high.id, 1), (low.id, 3)]
    assert waits(db, ws)["paused-normal"].position == 2
