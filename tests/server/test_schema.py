"""The schema: migrations against the models, upgrades and downgrades that keep what is stored,
rows written by older releases, SQLite's pragmas; on SQLite and PostgreSQL."""

from __future__ import annotations

from typing import Any

import pytest
from sqlalchemy import select, text
from sqlalchemy.exc import IntegrityError

from flexium import wire
from flexium.server import errors, models, storage
from flexium.server.db import Database
from flexium.server.settings import normalize_database_url
from support.server import GIB, columns, gpu, migrate_to
from support.storage import (
    NOW,
    STALE,
    add_process,
    make_command,
    make_workspace,
)


def test_migrations_match_models(db: Database) -> None:
    from alembic.autogenerate import compare_metadata
    from alembic.migration import MigrationContext

    from flexium.server.models import Base

    with db.engine.connect() as conn:
        diff = compare_metadata(MigrationContext.configure(conn), Base.metadata)
    assert diff == []


def test_upgrade_is_idempotent(db: Database) -> None:
    db.upgrade()
    db.upgrade()
    with db.session(write=False) as s:
        assert s.execute(text("SELECT version_num FROM alembic_version")).scalar() == "0019"


def test_schema_newer_than_code_is_refused(db: Database) -> None:
    from flexium.server.db import SchemaTooNew

    with db.session(write=True) as s:
        s.execute(text("UPDATE alembic_version SET version_num = '9999'"))
    with pytest.raises(SchemaTooNew, match="9999"):
        db.upgrade()


def test_0004_moves_a_live_process_to_its_gpu_uuid_and_back(database_url: str) -> None:
    """A server upgraded with a job attached (and a command queued for it) keeps both; the
    dropped index and cuda:N come back derived. Batch mode copies the table on SQLite, where
    dropping the old one must not cascade to the commands that reference it."""
    from alembic import command

    db = Database(normalize_database_url(database_url))
    migrate_to(db, command.upgrade, "0003")
    with db.session(write=True) as s:
        s.execute(text("INSERT INTO workspaces (id, name, created_at) VALUES (1, 'team', 0)"))
        s.execute(
            text(
                'INSERT INTO processes (pk, workspace_id, process_id, host, "user", pid, gpu_uuid, gpu_model,'
                " gpu_index, logical_device, physical_device, visible_gpus, torch_version, driver_version,"
                " flexium_version, capabilities, memory_bytes, footprint_bytes, state, registered_at, last_seen,"
                " cmdline) VALUES (7, 1, 'gpu-1', 'node1', 'alice', 42, 'GPU-0002', 'NVIDIA H200', 2, 'cuda:0',"
                " 'cuda:1', :visible, '', '', '', '{}', 1024, 1024, 'RUNNING', :now, :now, '')"
            ),
            {"visible": '["GPU-0001", "GPU-0002"]', "now": NOW},
        )
        s.execute(
            text(
                'INSERT INTO devices (workspace_id, host, uuid, "index", name, memory_total, memory_used,'
                " health, updated_at) VALUES (1, 'node1', 'GPU-0002', 2, 'NVIDIA H200', 0, 0, 'ok', :now)"
            ),
            {"now": NOW},
        )
        s.execute(
            text(
                "INSERT INTO commands (workspace_id, process_pk, kind, state, created_at, deliveries)"
                " VALUES (1, 7, 'pause', 'queued', :now, 0)"
            ),
            {"now": NOW},
        )
    db.upgrade()
    assert not {"gpu_index", "physical_device"} & columns(db, "processes")
    proc = db.run(storage.get_process, write=False, workspace_id=1, process_id="gpu-1", now=NOW, stale_after=STALE)
    assert (proc.gpu_uuid, proc.gpu_index, proc.physical_device) == ("GPU-0002", 2, "cuda:1")
    assert proc.active_command is not None and proc.active_command.kind == "pause"
    with pytest.raises(IntegrityError), db.session(write=True) as s:  # the one-active-command index stays
        s.execute(
            text(
                "INSERT INTO commands (workspace_id, process_pk, kind, state, created_at, deliveries)"
                " VALUES (1, 7, 'pause', 'queued', :now, 0)"
            ),
            {"now": NOW},
        )
    migrate_to(db, command.downgrade, "0003")
    assert {"gpu_index", "physical_device"} <= columns(db, "processes")
    with db.session(write=False) as s:
        assert s.execute(text("SELECT gpu_uuid, gpu_index, physical_device FROM processes")).one() == (
            "GPU-0002",
            2,
            "cuda:0",
        )
        assert s.execute(text("SELECT count(*) FROM commands")).scalar() == 1
    db.upgrade()
    assert not {"gpu_index", "physical_device"} & columns(db, "processes")
    db.dispose()


