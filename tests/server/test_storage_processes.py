"""Processes in storage: registration, heartbeats and what they change, staleness, workspaces,
GPU reports, and many writers at once; on SQLite and PostgreSQL."""

from __future__ import annotations

import threading
import time
from typing import Any

import pytest
from sqlalchemy import text

from flexium import wire
from flexium.server import errors, storage
from flexium.server.db import Database
from support.server import GIB, gpu, process_body
from support.storage import (
    NOW,
    STALE,
    add_process,
    all_at_once,
    make_command,
    make_workspace,
    sweep_at,
)


def test_register_is_an_upsert(db: Database) -> None:
    ws, _ = make_workspace(db)
    first = add_process(db, ws)
    assert first.state == "RUNNING" and first.footprint_bytes == 10 * GIB
    body = process_body("gpu-1", memory=12 * GIB)
    body["footprint_bytes"] = None
    again, created = db.run(
        storage.register_process,
        write=True,
        workspace_id=ws,
        report=wire.RegisterRequest.model_validate(body),
        now=NOW + 5,
        stale_after=STALE,
    )
    assert not created and again.memory_bytes == 12 * GIB and again.registered_at == NOW
    assert again.last_seen == NOW + 5
    assert len(db.run(storage.list_processes, write=False, workspace_id=ws, now=NOW, stale_after=STALE)) == 1


def test_heartbeat_updates_and_reports_changes(db: Database) -> None:
    ws, _ = make_workspace(db)
    add_process(db, ws)
    out = db.run(
        storage.heartbeat,
        write=True,
        workspace_id=ws,
        process_id="gpu-1",
        report=wire.HeartbeatRequest.model_validate({"memory_bytes": 10 * GIB}),
        now=NOW + 1,
        stale_after=STALE,
    )
    assert out.changed is None and out.pending_command is None and out.host == "node1"
    out = db.run(
        storage.heartbeat,
        write=True,
        workspace_id=ws,
        process_id="gpu-1",
        report=wire.HeartbeatRequest.model_validate({"memory_bytes": 11 * GIB, "state": "RUNNING"}),
        now=NOW + 2,
        stale_after=STALE,
    )
    assert out.changed is not None and out.changed.memory_bytes == 11 * GIB
    with pytest.raises(errors.NotFound):
        db.run(
            storage.heartbeat,
            write=True,
            workspace_id=ws,
            process_id="nope",
            report=wire.HeartbeatRequest.model_validate({}),
            now=NOW,
            stale_after=STALE,
        )


def test_heartbeat_built_before_a_concurrent_report_loses_to_it(db: Database) -> None:
    """A beat that read the process before a report committed must not write back the state
    the report replaced (PostgreSQL runs them side by side: the beat waits for the row)."""
    ws, _ = make_workspace(db)
    add_process(db, ws, seq=10)
    cmd = make_command(db, ws, "pause")
    db.run(storage.next_command, write=True, workspace_id=ws, process_id="gpu-1", now=NOW + 1)
    db.run(
        storage.report_command,
        write=True,
        workspace_id=ws,
        command_id=cmd.id,
        now=NOW + 1,
        stale_after=STALE,
        report=wire.CommandReport(state="running"),
    )
    beat_done = threading.Event()

    def older_beat() -> None:
        db.run(
            storage.heartbeat,
            write=True,
            workspace_id=ws,
            process_id="gpu-1",
            report=wire.HeartbeatRequest.model_validate({"state": "RUNNING", "seq": 100}),
            now=NOW + 2,
            stale_after=STALE,
        )
        beat_done.set()

    beat = threading.Thread(target=older_beat)
    with db.session(write=True) as session:
        storage.report_command(
            session=session,
            workspace_id=ws,
            command_id=cmd.id,
            now=NOW + 2,
            stale_after=STALE,
            report=wire.CommandReport.model_validate(
                {"state": "succeeded", "process": {"state": "PAUSED", "seq": 200}}
            ),
        )
        beat.start()
        assert not beat_done.wait(0.3)  # the report holds the row until it commits
    beat.join(10)
    assert beat_done.is_set()
    proc = db.run(storage.get_process, write=False, workspace_id=ws, process_id="gpu-1", now=NOW + 2, stale_after=STALE)
    assert proc.state == "PAUSED"


