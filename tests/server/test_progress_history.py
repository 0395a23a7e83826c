"""Training progress in heartbeats (steps, steps/s, the last loss) and the GPU history, against
SQLite and PostgreSQL."""

from __future__ import annotations

import time
from typing import Any

from flexium import wire
from flexium.server import storage
from flexium.server.db import Database
from flexium.server.models import Process
from flexium.server.storage import Progress
from support.server import GIB, Api, gpu, process_body, register

NOW = 1_800_000_000.0
STALE = 30.0


def _until(condition: Any, timeout: float = 5.0) -> Any:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        value = condition()
        if value:
            return value
        time.sleep(0.05)
    return condition()


def test_steps_per_s_is_measured_between_two_reports_of_steps() -> None:
    first = Progress().after(steps=100, loss=None, now=NOW, training=True)
    assert (first.steps, first.steps_per_s) == (100, None)
    second = first.after(steps=150, loss=2.5, now=NOW + 10, training=True)
    assert (second.steps, second.steps_per_s, second.loss, second.steps_at) == (150, 5.0, 2.5, NOW + 10)
    # a beat without steps or loss keeps what was said
    assert second.after(steps=None, loss=None, now=NOW + 20, training=True) == second
    # a count that went back (a new process under the same id) starts the rate afresh
    assert second.after(steps=3, loss=None, now=NOW + 20, training=True).steps_per_s is None
    # a pause or resume between the two reports starts it afresh too
    moved = second.after(steps=150, loss=None, now=NOW + 20, training=False)
    assert (moved.steps, moved.steps_per_s, moved.steps_at) == (150, None, NOW + 20)
    assert moved.after(steps=170, loss=None, now=NOW + 30, training=True).steps_per_s == 2.0
    # the same steps again within a step at the last speed (5/s: 0.2 s) say nothing of it; later, a stall
    assert second.after(steps=150, loss=None, now=NOW + 10.1, training=True).steps_per_s == 5.0
    assert second.after(steps=150, loss=None, now=NOW + 12, training=True).steps_per_s == 0.0


def test_heartbeats_carry_steps_and_loss_to_the_process(api: Api) -> None:
    api.register()
    shown = api.get("/processes/gpu-1").json()
    assert (shown["steps"], shown["steps_per_s"], shown["loss"]) == (None, None, None)
    beat = {"state": "RUNNING", "memory_bytes": 10 * GIB, "gpu_uuid": "GPU-0000"}
    assert api.post("/processes/gpu-1/heartbeat", {**beat, "steps": 100, "loss": 2.5}).status_code == 200
    # answered from memory (progress is not a change), and written with the batched beats
    assert _until(lambda: api.get("/processes/gpu-1").json()["steps"] == 100)
    time.sleep(0.2)
    assert api.post("/processes/gpu-1/heartbeat", {**beat, "steps": 160, "loss": 1.25}).status_code == 200
    shown = _until(lambda: (p := api.get("/processes/gpu-1").json())["steps"] == 160 and p)
    assert shown["loss"] == 1.25
    assert shown["steps_per_s"] > 0
    # a move is written through, and carries its progress the same way
    assert api.post("/processes/gpu-1/heartbeat", {**beat, "gpu_uuid": "GPU-0001", "steps": 170}).status_code == 200
    shown = api.get("/processes/gpu-1").json()
    assert (shown["steps"], shown["gpu_uuid"], shown["loss"]) == (170, "GPU-0001", 1.25)


def test_the_time_of_a_move_is_no_training_speed(api: Api) -> None:
    """The reports of a move (MIGRATING, then RUNNING again at the same step) make no speed of 0 steps/s:
    the speed shows again from the next report."""
    api.register()
    beat = {"state": "RUNNING", "memory_bytes": 10 * GIB, "gpu_uuid": "GPU-0000"}
    assert api.post("/processes/gpu-1/heartbeat", {**beat, "steps": 100}).status_code == 200
    time.sleep(0.2)
    assert api.post("/processes/gpu-1/heartbeat", {**beat, "steps": 160}).status_code == 200
    assert _until(lambda: (api.get("/processes/gpu-1").json()["steps_per_s"] or 0) > 0)
    for state, gpu_uuid in (("MIGRATING", "GPU-0000"), ("RUNNING", "GPU-0001")):
        time.sleep(0.1)
        moved = {**beat, "state": state, "gpu_uuid": gpu_uuid, "steps": 160}
        assert api.post("/processes/gpu-1/heartbeat", moved).status_code == 200
        shown = api.get("/processes/gpu-1").json()
        assert (shown["state"], shown["steps"], shown["steps_per_s"]) == (state, 160, None), shown
    time.sleep(0.2)
    assert api.post("/processes/gpu-1/heartbeat", {**beat, "gpu_uuid": "GPU-0001", "steps": 180}).status_code == 200
    assert _until(lambda: (api.get("/processes/gpu-1").json()["steps_per_s"] or 0) > 0)


def _operate(api: Api, kind: str, state: str) -> None:
    created = api.command(kind, "gpu-1")
    assert created.status_code == 201, created.text
    api.client.get(f"{api.base}/processes/gpu-1/commands/next", params={"timeout": 0}, headers=api.headers())
    done = {"state": "succeeded", "result": {"kind": kind, "path": "driver", "ok": True, "seconds": 0.5}}
    assert (
        api.post(f"/commands/{created.json()['id']}/report", {**done, "process": {"state": state}}).status_code == 200
    )