def test_0010_names_the_process_and_command_of_the_entries_written_before_it(db: Database) -> None:
    """An upgraded server's job pages still say who sent each earlier command, and which were
    refused: the ids are read once from the entries' text; a downgrade keeps the entries."""
    from alembic import command

    ws, _ = make_workspace(db)
    migrate_to(db, command.downgrade, "0009")
    assert not {"process_id", "command_id"} & columns(db, "audit_log")
    entries = [
        ("command.created", "command 7 (migrate gpu-1.a:b)", "ok"),
        ("command.finished", "command 7 (migrate gpu-1.a:b)", "succeeded"),
        ("command.created", "resume gpu-2 to cuda:1", "refused"),
        ("command.created", "pause gpu-3 GPU by GPU 0=1", "refused"),
        ("token.issued", "token 2 (ci)", "ok"),
    ]
    with db.session(write=True) as s:
        for action, target, outcome in entries:
            s.execute(
                text(
                    "INSERT INTO audit_log (workspace_id, at, token_id, token_name, role, action, target, outcome,"
                    " detail) VALUES (:ws, :now, NULL, 'alice', 'admin', :action, :target, :outcome, '')"
                ),
                {"ws": ws, "now": NOW, "action": action, "target": target, "outcome": outcome},
            )
    db.upgrade()
    shown = db.run(storage.list_audit, write=False, workspace_id=ws, limit=len(entries))
    assert [(e.process_id, e.command_id) for e in reversed(shown)] == [
        ("gpu-1.a:b", 7),
        ("gpu-1.a:b", 7),
        ("gpu-2", None),
        ("gpu-3", None),
        (None, None),
    ]
    migrate_to(db, command.downgrade, "0009")
    with db.session(write=False) as s:
        assert s.execute(text("SELECT count(*) FROM audit_log")).scalar() == len(entries) + 1  # the workspace's
    db.upgrade()
    assert {"process_id", "command_id"} <= columns(db, "audit_log")


def test_0017_keeps_the_entries_written_before_it_by_their_class(db: Database) -> None:
    """Entries from before the audit log was kept by age keep theirs from when they were written:
    a login 90 days, a change a year; each counts once; a downgrade keeps them."""
    from alembic import command

    ws, _ = make_workspace(db)
    migrate_to(db, command.downgrade, "0016")
    assert not {"repeats", "last_at", "kept_until"} & columns(db, "audit_log")
    with db.session(write=True) as s:
        for action in ("login", "request.refused", "token.issued"):
            s.execute(
                text(
                    "INSERT INTO audit_log (workspace_id, at, token_id, token_name, role, action, target, outcome,"
                    " detail) VALUES (:ws, :now, NULL, 'alice', 'admin', :action, 'x', 'ok', '')"
                ),
                {"ws": ws, "now": NOW, "action": action},
            )
    db.upgrade()
    with db.session(write=False) as s:
        kept = dict(s.execute(text("SELECT action, kept_until - at FROM audit_log WHERE target = 'x'")).all())
        repeats = {r for (r,) in s.execute(text("SELECT repeats FROM audit_log"))}
    assert kept == {
        "login": storage.Retention().access_keep_s,
        "request.refused": storage.Retention().access_keep_s,
        "token.issued": storage.Retention().change_keep_s,
    }
    assert repeats == {1}
    migrate_to(db, command.downgrade, "0016")
    with db.session(write=False) as s:
        assert s.execute(text("SELECT count(*) FROM audit_log")).scalar() == 4  # the workspace's token too
    db.upgrade()


def test_0009_goes_back_to_0008_keeping_the_commands(db: Database) -> None:
    from alembic import command

    ws, _ = make_workspace(db)
    add_process(db, ws, "one")
    make_command(db, ws, "pause", "one")
    migrate_to(db, command.downgrade, "0008")
    assert "gpu_moves" not in columns(db, "commands")
    with db.session(write=False) as s:
        assert s.execute(text("SELECT count(*) FROM commands")).scalar() == 1
    db.upgrade()
    assert "gpu_moves" in columns(db, "commands")


def test_0008_goes_back_to_0007_keeping_processes_and_their_commands(db: Database) -> None:
    from alembic import command

    ws, _ = make_workspace(db)
    devices = [gpu(0, used=3 * GIB), gpu(1, used=2 * GIB)]
    devices[0]["process_bytes"], devices[1]["process_bytes"] = 3 * GIB, 2 * GIB
    add_process(db, ws, "dp", memory=5 * GIB, devices=devices)
    make_command(db, ws, "pause", "dp")
    migrate_to(db, command.downgrade, "0007")
    assert "gpu_bytes" not in columns(db, "processes")
    with db.session(write=False) as s:
        assert s.execute(text("SELECT count(*) FROM commands")).scalar() == 1
        assert s.execute(text("SELECT process_id FROM processes")).scalar() == "dp"
    db.upgrade()
    assert "gpu_bytes" in columns(db, "processes")
    add_process(db, ws, "dp", memory=5 * GIB, devices=devices)
    with db.session(write=False) as s:
        stored = s.scalar(select(models.Process.gpu_bytes))
    assert stored == {"GPU-0000": 3 * GIB, "GPU-0001": 2 * GIB}


