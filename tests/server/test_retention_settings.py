"""What the server keeps follows its settings (--audit-access-keep-days, --audit-change-keep-days,
--history-keep-days, --progress-keep-days, --max-sessions-per-token), on SQLite and PostgreSQL:
the same rows the defaults keep go sooner under a shorter setting, and a token's sessions past
its bound end."""

from __future__ import annotations

import time

import pytest
from sqlalchemy import text

from flexium import wire
from flexium.server import storage
from flexium.server.db import Database
from flexium.server.settings import Settings, load_settings
from flexium.server.storage import audit, retention
from support.server import gpu
from support.storage import NOW, STALE, add_process, make_workspace, sweep_at

DAY = 86400.0
SHORT = Settings(
    audit_access_keep_days=1,
    audit_change_keep_days=2.5,
    history_keep_days=0.5,
    progress_keep_days=0.25,
    max_sessions_per_token=3,
)


def _shorten(db: Database) -> None:
    """What ``create_app`` does with the server's settings."""
    db.session_info[retention.SESSION_KEY] = retention.Retention.of(SHORT)


def _entry(db: Database, ws: int, action: str, target: str, at: float) -> None:
    db.run(
        audit.record_audit, write=True, workspace_id=ws, actor=None, action=action, target=target, outcome="ok", now=at
    )


def _kept_entries(db: Database, ws: int, fillers_at: float) -> set[str]:
    for i in range(40):  # every 20th entry written prunes
        _entry(db, ws, "test", f"filler {fillers_at} {i}", fillers_at + i)
    entries = db.run(storage.list_audit, write=False, workspace_id=ws, limit=1000)
    return {e.target for e in entries if e.target.startswith("a ")}  # not the fillers or the workspace's token


def test_a_shorter_audit_keep_prunes_sooner_entries_written_before_it_too(db: Database) -> None:
    ws, _ = make_workspace(db)
    _entry(db, ws, "login", "a login two days old", NOW - 2 * DAY)
    _entry(db, ws, "token.issued", "a change three days old", NOW - 3 * DAY)
    _entry(db, ws, "token.issued", "a change two days old", NOW - 2 * DAY)
    everything = {"a login two days old", "a change three days old", "a change two days old"}
    assert _kept_entries(db, ws, NOW) == everything  # 90 and 365 days
    _shorten(db)
    assert _kept_entries(db, ws, NOW + 100) == {"a change two days old"}  # 1 and 2.5 days
    _entry(db, ws, "login", "a login written under the shorter keep", NOW + 200)
    assert "a login written under the shorter keep" not in _kept_entries(db, ws, NOW + 200 + 1.5 * DAY)


def _gpu_samples(db: Database, ws: int) -> list[float]:
    history = db.run(storage.gpu_history, write=False, workspace_id=ws, since=0)
    return [s.at for s in history.get(("node1", "GPU-0000"), [])]


def _progress(db: Database, ws: int) -> list[float]:
    points = db.run(storage.progress_history, write=False, workspace_id=ws, process_id="gpu-1", since=0)
    return [p.at for p in points]


def test_shorter_history_and_progress_keeps_prune_sooner(db: Database) -> None:
    ws, _ = make_workspace(db)
    add_process(db, ws)
    report = [wire.GpuReport.model_validate(gpu(0))]
    db.run(storage.upsert_devices, write=True, workspace_id=ws, host="node1", devices=report, now=NOW)
    db.run(
        storage.heartbeat,
        write=True,
        workspace_id=ws,
        process_id="gpu-1",
        report=wire.HeartbeatRequest(steps=10, loss=1.0),
        now=NOW,
        stale_after=STALE,
    )
    sweep_at(db, NOW + 1, remove_after=10 * DAY)
    assert _gpu_samples(db, ws) == [NOW] and _progress(db, ws) == [NOW]
    later = NOW + 0.4 * DAY  # within a day, past a quarter of one
    sweep_at(db, later, remove_after=10 * DAY)
    assert _gpu_samples(db, ws) == [NOW] and _progress(db, ws) == [NOW]  # a day, the defaults
    _shorten(db)
    sweep_at(db, later + 1, remove_after=10 * DAY)
    assert _gpu_samples(db, ws) == [NOW]  # half a day
    assert _progress(db, ws) == []  # a quarter of one
    sweep_at(db, NOW + 0.6 * DAY, remove_after=10 * DAY)
    assert _gpu_samples(db, ws) == []


def test_a_token_holds_at_most_its_bound_of_sessions(db: Database) -> None:
    _ws, token = make_workspace(db)
    auth = db.run(storage.authenticate, write=False, token=token, now=time.time())
    assert auth is not None

    def open_sessions(count: int) -> int:
        for i in range(count):
            db.run(storage.open_session, write=True, auth=auth, how="token", now=NOW + i)
        with db.session(write=False) as s:
            held = s.execute(text("SELECT count(*) FROM dashboard_sessions WHERE token_id = :t"), {"t": auth.token_id})
            return int(held.scalar_one())

    assert open_sessions(5) == 5  # 20 by default
    _shorten(db)
    assert open_sessions(1) == 3


def test_the_keeps_are_settings_read_from_the_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("FLEXIUM_HISTORY_KEEP_DAYS", "0.5")
    monkeypatch.setenv("FLEXIUM_MAX_SESSIONS_PER_TOKEN", "3")
    settings = load_settings(audit_access_keep_days=1.0)
    assert retention.Retention.of(settings) == retention.Retention(
        access_keep_s=DAY, history_keep_s=DAY / 2, sessions_per_token=3
    )
    with pytest.raises(ValueError, match="--progress-keep-days must be a positive number of days, not 0"):
        Settings(progress_keep_days=0)
    with pytest.raises(ValueError, match="--max-sessions-per-token must be at least 1, not 0"):
        Settings(max_sessions_per_token=0)
