"""Training history for the job page's curves: the sweep samples the progress heartbeats
stored, one sample per PROGRESS_EVERY_S at most, at the report's time, pruned after a day and
gone with its process; on SQLite and PostgreSQL."""

from __future__ import annotations

from flexium import wire
from flexium.server import storage
from flexium.server.db import Database
from support.storage import NOW, STALE, add_process, make_workspace, sweep_at


def _beat(db: Database, ws: int, now: float, steps: int, loss: float | None = None) -> None:
    db.run(
        storage.heartbeat,
        write=True,
        workspace_id=ws,
        process_id="gpu-1",
        report=wire.HeartbeatRequest(steps=steps, loss=loss),
        now=now,
        stale_after=STALE,
    )


def _history(db: Database, ws: int, process_id: str = "gpu-1") -> list[storage.ProgressPoint]:
    return db.run(
        storage.progress_history, write=False, workspace_id=ws, process_id=process_id, since=NOW - 10 * 24 * 3600
    )


def test_the_sweep_samples_reported_progress_once_per_interval(db: Database) -> None:
    ws, _ = make_workspace(db)
    add_process(db, ws)
    sweep_at(db, NOW + 1)
    assert _history(db, ws) == []  # nothing reported, nothing sampled
    _beat(db, ws, NOW + 2, steps=10, loss=2.0)
    sweep_at(db, NOW + 3)
    sweep_at(db, NOW + 4)  # the same report is not sampled twice
    _beat(db, ws, NOW + 6, steps=50, loss=1.5)
    sweep_at(db, NOW + 7)  # within PROGRESS_EVERY_S of the last sample: none
    every = storage.PROGRESS_EVERY_S
    _beat(db, ws, NOW + 2 + every + 1, steps=100, loss=1.25)
    sweep_at(db, NOW + 2 + every + 2)
    history = _history(db, ws)
    assert [(p.at, p.steps, p.loss) for p in history] == [(NOW + 2, 10, 2.0), (NOW + 3 + every, 100, 1.25)]
    assert history[1].steps_per_s is not None and history[1].steps_per_s > 0


def test_samples_are_pruned_after_a_day_and_go_with_their_process(db: Database) -> None:
    ws, _ = make_workspace(db)
    add_process(db, ws)
    _beat(db, ws, NOW + 1, steps=1, loss=3.0)
    sweep_at(db, NOW + 2)
    later = NOW + storage.Retention().progress_keep_s / 2
    _beat(db, ws, later, steps=2, loss=2.0)
    sweep_at(db, later + 1, alive_since=later)
    assert len(_history(db, ws)) == 2
    last = NOW + storage.Retention().progress_keep_s + 10
    _beat(db, ws, last - 1, steps=3, loss=1.0)
    sweep_at(db, last, alive_since=later)
    assert [p.loss for p in _history(db, ws)] == [2.0, 1.0]
    db.run(storage.unregister_process, write=True, workspace_id=ws, process_id="gpu-1", now=NOW)
    add_process(db, ws)  # the same id again: a new process, no history
    assert _history(db, ws) == []