def test_a_heartbeat_that_changes_the_gpus_a_process_holds_memory_on_is_a_change(db: Database) -> None:
    """The dashboard re-renders a process on a change heartbeats publish: a process that takes
    memory on a second GPU (or leaves it) is one, though its total stays the same."""
    ws, _ = make_workspace(db)
    add_process(db, ws, "dp", memory=5 * GIB, devices=[gpu(0, used=5 * GIB), gpu(1)])

    def beat(held: dict[int, int]) -> Any:
        devices = [gpu(i, used=held.get(i, 0)) for i in (0, 1)]
        for i, n in held.items():
            devices[i]["process_bytes"] = n
        return db.run(
            storage.heartbeat,
            write=True,
            workspace_id=ws,
            process_id="dp",
            report=wire.HeartbeatRequest.model_validate({"memory_bytes": 5 * GIB, "devices": devices}),
            now=NOW + 1,
            stale_after=STALE,
        ).changed

    assert beat({0: 5 * GIB}) is None  # as registered
    changed = beat({0: 3 * GIB, 1: 2 * GIB})
    assert changed is not None and changed.other_gpus == ["GPU-0001"]
    assert beat({0: 4 * GIB, 1: 1 * GIB}) is None  # the same GPUs
    changed = beat({0: 5 * GIB})
    assert changed is not None and changed.other_gpus == []


def test_stale_shown_and_filtered(db: Database) -> None:
    ws, _ = make_workspace(db)
    add_process(db, ws, "gpu-1", now=NOW)
    add_process(db, ws, "gpu-2", now=NOW + 40)
    procs = db.run(storage.list_processes, write=False, workspace_id=ws, now=NOW + 45, stale_after=STALE)
    assert {p.process_id: p.state for p in procs} == {"gpu-1": "STALE", "gpu-2": "RUNNING"}
    stale = db.run(storage.list_processes, write=False, workspace_id=ws, now=NOW + 45, stale_after=STALE, state="STALE")
    assert [p.process_id for p in stale] == ["gpu-1"]
    counts = db.run(storage.count_processes, write=False, now=NOW + 45, stale_after=STALE)
    assert counts["STALE"] == 1 and counts["RUNNING"] == 1


def test_stale_strictly_after_stale_after_in_every_reading(db: Database) -> None:
    """Silent for exactly ``stale_after`` is not yet STALE, a moment more is: the listing, its filters, the
    counts, the GPU cards' flexium memory, a workspace's deletion and the sweep's announcement agree, and
    the host's GPU report (sent with the beat) is held to the same rule."""
    ws, _ = make_workspace(db)
    add_process(db, ws, "gpu-1", now=NOW, devices=[gpu(0, used=30 * GIB)], memory=20 * GIB)

    def readings(now: float) -> dict[str, Any]:
        def listed(state: str | None) -> list[str]:
            found = db.run(
                storage.list_processes, write=False, workspace_id=ws, now=now, stale_after=STALE, state=state
            )
            return [p.process_id for p in found]

        hosts = db.run(storage.list_devices, write=False, workspace_id=ws, now=now, stale_after=STALE).hosts
        heard = db.run(
            storage.delete_workspace, write=True, name="team", now=now, stale_after=STALE, force=True, dry_run=True
        ).heard
        return {
            "shown": db.run(
                storage.get_process, write=False, workspace_id=ws, process_id="gpu-1", now=now, stale_after=STALE
            ).state,
            "stale": listed("STALE"),
            "running": listed("RUNNING"),
            "counted_stale": db.run(storage.count_processes, write=False, now=now, stale_after=STALE)["STALE"],
            "flexium_memory": hosts[0].devices[0].memory_flexium,
            "host_stale": hosts[0].stale,
            "heard": [process_id for process_id, _host in heard],
        }

    assert readings(NOW + STALE) == {
        "shown": "RUNNING",
        "stale": [],
        "running": ["gpu-1"],
        "counted_stale": 0,
        "flexium_memory": 20 * GIB,
        "host_stale": False,
        "heard": ["gpu-1"],
    }
    assert readings(NOW + STALE + 0.5) == {
        "shown": "STALE",
        "stale": ["gpu-1"],
        "running": [],
        "counted_stale": 1,
        "flexium_memory": 0,
        "host_stale": True,
        "heard": [],
    }
    assert sweep_at(db, NOW + STALE, stale_since=NOW + STALE - 1).newly_stale == []
    announced = sweep_at(db, NOW + STALE + 0.5, stale_since=NOW + STALE).newly_stale
    assert [p.process_id for _ws, p in announced] == ["gpu-1"]


