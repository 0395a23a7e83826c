"""Audit entries about commands name their process and command, and a job's page reads its own
entries by them; on SQLite and PostgreSQL."""

from __future__ import annotations

import time

from flexium import wire
from flexium.server import storage
from flexium.server.db import Database
from support.server import rank_body, register
from support.storage import NOW, STALE, add_process, make_workspace, next_for, sweep_at


def _admin(db: Database, token: str) -> storage.AuthInfo:
    auth = db.run(storage.authenticate, write=False, token=token, now=time.time())
    assert auth is not None
    return auth


def test_entries_of_commands_created_ended_and_refused_name_their_process_and_command(db: Database) -> None:
    ws, token = make_workspace(db)
    actor = _admin(db, token)
    add_process(db, ws, "gpu-1")
    add_process(db, ws, "gpu-2")
    [pause] = db.run(
        storage.create_commands_audited,
        write=True,
        workspace_id=ws,
        actor=actor,
        kind="pause",
        process_id="gpu-1",
        now=NOW,
        stale_after=STALE,
    )
    next_for(db, ws, "gpu-1")
    db.run(
        storage.report_command_audited,
        write=True,
        workspace_id=ws,
        actor=actor,
        command_id=pause.id,
        report=wire.CommandReport(state="succeeded"),
        now=NOW + 1,
        stale_after=STALE,
    )
    db.run(
        storage.record_command_refused,
        write=True,
        workspace_id=ws,
        actor=actor,
        request=wire.CommandRequest(kind="resume", process_id="gpu-2", target="1"),
        reason="process 'gpu-2' is RUNNING",
        now=NOW + 2,
    )
    [expiring] = db.run(
        storage.create_commands_audited,
        write=True,
        workspace_id=ws,
        actor=actor,
        kind="pause",
        process_id="gpu-2",
        now=NOW + 3,
        stale_after=STALE,
    )
    ended = sweep_at(db, NOW + 200, stale_after=1e9).expired
    db.run(storage.record_commands_finished, write=True, finished=ended, now=NOW + 200)

    entries = db.run(storage.list_audit, write=False, workspace_id=ws, limit=5)
    assert [(e.action, e.outcome, e.process_id, e.command_id) for e in reversed(entries)] == [
        ("command.created", "ok", "gpu-1", pause.id),
        ("command.finished", "succeeded", "gpu-1", pause.id),
        ("command.created", "refused", "gpu-2", None),
        ("command.created", "ok", "gpu-2", expiring.id),
        ("command.finished", "expired", "gpu-2", expiring.id),
    ]

    # what a job's page asks for: who sent its commands, and what was refused for it
    senders = db.run(
        storage.command_senders,
        write=False,
        workspace_id=ws,
        process_ids=["gpu-1"],
        command_ids=[pause.id, expiring.id],
    )
    assert list(senders) == [pause.id] and senders[pause.id].token_name == actor.token_name
    assert senders[pause.id].action == "command.created"
    refused = db.run(storage.refused_commands, write=False, workspace_id=ws, process_ids=["gpu-2"], limit=10)
    assert [(e.target, e.detail) for e in refused] == [("resume gpu-2 to 1", "process 'gpu-2' is RUNNING")]
    assert db.run(storage.refused_commands, write=False, workspace_id=ws, process_ids=["gpu-1"], limit=10) == []


def test_a_job_operation_writes_an_entry_for_each_ranks_command(db: Database) -> None:
    ws, token = make_workspace(db)
    for rank in (0, 1):
        register(db, ws, rank_body(rank), now=NOW, stale_after=STALE)
    commands = db.run(
        storage.create_commands_audited,
        write=True,
        workspace_id=ws,
        actor=_admin(db, token),
        kind="pause",
        process_id="rank-0",
        now=NOW,
        stale_after=STALE,
    )
    senders = db.run(
        storage.command_senders,
        write=False,
        workspace_id=ws,
        process_ids=["rank-0", "rank-1"],
        command_ids=[c.id for c in commands],
    )
    assert {(e.process_id, e.command_id) for e in senders.values()} == {(c.process_id, c.id) for c in commands}
    assert {c.process_id for c in commands} == {"rank-0", "rank-1"}
    other_workspace, _ = make_workspace(db, "other")
    assert (
        db.run(
            storage.command_senders,
            write=False,
            workspace_id=other_workspace,
            process_ids=["rank-0", "rank-1"],
            command_ids=[c.id for c in commands],
        )
        == {}
    )
