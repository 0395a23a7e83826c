"""Draining a GPU in storage: each job on it migrated to the GPU of its host with the most room,
paused and queued where none has room or its migrate failed, named with its reason where it can be
neither; nothing placed, resumed or migrated onto a drained GPU until it is undrained; and
``migrate auto`` picking the GPU with the most room, refusing GPU by GPU. On SQLite and PostgreSQL."""

from __future__ import annotations

import pytest

from flexium import protocol, wire
from flexium.server import errors, storage
from flexium.server.db import Database
from flexium.server.policies.drain import DrainOutcome, run_drains, start_drain
from flexium.server.policies.migrate_auto import migrate_auto
from flexium.server.storage.drains import end_drain
from support.queue import HOST, admin, gpus_report, paused, queue, resumed, run, waits
from support.server import GIB, rank_body, register
from support.storage import NOW, STALE, add_process, make_command, make_workspace, next_for, report


def running(db: Database, ws: int, process_id: str, *, memory: int, gpu: int, **fields: object) -> None:
    fields.setdefault("visible_gpus", ["GPU-0000", "GPU-0001", "GPU-0002"])
    add_process(db, ws, process_id, memory=memory, gpu_index=gpu, devices=[], **fields)


def drain(
    db: Database, ws: int, gpu: int | None, now: float = NOW, reason: str = ""
) -> tuple[wire.DrainInfo, DrainOutcome]:
    started: tuple[wire.DrainInfo, DrainOutcome] = db.run(
        start_drain,
        write=True,
        workspace_id=ws,
        actor=admin(ws),
        request=wire.DrainRequest(host=HOST, gpu=gpu, reason=reason),
        now=now,
        stale_after=STALE,
    )
    return started


def sent(outcome: DrainOutcome) -> dict[str, wire.CommandInfo]:
    return {command.process_id: command for _, command in outcome.commands}


def view(db: Database, ws: int, drain_id: int, now: float = NOW) -> wire.DrainInfo:
    shown: wire.DrainInfo = db.run(
        storage.get_drain, write=False, workspace_id=ws, drain_id=drain_id, now=now, stale_after=STALE
    )
    return shown


def test_a_drain_moves_each_job_to_the_gpu_with_most_room_and_pauses_what_fits_nowhere(db: Database) -> None:
    ws, _ = make_workspace(db)
    running(db, ws, "small", memory=20 * GIB, gpu=0)
    running(db, ws, "big", memory=90 * GIB, gpu=0)
    running(db, ws, "cpu-side", memory=10 * GIB, gpu=1)
    # GPU 0 holds both, GPU 1 has 100 GiB free, GPU 2 60 GiB.
    gpus_report(db, ws, NOW, 110 * GIB, 40 * GIB, 80 * GIB)
    info, outcome = drain(db, ws, 0, reason="the ECC errors on GPU 0")
    commands = sent(outcome)
    # By registration order: small goes to GPU 1 (the most room); big then fits nowhere and pauses.
    assert commands["small"].kind == "migrate" and commands["small"].target_uuid == "GPU-0001"
    assert commands["big"].kind == "pause"
    assert "drain of node1:0 by alice" in (commands["small"].reason or "")
    assert "no other GPU of host 'node1' can take process 'big'" in (commands["big"].reason or "")
    assert all((c.reason or "").endswith("; why: the ECC errors on GPU 0") for c in commands.values())
    assert "cpu-side" not in commands
    assert info.state == "draining" and [m.action for m in info.moves] == ["migrate", "pause"]
    assert waits(db, ws)["big"].reason.startswith("paused by the drain of node1:0")

    # Both end; the drain is done. The paused job never resumes on the drained GPU, however empty.
    report(db, ws, next_for(db, ws, "small")[0].id, "succeeded", process={"gpu_uuid": "GPU-0001"})
    report(db, ws, next_for(db, ws, "big")[0].id, "succeeded", process={"state": "PAUSED", "memory_bytes": 0})
    assert view(db, ws, info.id).state == "drained"
    gpus_report(db, ws, NOW + 5, 0, 70 * GIB, 80 * GIB)
    assert resumed(run(db, NOW + 5)) == []
    with pytest.raises(errors.TargetRefused, match="drained by alice"):
        make_command(db, ws, "migrate", "small", target="GPU-0000", now=NOW + 5)

    # Undrained, the queue resumes it there.
    db.run(end_drain, write=True, workspace_id=ws, actor=admin(ws), drain_id=info.id, now=NOW + 6, stale_after=STALE)
    gpus_report(db, ws, NOW + 7, 0, 70 * GIB, 80 * GIB)
    assert resumed(run(db, NOW + 7)) == ["big"]
    assert view(db, ws, info.id, NOW + 7).state == "ended"