def test_processes_are_scoped_to_workspace(db: Database) -> None:
    ws_a, _ = make_workspace(db, "a")
    ws_b, _ = make_workspace(db, "b")
    add_process(db, ws_a, "gpu-1")
    add_process(db, ws_b, "gpu-1", host="other")  # same id, other workspace: a different process
    assert (
        db.run(storage.get_process, write=False, workspace_id=ws_b, process_id="gpu-1", now=NOW, stale_after=STALE).host
        == "other"
    )
    add_process(db, ws_a, "gpu-9")
    with pytest.raises(errors.NotFound):
        db.run(storage.get_process, write=False, workspace_id=ws_b, process_id="gpu-9", now=NOW, stale_after=STALE)


def test_devices_grouped_with_flexium_memory(db: Database) -> None:
    ws, _ = make_workspace(db)
    devices = [gpu(0, used=30 * GIB), gpu(1, used=5 * GIB), gpu(2)]
    add_process(db, ws, "gpu-1", gpu_index=0, memory=20 * GIB, devices=devices)
    add_process(db, ws, "gpu-2", gpu_index=0, memory=8 * GIB, devices=devices)
    add_process(db, ws, "gpu-3", host="node2", gpu_index=1, memory=1 * GIB, n_gpus=2)
    out = db.run(storage.list_devices, write=False, workspace_id=ws, now=NOW, stale_after=STALE)
    assert [h.host for h in out.hosts] == ["node1", "node2"]
    d0 = out.hosts[0].devices[0]
    assert d0.memory_flexium == 28 * GIB and d0.memory_other == 2 * GIB
    assert d0.memory_free == 110 * GIB and sorted(d0.processes) == ["gpu-1", "gpu-2"]
    assert out.hosts[0].devices[1].memory_other == 5 * GIB
    assert len(out.hosts[1].devices) == 2


def test_unregister_removes_commands(db: Database) -> None:
    ws, _ = make_workspace(db)
    add_process(db, ws)
    make_command(db, ws, "pause")
    db.run(storage.unregister_process, write=True, workspace_id=ws, process_id="gpu-1", now=NOW)
    with db.session(write=False) as s:
        assert s.execute(text("SELECT count(*) FROM commands")).scalar() == 0
    with pytest.raises(errors.NotFound):
        db.run(storage.unregister_process, write=True, workspace_id=ws, process_id="gpu-1", now=NOW)


def test_jobs_of_one_host_register_at_once(db: Database) -> None:
    """Eight jobs of one host report the same GPUs at the same moment: no conflict error."""
    ws, _ = make_workspace(db)
    assert all_at_once(8, lambda i: add_process(db, ws, f"gpu-{i}", gpu_index=i, n_gpus=8)) == []
    hosts = db.run(storage.list_devices, write=False, workspace_id=ws, now=NOW, stale_after=STALE).hosts
    assert len(hosts) == 1 and len(hosts[0].devices) == 8


def test_jobs_listing_their_gpus_in_other_orders_write_them_at_once(db: Database) -> None:
    """Jobs of one host may list its GPUs in different orders: their device writes, side by side,
    must not deadlock (PostgreSQL aborts one of two transactions that lock rows crosswise)."""
    ws, _ = make_workspace(db)
    devices = [gpu(i) for i in range(8)]
    for i in range(4):
        add_process(db, ws, f"gpu-{i}", gpu_index=i, n_gpus=8)

    def beat(i: int) -> None:
        listed = devices if i % 2 else devices[::-1]
        for n in range(30):
            db.run(
                storage.heartbeat,
                write=True,
                workspace_id=ws,
                process_id=f"gpu-{i}",
                report=wire.HeartbeatRequest.model_validate({"devices": listed, "memory_bytes": n}),
                now=time.time(),
                stale_after=1e9,
            )

    assert all_at_once(4, beat) == []
    hosts = db.run(storage.list_devices, write=False, workspace_id=ws, now=time.time(), stale_after=1e9).hosts
    assert len(hosts) == 1 and len(hosts[0].devices) == 8


def test_concurrent_heartbeats_and_commands(db: Database) -> None:
    """Many threads writing at once: no 'database is locked', no lost update."""
    ws, _ = make_workspace(db)
    for i in range(8):
        add_process(db, ws, f"gpu-{i}")

    def beat(i: int) -> None:
        for n in range(25):
            db.run(
                storage.heartbeat,
                write=True,
                workspace_id=ws,
                process_id=f"gpu-{i}",
                report=wire.HeartbeatRequest.model_validate({"memory_bytes": n}),
                now=time.time(),
                stale_after=1e9,
            )
            db.run(storage.list_processes, write=False, workspace_id=ws, now=time.time(), stale_after=1e9)

    assert all_at_once(8, beat) == []
    procs = db.run(storage.list_processes, write=False, workspace_id=ws, now=time.time(), stale_after=1e9)
    assert {p.memory_bytes for p in procs} == {24}