def test_a_pause_is_no_training_speed_after_its_resume(api: Api) -> None:
    """The job's command reports carry its pause and its resume: the first report of steps after the resume
    measures nothing across the pause (it once read a fraction of a step a second); the next does."""
    api.register()
    beat = {"state": "RUNNING", "memory_bytes": 10 * GIB, "gpu_uuid": "GPU-0000"}
    assert api.post("/processes/gpu-1/heartbeat", {**beat, "steps": 100}).status_code == 200
    time.sleep(0.2)
    assert api.post("/processes/gpu-1/heartbeat", {**beat, "steps": 160}).status_code == 200
    _operate(api, "pause", "PAUSED")
    assert api.post("/processes/gpu-1/heartbeat", {**beat, "state": "PAUSED", "steps": 160}).status_code == 200
    time.sleep(0.5)
    _operate(api, "resume", "RUNNING")
    time.sleep(0.1)
    assert api.post("/processes/gpu-1/heartbeat", {**beat, "steps": 170}).status_code == 200
    shown = _until(lambda: (p := api.get("/processes/gpu-1").json())["steps"] == 170 and p)
    assert shown["state"] == "RUNNING" and shown["steps_per_s"] is None, shown
    time.sleep(0.2)
    assert api.post("/processes/gpu-1/heartbeat", {**beat, "steps": 230}).status_code == 200
    assert _until(lambda: (api.get("/processes/gpu-1").json()["steps_per_s"] or 0) > 100)  # 60 steps in 0.2 s


def test_a_loss_that_is_not_a_finite_number_is_refused(api: Api) -> None:
    api.register()
    r = api.client.post(
        api.base + "/processes/gpu-1/heartbeat",
        content=b'{"loss": NaN}',
        headers={**api.headers(), "Content-Type": "application/json"},
    )
    assert r.status_code == 422
    assert api.post("/processes/gpu-1/heartbeat", {"steps": -1}).status_code == 422


def test_a_registration_says_its_steps(api: Api) -> None:
    shown = api.register(steps=42, loss=0.5)["process"]
    assert (shown["steps"], shown["loss"]) == (42, 0.5)


def _workspace(db: Database) -> int:
    record, _token = db.run(storage.create_workspace, write=True, name="team", now=NOW)
    return int(record.id)


def test_a_buffered_report_never_replaces_a_newer_one(db: Database) -> None:
    ws = _workspace(db)
    register(db, ws, {**process_body("gpu-1"), "steps": 500}, now=NOW + 10, stale_after=STALE)
    with db.session(write=True) as s:
        pk = s.query(Process.pk).scalar()
    older = Progress(steps=400, steps_at=NOW + 5, steps_per_s=1.0, loss=9.0)
    db.run(storage.record_beats, write=True, beats={pk: NOW + 11}, progress={pk: older})
    with db.session(write=False) as s:
        row = s.get(Process, pk)
        assert row is not None and row.steps == 500 and row.last_seen == NOW + 11


def _report(db: Database, ws: int, now: float, used: int, utilization: int = 50) -> None:
    devices = [wire.GpuReport.model_validate({**gpu(0, used=used), "utilization": utilization}), gpu_report(1)]
    db.run(storage.upsert_devices, write=True, workspace_id=ws, host="node1", devices=devices, now=now)


def gpu_report(index: int) -> wire.GpuReport:
    return wire.GpuReport.model_validate(gpu(index))


def test_gpu_history_keeps_one_sample_a_minute_for_a_day(db: Database) -> None:
    ws = _workspace(db)
    _report(db, ws, NOW, used=1 * GIB, utilization=10)
    _report(db, ws, NOW + 30, used=2 * GIB)  # within the minute: no sample
    _report(db, ws, NOW + 61, used=3 * GIB, utilization=90)
    history = db.run(storage.gpu_history, write=False, workspace_id=ws, since=NOW - 1)
    assert set(history) == {("node1", "GPU-0000"), ("node1", "GPU-0001")}
    samples = history[("node1", "GPU-0000")]
    assert [(s.at, s.memory_used, s.utilization) for s in samples] == [(NOW, 1 * GIB, 10), (NOW + 61, 3 * GIB, 90)]
    assert samples[0].memory_total == 140 * GIB
    # the sweep keeps a day
    later = NOW + storage.Retention().history_keep_s + 30
    db.run(
        storage.sweep,
        write=True,
        now=later,
        alive_since=NOW,
        stale_after=STALE,
        remove_after=10 * storage.Retention().history_keep_s,
        command_ttl=60.0,
        stale_since=later,
        reservation_ttl=300.0,
    )
    kept = db.run(storage.gpu_history, write=False, workspace_id=ws, since=0)
    assert [s.at for s in kept[("node1", "GPU-0000")]] == [NOW + 61]


def test_0007_goes_back_to_0006_keeping_processes_and_their_commands(db: Database) -> None:
    from alembic import command
    from sqlalchemy import inspect, text

    from support.server import columns, migrate_to

    ws = _workspace(db)
    register(db, ws, {**process_body("gpu-1"), "steps": 5}, now=NOW, stale_after=STALE)
    db.run(
        storage.create_commands,
        write=True,
        workspace_id=ws,
        kind="pause",
        process_id="gpu-1",
        target=None,
        now=NOW,
        stale_after=STALE,
    )
    migrate_to(db, command.downgrade, "0006")
    assert not {"steps", "steps_at", "steps_per_s", "loss"} & columns(db, "processes")
    with db.engine.connect() as conn:
        assert "gpu_samples" not in inspect(conn).get_table_names()
    with db.session(write=False) as s:
        assert s.execute(text("SELECT count(*) FROM commands")).scalar() == 1
        assert s.execute(text("SELECT process_id FROM processes")).scalar() == "gpu-1"
    db.upgrade()
    assert {"steps", "steps_at", "steps_per_s", "loss"} <= columns(db, "processes")
    _report(db, ws, NOW, used=GIB)
    assert db.run(storage.gpu_history, write=False, workspace_id=ws, since=0)
