"""A command's life in storage: delivery, redelivery, reports and what they leave the process
in, listing, and what the sweep expires, fails and forgets; on SQLite and PostgreSQL."""

from __future__ import annotations

from typing import Any

import pytest
from sqlalchemy import event

from flexium import wire
from flexium.server import errors, storage
from flexium.server.db import Database
from support.server import GIB
from support.storage import (
    NOW,
    STALE,
    add_process,
    make_command,
    make_workspace,
    next_for,
    report,
    sweep_at,
)


def test_delivery_redelivery_and_lifecycle(db: Database) -> None:
    ws, _ = make_workspace(db)
    add_process(db, ws)
    assert next_for(db, ws) == (None, False)
    cmd = make_command(db, ws, "migrate", target=2)
    got, first = next_for(db, ws, now=NOW + 0.01)
    assert first and got.id == cmd.id and got.state == "delivered" and got.deliveries == 1
    again, first = next_for(db, ws, now=NOW + 5)  # never acknowledged: handed out again
    assert not first and again.id == cmd.id and again.deliveries == 2
    assert again.delivered_at == NOW + 0.01
    running, proc, changed = report(db, ws, cmd.id, "running", now=NOW + 6)
    assert changed and running.state == "running" and proc.state == "MIGRATING"
    assert next_for(db, ws) == (None, False)  # running: not handed out again
    result = {"kind": "migrate", "path": "driver", "ok": True, "seconds": 1.25, "steps": []}
    done, proc, changed = report(db, ws, cmd.id, "succeeded", now=NOW + 8, result=result)
    assert done.state == "succeeded" and done.result == wire.OperationReport.model_validate(result)
    assert done.finished_at == NOW + 8
    assert proc.state == "RUNNING" and proc.gpu_uuid == "GPU-0002" and proc.gpu_index == 2
    assert proc.active_command is None
    # a retry of the same report is harmless; a contradicting one is refused
    assert report(db, ws, cmd.id, "succeeded", now=NOW + 9)[2] is False
    assert report(db, ws, cmd.id, "running", now=NOW + 9)[2] is False
    with pytest.raises(errors.InvalidState):
        report(db, ws, cmd.id, "failed", now=NOW + 9)
    # and the process can take the next command
    assert make_command(db, ws, "pause", now=NOW + 10).state == "queued"


def test_pause_resume_settle_process(db: Database) -> None:
    ws, _ = make_workspace(db)
    add_process(db, ws, memory=12 * GIB)
    pause = make_command(db, ws, "pause")
    next_for(db, ws)
    _, proc, _ = report(db, ws, pause.id, "succeeded", now=NOW + 1)
    assert proc.state == "PAUSED" and proc.memory_bytes == 0 and proc.footprint_bytes == 12 * GIB
    assert proc.gpu_uuid == "GPU-0000" and proc.physical_device == "cuda:0"  # paused from it, not None
    resume = make_command(db, ws, "resume", now=NOW + 2)
    assert resume.target_uuid == "GPU-0000"
    next_for(db, ws)
    _, proc, _ = report(db, ws, resume.id, "failed", now=NOW + 3, error="restore failed")
    assert proc.state == "PAUSED"
    resume = make_command(db, ws, "resume", target=3, now=NOW + 4)
    _, proc, _ = report(db, ws, resume.id, "succeeded", now=NOW + 5, process={"memory_bytes": 12 * GIB})
    assert proc.state == "RUNNING" and proc.gpu_uuid == "GPU-0003" and proc.physical_device == "cuda:3"
    assert proc.memory_bytes == 12 * GIB


def test_failed_migration_stays_on_source(db: Database) -> None:
    ws, _ = make_workspace(db)
    add_process(db, ws)
    cmd = make_command(db, ws, "migrate", target=1)
    report(db, ws, cmd.id, "running")
    done, proc, _ = report(
        db,
        ws,
        cmd.id,
        "failed",
        error="cuCheckpointProcessRestore failed: CUDA_ERROR_INVALID_VALUE",
        result={"failed_step": "restore", "ok": False},
    )
    assert done.error.startswith("cuCheckpoint") and proc.gpu_uuid == "GPU-0000"
    assert proc.state == "RUNNING"


def test_commands_of_other_workspace_not_found(db: Database) -> None:
    ws_a, _ = make_workspace(db, "a")
    ws_b, _ = make_workspace(db, "b")
    add_process(db, ws_a)
    cmd = make_command(db, ws_a, "pause")
    with pytest.raises(errors.NotFound):
        db.run(storage.get_command, write=False, workspace_id=ws_b, command_id=cmd.id)
    with pytest.raises(errors.NotFound):
        report(db, ws_b, cmd.id, "running")
    assert next_for(db, ws_b) == (None, False)
    with pytest.raises(errors.NotFound):
        db.run(storage.peek_command, write=False, workspace_id=ws_b, process_id="gpu-1")
    assert db.run(storage.peek_command, write=False, workspace_id=ws_a, process_id="gpu-1") == ("node1", cmd.id)
    assert db.run(storage.list_commands, write=False, workspace_id=ws_b) == []


def test_list_commands_paging_and_filters(db: Database) -> None:
    ws, _ = make_workspace(db)
    for i in range(5):
        add_process(db, ws, f"gpu-{i}")
        make_command(db, ws, "pause", f"gpu-{i}")
    page = db.run(storage.list_commands, write=False, workspace_id=ws, limit=2)
    assert [c.process_id for c in page] == ["gpu-4", "gpu-3"]
    rest = db.run(storage.list_commands, write=False, workspace_id=ws, before_id=page[-1].id)
    assert [c.process_id for c in rest] == ["gpu-2", "gpu-1", "gpu-0"]
    assert len(db.run(storage.list_commands, write=False, workspace_id=ws, process_id="gpu-2")) == 1
    assert db.run(storage.count_commands, write=False)["queued"] == 5