def test_a_failed_migrate_is_followed_by_a_pause_and_a_job_that_cannot_move_is_named(db: Database) -> None:
    ws, _ = make_workspace(db)
    running(db, ws, "movable", memory=10 * GIB, gpu=0)
    running(db, ws, "old-driver", memory=10 * GIB, gpu=0, capabilities={"pause_resume": False, "migration": False})
    gpus_report(db, ws, NOW, 20 * GIB, 0, 0)
    info, outcome = drain(db, ws, 0)
    assert set(sent(outcome)) == {"movable"}
    refused = next(m for m in info.moves if m.process_id == "old-driver")
    assert refused.action == "refused" and "cannot be paused" in refused.note

    # The job's own room check refuses the migrate: the drain pauses it instead.
    report(db, ws, next_for(db, ws, "movable")[0].id, "failed", error="not enough room on GPU-0001")
    again: DrainOutcome = db.run(run_drains, write=True, now=NOW + 1, stale_after=STALE)
    assert [c.kind for c in sent(again).values()] == ["pause"]
    assert [m.action for m in view(db, ws, info.id, NOW + 1).moves if m.process_id == "movable"] == [
        "migrate",
        "pause",
    ]
    # Nothing more to do: a pass sends nothing twice.
    assert db.run(run_drains, write=True, now=NOW + 2, stale_after=STALE).commands == ()


def test_a_drain_is_refused_for_an_unknown_gpu_and_twice_and_a_whole_host_drain_covers_each_gpu(db: Database) -> None:
    ws, _ = make_workspace(db)
    gpus_report(db, ws, NOW, 0, 0)
    with pytest.raises(errors.InvalidRequest, match="reported no GPU '7'"):
        drain(db, ws, 7)
    info, _ = drain(db, ws, None)
    assert info.gpu_uuid is None
    with pytest.raises(errors.InvalidState, match="drained already"):
        drain(db, ws, 1)
    assert set(db.run(storage.drained_gpus, write=False, workspace_id=ws, host=HOST)) == {"GPU-0000", "GPU-0001"}
    paused(db, ws, "waiting")
    with pytest.raises(errors.TargetRefused, match="drained by alice"):
        queue(db, ws, "waiting", gpu="cuda:1")


def test_migrate_auto_picks_the_gpu_with_most_room_and_says_why_none_fits(db: Database) -> None:
    ws, _ = make_workspace(db)
    running(db, ws, "job", memory=30 * GIB, gpu=0)
    gpus_report(db, ws, NOW, 30 * GIB, 100 * GIB, 50 * GIB)

    def auto(now: float = NOW) -> list[wire.CommandInfo]:
        created: list[wire.CommandInfo] = db.run(
            migrate_auto, write=True, workspace_id=ws, actor=admin(ws), process_id="job", now=now, stale_after=STALE
        )
        return created

    command = auto()[0]
    assert command.target_uuid == "GPU-0002" and (command.reason or "").startswith("auto: GPU 2 had the most room")
    report(db, ws, next_for(db, ws, "job")[0].id, "failed", error="refused")
    drain(db, ws, 2, now=NOW + 1)
    gpus_report(db, ws, NOW + 1, 30 * GIB, 130 * GIB, 50 * GIB)
    with pytest.raises(errors.TargetRefused) as refused:
        auto(NOW + 1)
    assert "GPU 1: 10.0 GiB free of the 30.5 GiB it needs" in refused.value.message
    assert "GPU 2: drained by alice" in refused.value.message
    assert protocol.AUTO_TARGET == "auto"


def test_a_job_with_a_rank_silent_for_now_is_moved_once_it_is_heard_again(db: Database) -> None:
    """A lost heartbeat or two (or a server restart the ranks come back from one by one) is not a refusal."""
    ws, _ = make_workspace(db)
    register(db, ws, rank_body(0), now=NOW, stale_after=STALE)
    register(db, ws, rank_body(1), now=NOW - 40, stale_after=STALE)  # rank 1 late
    gpus_report(db, ws, NOW, 10 * GIB, 10 * GIB, 0, 0)
    info, outcome = db.run(
        start_drain,
        write=True,
        workspace_id=ws,
        actor=admin(ws),
        request=wire.DrainRequest(host=HOST, gpu=0),
        now=NOW,
        stale_after=STALE,
    )
    assert outcome.commands == () and [m.action for m in info.moves] == [] and info.state != "drained"
    register(db, ws, rank_body(1), now=NOW + 5, stale_after=STALE)  # heard again
    gpus_report(db, ws, NOW + 5, 10 * GIB, 10 * GIB, 0, 0)
    again = db.run(run_drains, write=True, now=NOW + 6, stale_after=STALE)
    assert again.commands != ()