def test_rows_written_before_the_models_still_read(db: Database) -> None:
    """A command's result and a process's capabilities were free-form JSON: a stored one with
    keys of its own reads through the model, and one that does not read at all counts as none
    (a result shown as absent, capabilities as none) instead of failing every page."""
    from flexium.server.models import Command, Process

    ws, _ = make_workspace(db)
    add_process(db, ws)
    cmd = make_command(db, ws, "pause")
    with db.session(write=True) as s:
        s.get(Command, cmd.id).result = {"path": "driver", "seconds": 0.5, "from_an_old_client": {"x": [1]}}
    read = db.run(storage.get_command, write=False, workspace_id=ws, command_id=cmd.id).result
    assert read is not None and read.path == "driver" and read.seconds == 0.5 and read.kind is None
    with db.session(write=True) as s:
        s.get(Command, cmd.id).result = {"path": "driver", "seconds": "slow", "steps": "none"}
    assert db.run(storage.get_command, write=False, workspace_id=ws, command_id=cmd.id).result is None

    def set_capabilities(value: dict[str, Any]) -> wire.ProcessInfo:
        with db.session(write=True) as s:
            row = s.scalars(select(Process).where(Process.process_id == "gpu-1")).one()
            row.capabilities = value
        return db.run(storage.get_process, write=False, workspace_id=ws, process_id="gpu-1", now=NOW, stale_after=STALE)

    proc = set_capabilities({"pause_resume": True, "migration": True, "from_an_old_client": "x"})
    assert proc.capabilities.migration and proc.capabilities.fast_path is None
    proc = set_capabilities({"pause_resume": "yes", "migration": True, "problems": "none"})
    assert proc.capabilities == wire.ProcessCapabilities()
    add_process(db, ws, "gpu-2")
    with db.session(write=True) as s:
        s.scalars(select(Process).where(Process.process_id == "gpu-2")).one().capabilities = {"pause_resume": 1}
    with pytest.raises(errors.CapabilityMissing):
        make_command(db, ws, "pause", "gpu-2")


def test_sqlite_pragmas(tmp_path: Any) -> None:
    db = Database(f"sqlite:///{tmp_path / 'p.db'}")
    db.upgrade()
    with db.session(write=False) as s:
        assert s.execute(text("PRAGMA journal_mode")).scalar() == "wal"
        assert s.execute(text("PRAGMA foreign_keys")).scalar() == 1
        assert s.execute(text("PRAGMA busy_timeout")).scalar() == 30000
    db.dispose()


def test_0011_downgrade_drops_the_queue_and_keeps_the_commands(database_url: str) -> None:
    """The queue's tables and a job's priority go and come back; the commands stay, and with them
    the one-active-command rule (batch mode copies tables on SQLite)."""
    from alembic import command

    db = Database(normalize_database_url(database_url))
    db.upgrade()
    ws, _ = make_workspace(db)
    add_process(db, ws, "gpu-1", state="PAUSED", memory=0, footprint_bytes=GIB, priority=90)
    make_command(db, ws, "resume", "gpu-1")
    migrate_to(db, command.downgrade, "0010")
    assert "priority" not in columns(db, "processes") and "reason" not in columns(db, "commands")
    with db.session(write=False) as s:
        assert s.execute(text("SELECT count(*) FROM commands")).scalar() == 1
    with pytest.raises(IntegrityError), db.session(write=True) as s:
        s.execute(
            text(
                "INSERT INTO commands (workspace_id, process_pk, kind, state, created_at, deliveries)"
                " SELECT workspace_id, process_pk, 'pause', 'queued', 0, 0 FROM commands"
            )
        )
    db.upgrade()
    assert (
        db.run(
            storage.get_process, write=False, workspace_id=ws, process_id="gpu-1", now=NOW, stale_after=STALE
        ).priority
        == 50
    )
    db.dispose()


def test_0015_downgrade_drops_the_reasons_and_keeps_the_waits_and_their_room(database_url: str) -> None:
    """The columns go in place, on SQLite too: a table copy would take the reservations that refer to
    the waits with it."""
    from alembic import command

    db = Database(normalize_database_url(database_url))
    db.upgrade()
    ws, _ = make_workspace(db)
    add_process(db, ws, "gpu-1", state="PAUSED", memory=0, footprint_bytes=GIB)
    with db.session(write=True) as s:
        s.execute(
            text(
                "INSERT INTO waits (workspace_id, process_pk, host, priority, state, created_at, dispatches,"
                " requested_by, reason, why) SELECT workspace_id, pk, host, 50, 'waiting', 0, 0, 'alice', '', 'a demo'"
                " FROM processes"
            )
        )
        s.execute(
            text(
                "INSERT INTO reservations (workspace_id, host, gpu_uuid, bytes, wait_id, holder, created_at,"
                " expires_at) SELECT workspace_id, host, 'GPU-0000', 1, id, 'alice', 0, 1 FROM waits"
            )
        )
    migrate_to(db, command.downgrade, "0014")
    assert "why" not in columns(db, "waits") and "why" not in columns(db, "placements")
    with db.session(write=False) as s:
        assert s.execute(text("SELECT count(*) FROM reservations")).scalar() == 1
    db.upgrade()
    assert "why" in columns(db, "waits")
    db.dispose()