def test_sweep_expires_old_queued_commands(db: Database) -> None:
    ws, _ = make_workspace(db)
    add_process(db, ws)
    cmd = make_command(db, ws, "pause")
    assert sweep_at(db, NOW + 60).expired == []
    result = sweep_at(db, NOW + 121)
    assert [c.id for _ws, c in result.expired] == [cmd.id]
    got = db.run(storage.get_command, write=False, workspace_id=ws, command_id=cmd.id)
    assert got.state == "expired" and "not started" in got.error
    assert next_for(db, ws) == (None, False)
    # a late report of a process that did act is still taken
    done, proc, changed = report(db, ws, cmd.id, "succeeded", now=NOW + 122)
    assert changed and done.state == "succeeded" and proc.state == "PAUSED"


def test_sweep_removes_silent_processes_but_not_after_restart(db: Database) -> None:
    ws, _ = make_workspace(db)
    add_process(db, ws, "gone", now=NOW)
    add_process(db, ws, "alive", now=NOW + 700)
    make_command(db, ws, "pause", "gone", now=NOW)
    # the server just restarted: silence from before it started does not count
    assert sweep_at(db, NOW + 701, alive_since=NOW + 690).removed == []
    result = sweep_at(db, NOW + 701, alive_since=NOW)
    assert result.removed == [(ws, "gone")]
    names = [
        p.process_id
        for p in db.run(storage.list_processes, write=False, workspace_id=ws, now=NOW + 701, stale_after=STALE)
    ]
    assert names == ["alive"]
    assert db.run(storage.list_commands, write=False, workspace_id=ws) == []


def test_sweep_fails_running_commands_of_dead_processes(db: Database) -> None:
    ws, _ = make_workspace(db)
    add_process(db, ws, now=NOW)
    cmd = make_command(db, ws, "pause")
    report(db, ws, cmd.id, "running", now=NOW)
    assert sweep_at(db, NOW + 100).failed == []  # still within the command's time
    result = sweep_at(db, NOW + 200)
    assert [c.id for _w, c in result.failed] == [cmd.id]


def test_sweep_reports_newly_stale_once(db: Database) -> None:
    ws, _ = make_workspace(db)
    add_process(db, ws, now=NOW)
    assert sweep_at(db, NOW + 29, stale_since=NOW + 27).newly_stale == []
    first = sweep_at(db, NOW + 31, stale_since=NOW + 29).newly_stale
    assert [p.process_id for _w, p in first] == ["gpu-1"] and first[0][1].state == "STALE"
    assert sweep_at(db, NOW + 33, stale_since=NOW + 31).newly_stale == []


def test_the_sweep_reads_what_newly_stale_processes_share_once_a_workspace(db: Database) -> None:
    """Reads that do not grow with the processes gone STALE at once (a rack that lost its network):
    the same for 2 processes as for 40, over two workspaces, each shown as the API shows it."""

    def selects_of_a_sweep(processes: int, at: float) -> tuple[int, list[tuple[int, wire.ProcessInfo]]]:
        for n in range(processes):
            add_process(db, workspaces[n % 2], f"gpu-{at:.0f}-{n}", host=f"node-{n % 3}", now=at)
        statements: list[str] = []

        def count(*args: Any) -> None:
            statements.append(args[2])

        event.listen(db.engine, "before_cursor_execute", count)
        try:
            stale = sweep_at(db, at + 31, stale_since=at + 29).newly_stale
        finally:
            event.remove(db.engine, "before_cursor_execute", count)
        return len([s for s in statements if s.lstrip().upper().startswith("SELECT")]), stale

    workspaces = [make_workspace(db, "a")[0], make_workspace(db, "b")[0]]
    few, stale_few = selects_of_a_sweep(2, NOW)
    many, stale_many = selects_of_a_sweep(40, NOW + 1000)
    assert len(stale_few) == 2 and len(stale_many) == 40
    assert many == few, (few, many)
    expected = {(workspaces[n % 2], f"gpu-{NOW + 1000:.0f}-{n}", f"node-{n % 3}", "STALE") for n in range(40)}
    assert {(ws, p.process_id, p.host, p.state) for ws, p in stale_many} == expected


def test_a_late_report_of_an_expired_command_leaves_a_newer_command_in_charge(db: Database) -> None:
    """The migrate expired, a pause is under way: the migrate's late failure ends the migrate, and the
    process stays as the pause says (PAUSING), not RUNNING."""
    ws, _ = make_workspace(db)
    add_process(db, ws)
    old = make_command(db, ws, "migrate", target=2)
    next_for(db, ws, now=NOW + 1)
    add_process(db, ws, now=NOW + 100)  # it keeps beating
    sweep_at(db, NOW + 125)
    assert db.run(storage.get_command, write=False, workspace_id=ws, command_id=old.id).state == "expired"
    pause = make_command(db, ws, "pause", now=NOW + 126)
    next_for(db, ws, now=NOW + 127)
    assert report(db, ws, pause.id, "running", now=NOW + 128)[1].state == "PAUSING"
    ended, proc, changed = report(db, ws, old.id, "failed", now=NOW + 129, error="late")
    assert changed and ended.state == "failed" and proc is not None and proc.state == "PAUSING"
