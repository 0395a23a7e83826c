"""Storage functions against SQLite and PostgreSQL, without HTTP."""

from __future__ import annotations

import re
import threading
import time
from typing import Any, Callable, Optional

import pytest
from sqlalchemy import select, text
from sqlalchemy.exc import IntegrityError

from flexium import wire
from flexium.server import errors, models, storage
from flexium.server.db import Database
from flexium.server.settings import normalize_database_url
from srv_helpers import GIB, columns, gpu, migrate_to, process_body, register

NOW = 1_800_000_000.0
STALE = 30.0


def _workspace(db: Database, name: str = "team") -> tuple[int, str]:
    record, token = db.run(storage.create_workspace, write=True, name=name, now=NOW)
    return record.id, token


def _register(db: Database, ws: int, process_id: str = "gpu-1", now: float = NOW, **fields: Any) -> dict[str, Any]:
    body = process_body(process_id, **fields)
    body.setdefault("footprint_bytes", None)
    proc: dict[str, Any] = register(db, ws, body, now=now, stale_after=STALE)
    return proc


def _command(
    db: Database,
    ws: int,
    kind: str,
    process_id: str = "gpu-1",
    target: Any = None,
    now: float = NOW,
    gpus: Optional[dict[str, Any]] = None,
) -> wire.CommandInfo:
    created: list[wire.CommandInfo] = db.run(
        storage.create_commands,
        write=True,
        workspace_id=ws,
        kind=kind,
        process_id=process_id,
        target=target,
        gpus=gpus,
        now=now,
        stale_after=STALE,
    )
    return created[0]


# --- schema ---------------------------------------------------------------------------------


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
        assert s.execute(text("SELECT version_num FROM alembic_version")).scalar() == "0009"


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


def test_sqlite_pragmas(tmp_path: Any) -> None:
    db = Database(f"sqlite:///{tmp_path / 'p.db'}")
    db.upgrade()
    with db.session(write=False) as s:
        assert s.execute(text("PRAGMA journal_mode")).scalar() == "wal"
        assert s.execute(text("PRAGMA foreign_keys")).scalar() == 1
        assert s.execute(text("PRAGMA busy_timeout")).scalar() == 30000
    db.dispose()


# --- workspaces and tokens ------------------------------------------------------------------


def test_workspace_tokens_hashed_and_revocable(db: Database) -> None:
    ws, token = _workspace(db)
    assert token.startswith("flx_") and len(token) > 40
    with db.session(write=False) as s:
        stored = [r[0] for r in s.execute(text("SELECT token_hash FROM tokens"))]
    assert token not in stored and storage.hash_token(token) in stored
    auth = db.run(storage.authenticate, write=False, token=token)
    assert auth is not None and auth.workspace == "team" and auth.workspace_id == ws
    created = db.run(storage.issue_token, write=True, workspace_id=ws, name="ci", now=NOW)
    second = created.token
    assert db.run(storage.authenticate, write=False, token=second).token_id == created.id
    db.run(storage.revoke_token, write=True, workspace_id=ws, token=second, now=NOW)
    assert db.run(storage.authenticate, write=False, token=second) is None
    assert db.run(storage.authenticate, write=False, token=token) is not None
    assert db.run(storage.authenticate, write=False, token="flx_nope") is None
    tokens = db.run(storage.list_tokens, write=False, workspace_id=ws)
    assert [t.revoked for t in tokens] == [False, True]


def test_workspace_names(db: Database) -> None:
    _workspace(db, "a")
    with pytest.raises(errors.Conflict):
        _workspace(db, "a")
    for bad in ("", "A", "-x", "a b", "x" * 64, "a/b"):
        with pytest.raises(errors.InvalidRequest):
            _workspace(db, bad)
    assert [w.name for w in db.run(storage.list_workspaces, write=False)] == ["a"]


def test_default_workspace_only_on_empty_database(db: Database) -> None:
    token = db.run(storage.ensure_default_workspace, write=True, now=NOW)
    assert token and db.run(storage.authenticate, write=False, token=token).workspace == "default"
    assert db.run(storage.ensure_default_workspace, write=True, now=NOW) is None


def test_revoke_token_of_other_workspace_is_not_found(db: Database) -> None:
    ws_a, _ = _workspace(db, "a")
    _ws_b, token_b = _workspace(db, "b")
    with pytest.raises(errors.NotFound):
        db.run(storage.revoke_token, write=True, workspace_id=ws_a, token=token_b, now=NOW)


# --- processes ------------------------------------------------------------------------------


def test_register_is_an_upsert(db: Database) -> None:
    ws, _ = _workspace(db)
    first = _register(db, ws)
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
    ws, _ = _workspace(db)
    _register(db, ws)
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
    ws, _ = _workspace(db)
    _register(db, ws, seq=10)
    cmd = _command(db, ws, "pause")
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


def test_stale_shown_and_filtered(db: Database) -> None:
    ws, _ = _workspace(db)
    _register(db, ws, "gpu-1", now=NOW)
    _register(db, ws, "gpu-2", now=NOW + 40)
    procs = db.run(storage.list_processes, write=False, workspace_id=ws, now=NOW + 45, stale_after=STALE)
    assert {p.process_id: p.state for p in procs} == {"gpu-1": "STALE", "gpu-2": "RUNNING"}
    stale = db.run(storage.list_processes, write=False, workspace_id=ws, now=NOW + 45, stale_after=STALE, state="STALE")
    assert [p.process_id for p in stale] == ["gpu-1"]
    counts = db.run(storage.count_processes, write=False, now=NOW + 45, stale_after=STALE)
    assert counts["STALE"] == 1 and counts["RUNNING"] == 1


def test_processes_are_scoped_to_workspace(db: Database) -> None:
    ws_a, _ = _workspace(db, "a")
    ws_b, _ = _workspace(db, "b")
    _register(db, ws_a, "gpu-1")
    _register(db, ws_b, "gpu-1", host="other")  # same id, other workspace: a different process
    assert (
        db.run(storage.get_process, write=False, workspace_id=ws_b, process_id="gpu-1", now=NOW, stale_after=STALE).host
        == "other"
    )
    _register(db, ws_a, "gpu-9")
    with pytest.raises(errors.NotFound):
        db.run(storage.get_process, write=False, workspace_id=ws_b, process_id="gpu-9", now=NOW, stale_after=STALE)


def test_devices_grouped_with_flexium_memory(db: Database) -> None:
    ws, _ = _workspace(db)
    devices = [gpu(0, used=30 * GIB), gpu(1, used=5 * GIB), gpu(2)]
    _register(db, ws, "gpu-1", gpu_index=0, memory=20 * GIB, devices=devices)
    _register(db, ws, "gpu-2", gpu_index=0, memory=8 * GIB, devices=devices)
    _register(db, ws, "gpu-3", host="node2", gpu_index=1, memory=1 * GIB, n_gpus=2)
    out = db.run(storage.list_devices, write=False, workspace_id=ws, now=NOW, stale_after=STALE)
    assert [h.host for h in out.hosts] == ["node1", "node2"]
    d0 = out.hosts[0].devices[0]
    assert d0.memory_flexium == 28 * GIB and d0.memory_other == 2 * GIB
    assert d0.memory_free == 110 * GIB and sorted(d0.processes) == ["gpu-1", "gpu-2"]
    assert out.hosts[0].devices[1].memory_other == 5 * GIB
    assert len(out.hosts[1].devices) == 2


# --- commands: validation -------------------------------------------------------------------


def test_migrate_checks(db: Database) -> None:
    ws, _ = _workspace(db)
    devices = [
        gpu(0, used=10 * GIB),
        gpu(1, used=135 * GIB),
        gpu(2, name="NVIDIA A100"),
        gpu(3, health="xid 79"),
        gpu(4),
    ]
    _register(db, ws, "gpu-1", devices=devices)
    _register(db, ws, "gpu-far", host="node2", gpu_index=0, n_gpus=1, devices=[{**gpu(0), "uuid": "GPU-far"}])
    cases = [
        ("nope", 4, errors.NotFound),
        ("gpu-1", None, errors.InvalidRequest),
        ("gpu-1", "GPU-0000", errors.TargetRefused),  # already there
        ("gpu-1", 1, errors.TargetRefused),  # no room
        ("gpu-1", "GPU-0002", errors.TargetRefused),  # other model
        ("gpu-1", "GPU-0003", errors.TargetRefused),  # unhealthy
        ("gpu-1", "GPU-far", errors.TargetRefused),  # other host
        ("gpu-1", "GPU-ffff", errors.TargetRefused),  # unknown
        ("gpu-1", 9, errors.TargetRefused),  # no such index
        ("gpu-1", "cuda:7", errors.TargetRefused),  # not visible
        ("gpu-1", "cuda:x", errors.InvalidRequest),
        ("gpu-1", "²", errors.InvalidRequest),  # str.isdigit() says yes, int() says no: not a GPU name
        ("gpu-1", "cuda:²", errors.InvalidRequest),
    ]
    for process_id, target, exc in cases:
        with pytest.raises(exc) as info:
            _command(db, ws, "migrate", process_id, target)
        assert info.value.message, (process_id, target)
    with pytest.raises(errors.TargetRefused, match="other|host"):
        _command(db, ws, "migrate", "gpu-1", "GPU-far")
    cmd = _command(db, ws, "migrate", "gpu-1", "cuda:4")
    assert cmd.state == "queued" and cmd.target_uuid == "GPU-0004"
    assert "target_index" not in cmd.model_dump() and "target_device" not in cmd.model_dump()


def test_target_text_has_one_meaning_each(db: Database) -> None:
    """cuda:N = entry N of the job's visible_gpus; a bare integer (or digits) = the nvidia-smi
    index on its host; GPU-... = a UUID. The job below sees GPU 3 as cuda:0 and GPU 1 as cuda:1."""
    ws, _ = _workspace(db)
    _register(db, ws, "gpu-1", gpu_index=3, visible_gpus=["GPU-0003", "GPU-0001", "GPU-0002"])
    proc = db.run(storage.get_process, write=False, workspace_id=ws, process_id="gpu-1", now=NOW, stale_after=STALE)
    for target, uuid in (
        ("cuda:1", "GPU-0001"),
        (2, "GPU-0002"),
        ("2", "GPU-0002"),
        ("1", "GPU-0001"),
        ("GPU-0002", "GPU-0002"),
        ("cuda:2", "GPU-0002"),
    ):
        cmd = _command(db, ws, "migrate", "gpu-1", target)
        assert cmd.target_uuid == uuid, target
        db.run(
            storage.report_command,
            write=True,
            workspace_id=ws,
            command_id=cmd.id,
            now=NOW,
            stale_after=STALE,
            report=wire.CommandReport(state="failed", error="test"),
        )
    with pytest.raises(errors.TargetRefused, match="already on it"):
        _command(db, ws, "migrate", "gpu-1", "cuda:0")
    # what is shown is derived from the UUID: the job's own ordinal, the host's index
    assert wire.cuda_ordinal(proc.visible_gpus, "GPU-0001") == "cuda:1"
    assert wire.cuda_ordinal(proc.visible_gpus, "GPU-0000") is None
    assert (proc.gpu_index, proc.physical_device) == (3, "cuda:0")  # derived: the host's index, the job's cuda:N
    assert db.run(storage.device_indexes, write=False, workspace_id=ws)["GPU-0001"] == 1


def test_unknown_health_is_a_target_known_bad_is_not(db: Database) -> None:
    ws, _ = _workspace(db)
    _register(db, ws, devices=[gpu(0, used=10 * GIB), gpu(1, health="unknown"), gpu(2, health="ecc_errors")])
    with pytest.raises(errors.TargetRefused, match="ecc_errors"):
        _command(db, ws, "migrate", target=2)
    assert _command(db, ws, "migrate", target=1).target_uuid == "GPU-0001"


def test_target_not_visible_to_process(db: Database) -> None:
    ws, _ = _workspace(db)
    _register(db, ws, "gpu-1", visible_gpus=["GPU-0000", "GPU-0001"])
    with pytest.raises(errors.TargetRefused, match="not visible"):
        _command(db, ws, "migrate", "gpu-1", 2)
    assert _command(db, ws, "migrate", "gpu-1", 1).target_uuid == "GPU-0001"


def test_state_and_capability_checks(db: Database) -> None:
    ws, _ = _workspace(db)
    _register(db, ws, "paused", state="PAUSED")
    _register(db, ws, "old-driver", migration=False, pause_resume=True)
    _register(db, ws, "no-ckpt", migration=False, pause_resume=False)
    _register(db, ws, "running")
    with pytest.raises(errors.InvalidState, match="PAUSED"):
        _command(db, ws, "pause", "paused")
    with pytest.raises(errors.InvalidState, match="resume it"):
        _command(db, ws, "migrate", "paused", 1)
    with pytest.raises(errors.InvalidState, match="RUNNING"):
        _command(db, ws, "resume", "running")
    with pytest.raises(errors.CapabilityMissing, match="migrat"):
        _command(db, ws, "migrate", "old-driver", 1)
    with pytest.raises(errors.CapabilityMissing, match="pause"):
        _command(db, ws, "pause", "no-ckpt")
    with pytest.raises(errors.InvalidRequest):
        _command(db, ws, "pause", "running", 1)
    with pytest.raises(errors.InvalidRequest):
        _command(db, ws, "explode", "running")
    assert _command(db, ws, "pause", "old-driver").kind == "pause"


def test_capability_refusal_quotes_the_process_problems(db: Database) -> None:
    ws, _ = _workspace(db)
    cpu = "flexium's engine is not running in this process (training on cpu)"
    _register(db, ws, "cpu-job", capabilities={"pause_resume": False, "migration": False, "problems": [cpu]})
    with pytest.raises(errors.CapabilityMissing) as info:
        _command(db, ws, "pause", "cpu-job")
    assert cpu in info.value.message and "driver" not in info.value.message
    _register(db, ws, "old", capabilities={"pause_resume": True, "migration": False})
    with pytest.raises(errors.CapabilityMissing, match="580"):
        _command(db, ws, "migrate", "old", 1)


def test_a_rank_that_cannot_move_with_its_job_is_refused_at_creation(
    db: Database, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The capabilities a rank of a 2-rank torchrun job reports before its process group exists
    (client/reports.py) make the server refuse its pause and migrate with the process's own reason."""
    from types import SimpleNamespace

    from flexium.cli.processes import _moves
    from flexium.client.reports import ProcessReporter
    from flexium.engine.capabilities import Capabilities
    from flexium.engine.operations import EngineState

    monkeypatch.setenv("RANK", "0")
    monkeypatch.setenv("WORLD_SIZE", "2")
    caps = Capabilities("580.159.04", 580, 13000, True, True, 2, True, True, ())
    training = SimpleNamespace(
        engine=SimpleNamespace(state=EngineState.RUNNING), logical_device="cuda:0", capabilities=caps, memory_pool=None
    )
    reported = ProcessReporter(training).capabilities()  # type: ignore[arg-type]
    assert _moves(reported) == "-"
    ws, _ = _workspace(db)
    _register(db, ws, "rank-0", capabilities=reported.model_dump(mode="json"))
    for kind, target in (("pause", None), ("migrate", 1)):
        with pytest.raises(errors.CapabilityMissing) as info:
            _command(db, ws, kind, "rank-0", target)
        assert info.value.message.startswith(f"process 'rank-0' cannot {kind}: it reports no ")
        assert "this process is rank 0 of 2 of a torch.distributed job" in info.value.message
        assert "the job cannot be paused or moved as a whole: the job has not started its process group" in (
            info.value.message
        )
        assert "driver" not in info.value.message


def test_stale_process_refuses_commands(db: Database) -> None:
    ws, _ = _workspace(db)
    _register(db, ws, now=NOW)
    with pytest.raises(errors.Stale):
        _command(db, ws, "pause", now=NOW + STALE + 1)


def test_one_active_command_per_process(db: Database) -> None:
    ws, _ = _workspace(db)
    _register(db, ws)
    first = _command(db, ws, "pause")
    with pytest.raises(errors.Busy) as info:
        _command(db, ws, "migrate", target=1)
    assert info.value.detail == {"command_id": first.id}


def test_one_active_command_under_concurrency(db: Database) -> None:
    ws, _ = _workspace(db)
    _register(db, ws)
    outcomes: list[str] = []
    barrier = threading.Barrier(6)

    def attempt() -> None:
        barrier.wait()
        try:
            _command(db, ws, "pause")
            outcomes.append("ok")
        except errors.Busy:
            outcomes.append("busy")
        except Exception as exc:  # an IntegrityError here would be a 500 at the API
            outcomes.append(type(exc).__name__)

    threads = [threading.Thread(target=attempt) for _ in range(6)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert sorted(outcomes) == ["busy"] * 5 + ["ok"]


def test_resume_target_choice(db: Database) -> None:
    ws, _ = _workspace(db)
    # paused from GPU 0, which is now full: resume goes to the emptiest same-model GPU
    devices = [gpu(0, used=139 * GIB), gpu(1, used=50 * GIB), gpu(2, used=20 * GIB), gpu(3, name="NVIDIA A100")]
    _register(db, ws, "p", state="PAUSED", memory=0, footprint_bytes=30 * GIB, devices=devices)
    assert _command(db, ws, "resume", "p").target_uuid == "GPU-0002"
    # room on its own GPU: resume there
    _register(db, ws, "q", state="PAUSED", memory=0, footprint_bytes=30 * GIB, host="n2", n_gpus=2)
    assert _command(db, ws, "resume", "q").target_uuid == "GPU-0000"
    # cannot migrate and its GPU is full: refused
    _register(
        db,
        ws,
        "r",
        state="PAUSED",
        memory=0,
        footprint_bytes=30 * GIB,
        migration=False,
        host="n3",
        devices=[gpu(0, used=139 * GIB), gpu(1)],
    )
    with pytest.raises(errors.TargetRefused):
        _command(db, ws, "resume", "r")
    # explicit other GPU needs migration
    with pytest.raises(errors.CapabilityMissing):
        _command(db, ws, "resume", "r", 1)
    # explicit GPU without room
    _register(
        db,
        ws,
        "s",
        state="PAUSED",
        memory=0,
        footprint_bytes=30 * GIB,
        host="n4",
        devices=[gpu(0), gpu(1, used=139 * GIB)],
    )
    with pytest.raises(errors.TargetRefused, match="free"):
        _command(db, ws, "resume", "s", 1)


def test_resume_without_device_reports_lets_process_choose(db: Database) -> None:
    ws, _ = _workspace(db)
    _register(db, ws, "p", state="PAUSED", memory=0, devices=[])
    cmd = _command(db, ws, "resume", "p")
    assert cmd.target_uuid is None


# --- commands: delivery and reports ---------------------------------------------------------


def _next(db: Database, ws: int, process_id: str = "gpu-1", now: float = NOW) -> Any:
    return db.run(storage.next_command, write=True, workspace_id=ws, process_id=process_id, now=now)


def _report(db: Database, ws: int, command_id: int, state: str, now: float = NOW, **extra: Any) -> Any:
    return db.run(
        storage.report_command,
        write=True,
        workspace_id=ws,
        command_id=command_id,
        report=wire.CommandReport.model_validate({"state": state, **extra}),
        now=now,
        stale_after=STALE,
    )


def test_delivery_redelivery_and_lifecycle(db: Database) -> None:
    ws, _ = _workspace(db)
    _register(db, ws)
    assert _next(db, ws) == (None, False)
    cmd = _command(db, ws, "migrate", target=2)
    got, first = _next(db, ws, now=NOW + 0.01)
    assert first and got.id == cmd.id and got.state == "delivered" and got.deliveries == 1
    again, first = _next(db, ws, now=NOW + 5)  # never acknowledged: handed out again
    assert not first and again.id == cmd.id and again.deliveries == 2
    assert again.delivered_at == NOW + 0.01
    running, proc, changed = _report(db, ws, cmd.id, "running", now=NOW + 6)
    assert changed and running.state == "running" and proc.state == "MIGRATING"
    assert _next(db, ws) == (None, False)  # running: not handed out again
    result = {"kind": "migrate", "path": "driver", "ok": True, "seconds": 1.25, "steps": []}
    done, proc, changed = _report(db, ws, cmd.id, "succeeded", now=NOW + 8, result=result)
    assert done.state == "succeeded" and done.result == wire.OperationReport.model_validate(result)
    assert done.finished_at == NOW + 8
    assert proc.state == "RUNNING" and proc.gpu_uuid == "GPU-0002" and proc.gpu_index == 2
    assert proc.active_command is None
    # a retry of the same report is harmless; a contradicting one is refused
    assert _report(db, ws, cmd.id, "succeeded", now=NOW + 9)[2] is False
    assert _report(db, ws, cmd.id, "running", now=NOW + 9)[2] is False
    with pytest.raises(errors.InvalidState):
        _report(db, ws, cmd.id, "failed", now=NOW + 9)
    # and the process can take the next command
    assert _command(db, ws, "pause", now=NOW + 10).state == "queued"


def test_pause_resume_settle_process(db: Database) -> None:
    ws, _ = _workspace(db)
    _register(db, ws, memory=12 * GIB)
    pause = _command(db, ws, "pause")
    _next(db, ws)
    _, proc, _ = _report(db, ws, pause.id, "succeeded", now=NOW + 1)
    assert proc.state == "PAUSED" and proc.memory_bytes == 0 and proc.footprint_bytes == 12 * GIB
    assert proc.gpu_uuid == "GPU-0000" and proc.physical_device == "cuda:0"  # paused from it, not None
    resume = _command(db, ws, "resume", now=NOW + 2)
    assert resume.target_uuid == "GPU-0000"
    _next(db, ws)
    _, proc, _ = _report(db, ws, resume.id, "failed", now=NOW + 3, error="restore failed")
    assert proc.state == "PAUSED"
    resume = _command(db, ws, "resume", target=3, now=NOW + 4)
    _, proc, _ = _report(db, ws, resume.id, "succeeded", now=NOW + 5, process={"memory_bytes": 12 * GIB})
    assert proc.state == "RUNNING" and proc.gpu_uuid == "GPU-0003" and proc.physical_device == "cuda:3"
    assert proc.memory_bytes == 12 * GIB


def test_failed_migration_stays_on_source(db: Database) -> None:
    ws, _ = _workspace(db)
    _register(db, ws)
    cmd = _command(db, ws, "migrate", target=1)
    _report(db, ws, cmd.id, "running")
    done, proc, _ = _report(
        db,
        ws,
        cmd.id,
        "failed",
        error="cuCheckpointProcessRestore failed: CUDA_ERROR_INVALID_VALUE",
        result={"failed_step": "restore", "ok": False},
    )
    assert done.error.startswith("cuCheckpoint") and proc.gpu_uuid == "GPU-0000"
    assert proc.state == "RUNNING"


def test_rows_written_before_the_models_still_read(db: Database) -> None:
    """A command's result and a process's capabilities were free-form JSON: a stored one with
    keys of its own reads through the model, and one that does not read at all counts as none
    (a result shown as absent, capabilities as none) instead of failing every page."""
    from flexium.server.models import Command, Process

    ws, _ = _workspace(db)
    _register(db, ws)
    cmd = _command(db, ws, "pause")
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
    _register(db, ws, "gpu-2")
    with db.session(write=True) as s:
        s.scalars(select(Process).where(Process.process_id == "gpu-2")).one().capabilities = {"pause_resume": 1}
    with pytest.raises(errors.CapabilityMissing):
        _command(db, ws, "pause", "gpu-2")


def test_commands_of_other_workspace_not_found(db: Database) -> None:
    ws_a, _ = _workspace(db, "a")
    ws_b, _ = _workspace(db, "b")
    _register(db, ws_a)
    cmd = _command(db, ws_a, "pause")
    with pytest.raises(errors.NotFound):
        db.run(storage.get_command, write=False, workspace_id=ws_b, command_id=cmd.id)
    with pytest.raises(errors.NotFound):
        _report(db, ws_b, cmd.id, "running")
    assert _next(db, ws_b) == (None, False)
    with pytest.raises(errors.NotFound):
        db.run(storage.peek_command, write=False, workspace_id=ws_b, process_id="gpu-1")
    assert db.run(storage.peek_command, write=False, workspace_id=ws_a, process_id="gpu-1") == ("node1", cmd.id)
    assert db.run(storage.list_commands, write=False, workspace_id=ws_b) == []


def test_list_commands_paging_and_filters(db: Database) -> None:
    ws, _ = _workspace(db)
    for i in range(5):
        _register(db, ws, f"gpu-{i}")
        _command(db, ws, "pause", f"gpu-{i}")
    page = db.run(storage.list_commands, write=False, workspace_id=ws, limit=2)
    assert [c.process_id for c in page] == ["gpu-4", "gpu-3"]
    rest = db.run(storage.list_commands, write=False, workspace_id=ws, before_id=page[-1].id)
    assert [c.process_id for c in rest] == ["gpu-2", "gpu-1", "gpu-0"]
    assert len(db.run(storage.list_commands, write=False, workspace_id=ws, process_id="gpu-2")) == 1
    assert db.run(storage.count_commands, write=False)["queued"] == 5


# --- sweep ----------------------------------------------------------------------------------


def _sweep(db: Database, now: float, alive_since: float = NOW - 10_000, **kw: Any) -> storage.SweepResult:
    args = dict(stale_after=STALE, remove_after=600.0, command_ttl=120.0, stale_since=now - 2)
    args.update(kw)
    return db.run(storage.sweep, write=True, now=now, alive_since=alive_since, **args)


def test_sweep_expires_old_queued_commands(db: Database) -> None:
    ws, _ = _workspace(db)
    _register(db, ws)
    cmd = _command(db, ws, "pause")
    assert _sweep(db, NOW + 60).expired == []
    result = _sweep(db, NOW + 121)
    assert [c.id for _ws, c in result.expired] == [cmd.id]
    got = db.run(storage.get_command, write=False, workspace_id=ws, command_id=cmd.id)
    assert got.state == "expired" and "not started" in got.error
    assert _next(db, ws) == (None, False)
    # a late report of a process that did act is still taken
    done, proc, changed = _report(db, ws, cmd.id, "succeeded", now=NOW + 122)
    assert changed and done.state == "succeeded" and proc.state == "PAUSED"


def test_sweep_removes_silent_processes_but_not_after_restart(db: Database) -> None:
    ws, _ = _workspace(db)
    _register(db, ws, "gone", now=NOW)
    _register(db, ws, "alive", now=NOW + 700)
    _command(db, ws, "pause", "gone", now=NOW)
    # the server just restarted: silence from before it started does not count
    assert _sweep(db, NOW + 701, alive_since=NOW + 690).removed == []
    result = _sweep(db, NOW + 701, alive_since=NOW)
    assert result.removed == [(ws, "gone")]
    names = [
        p.process_id
        for p in db.run(storage.list_processes, write=False, workspace_id=ws, now=NOW + 701, stale_after=STALE)
    ]
    assert names == ["alive"]
    assert db.run(storage.list_commands, write=False, workspace_id=ws) == []


def test_sweep_fails_running_commands_of_dead_processes(db: Database) -> None:
    ws, _ = _workspace(db)
    _register(db, ws, now=NOW)
    cmd = _command(db, ws, "pause")
    _report(db, ws, cmd.id, "running", now=NOW)
    assert _sweep(db, NOW + 100).failed == []  # still within the command's time
    result = _sweep(db, NOW + 200)
    assert [c.id for _w, c in result.failed] == [cmd.id]


def test_sweep_reports_newly_stale_once(db: Database) -> None:
    ws, _ = _workspace(db)
    _register(db, ws, now=NOW)
    assert _sweep(db, NOW + 29, stale_since=NOW + 27).newly_stale == []
    first = _sweep(db, NOW + 31, stale_since=NOW + 29).newly_stale
    assert [p.process_id for _w, p in first] == ["gpu-1"] and first[0][1].state == "STALE"
    assert _sweep(db, NOW + 33, stale_since=NOW + 31).newly_stale == []


def test_unregister_removes_commands(db: Database) -> None:
    ws, _ = _workspace(db)
    _register(db, ws)
    _command(db, ws, "pause")
    db.run(storage.unregister_process, write=True, workspace_id=ws, process_id="gpu-1")
    with db.session(write=False) as s:
        assert s.execute(text("SELECT count(*) FROM commands")).scalar() == 0
    with pytest.raises(errors.NotFound):
        db.run(storage.unregister_process, write=True, workspace_id=ws, process_id="gpu-1")


def _all_at_once(count: int, work: Callable[[int], None]) -> list[BaseException]:
    """Runs work(0) .. work(count - 1) on threads released together; returns what they raised."""
    failures: list[BaseException] = []
    barrier = threading.Barrier(count)

    def run(i: int) -> None:
        barrier.wait()
        try:
            work(i)
        except BaseException as exc:  # noqa: BLE001
            failures.append(exc)

    threads = [threading.Thread(target=run, args=(i,)) for i in range(count)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    return failures


def test_jobs_of_one_host_register_at_once(db: Database) -> None:
    """Eight jobs of one host report the same GPUs at the same moment: no conflict error."""
    ws, _ = _workspace(db)
    assert _all_at_once(8, lambda i: _register(db, ws, f"gpu-{i}", gpu_index=i, n_gpus=8)) == []
    hosts = db.run(storage.list_devices, write=False, workspace_id=ws, now=NOW, stale_after=STALE).hosts
    assert len(hosts) == 1 and len(hosts[0].devices) == 8


def test_jobs_listing_their_gpus_in_other_orders_write_them_at_once(db: Database) -> None:
    """Jobs of one host may list its GPUs in different orders: their device writes, side by side,
    must not deadlock (PostgreSQL aborts one of two transactions that lock rows crosswise)."""
    ws, _ = _workspace(db)
    devices = [gpu(i) for i in range(8)]
    for i in range(4):
        _register(db, ws, f"gpu-{i}", gpu_index=i, n_gpus=8)

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

    assert _all_at_once(4, beat) == []
    hosts = db.run(storage.list_devices, write=False, workspace_id=ws, now=time.time(), stale_after=1e9).hosts
    assert len(hosts) == 1 and len(hosts[0].devices) == 8


def test_concurrent_heartbeats_and_commands(db: Database) -> None:
    """Many threads writing at once: no 'database is locked', no lost update."""
    ws, _ = _workspace(db)
    for i in range(8):
        _register(db, ws, f"gpu-{i}")

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

    assert _all_at_once(8, beat) == []
    procs = db.run(storage.list_processes, write=False, workspace_id=ws, now=time.time(), stale_after=1e9)
    assert {p.memory_bytes for p in procs} == {24}


@pytest.mark.parametrize("name", ["team\n", "team\r\n", "Team", "-team", "te am", ""])
def test_a_workspace_name_is_checked_to_its_last_character(db: Database, name: str) -> None:
    with pytest.raises(errors.InvalidRequest):
        db.run(storage.create_workspace, write=True, name=name, now=NOW)
    assert all(w.name != name for w in db.run(storage.list_workspaces, write=False))


def test_a_server_address_whose_port_is_not_ascii_digits_is_refused() -> None:
    from flexium import protocol

    for address in ("host:８０８０/team", "host:²/team"):  # int() reads the first, refuses the second
        with pytest.raises(ValueError):
            protocol.parse_server_address(address)
    assert (
        protocol.ascii_number("42") == 42 and protocol.ascii_number("²") is None and protocol.ascii_number("١") is None
    )


def test_a_job_on_two_gpus_needs_room_for_the_share_that_moves(db: Database) -> None:
    """A process holding 100 GiB on each of GPUs 0 and 1: a migration moves its own device's
    share; onto GPU 1 (its other one) the restore swaps the two shares. Checked against its whole
    200 GiB, no 140 GiB GPU could take it. One process per host: one command each."""
    ws, _ = _workspace(db)
    for host in ("n1", "n2", "n3"):
        devices = [gpu(0, used=100 * GIB), gpu(1, used=100 * GIB), gpu(2, used=20 * GIB), gpu(3, used=60 * GIB)]
        devices[0]["process_bytes"], devices[1]["process_bytes"] = 100 * GIB, 100 * GIB
        _register(db, ws, f"dp-{host}", host=host, memory=200 * GIB, devices=devices)
    assert _command(db, ws, "migrate", "dp-n1", target=1).target_uuid == "GPU-0001"  # a swap
    assert _command(db, ws, "migrate", "dp-n2", target=2).target_uuid == "GPU-0002"
    with pytest.raises(errors.TargetRefused, match="80.0 GiB free, the job needs 100.0 GiB"):
        _command(db, ws, "migrate", "dp-n3", target=3)


def test_a_process_on_two_gpus_is_moved_gpu_by_gpu(db: Database) -> None:
    """gpus names where the memory on each GPU the process uses goes: checked move by move for
    that GPU's share, stored on the command (UUID to UUID), handed to the process as such."""
    ws, _ = _workspace(db)
    devices = [gpu(0, used=3 * GIB), gpu(1, used=2 * GIB), gpu(2, used=0), gpu(3, used=138 * GIB)]
    devices[0]["process_bytes"], devices[1]["process_bytes"] = 3 * GIB, 2 * GIB
    _register(db, ws, "dp", memory=5 * GIB, devices=devices)

    refusals: dict[str, dict[str, Any]] = {
        "holds nothing on GPU GPU-0002 (2): gpus name the GPUs it uses (GPU-0000, GPU-0001)": {"2": 3},
        "two GPUs of process 'dp' cannot both go to GPU GPU-0002": {"0": 2, "1": 2},
        "GPU GPU-0003 cannot take process 'dp': 2.0 GiB free, the job needs 3.0 GiB": {"0": 3},
        "the job is already on it": {"GPU-0001": "GPU-0001"},
        "gpus names no GPU": {},
    }
    for message, gpus in refusals.items():
        with pytest.raises((errors.TargetRefused, errors.InvalidRequest), match=re.escape(message)):
            _command(db, ws, "migrate", "dp", gpus=gpus)
    with pytest.raises(errors.InvalidRequest, match="gpus is for a migrate of one process on several GPUs"):
        _command(db, ws, "migrate", "dp", target=2, gpus={"0": 2})

    # Its GPU 1's memory onto GPU 0, which its own device leaves.
    command = _command(db, ws, "migrate", "dp", gpus={"0": 2, "cuda:1": 0})
    assert command.gpu_moves == {"GPU-0000": "GPU-0002", "GPU-0001": "GPU-0000"}
    assert command.target_uuid == "GPU-0002"  # where the process's own device goes
    with db.session(write=False) as s:
        assert s.scalar(select(models.Command.gpu_moves)) == command.gpu_moves

    # Done: it is shown where each GPU's memory went at once, before its next device report.
    _next(db, ws, "dp")
    _report(db, ws, command.id, "running")
    _command_after, shown, changed = _report(db, ws, command.id, "succeeded", process={"state": "RUNNING"})
    assert changed and (shown.gpu_uuid, shown.other_gpus) == ("GPU-0002", ["GPU-0000"])


def test_a_heartbeat_that_changes_the_gpus_a_process_holds_memory_on_is_a_change(db: Database) -> None:
    """The dashboard re-renders a process on a change heartbeats publish: a process that takes
    memory on a second GPU (or leaves it) is one, though its total stays the same."""
    ws, _ = _workspace(db)
    _register(db, ws, "dp", memory=5 * GIB, devices=[gpu(0, used=5 * GIB), gpu(1)])

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


def test_0009_goes_back_to_0008_keeping_the_commands(db: Database) -> None:
    from alembic import command

    ws, _ = _workspace(db)
    _register(db, ws, "one")
    _command(db, ws, "pause", "one")
    migrate_to(db, command.downgrade, "0008")
    assert "gpu_moves" not in columns(db, "commands")
    with db.session(write=False) as s:
        assert s.execute(text("SELECT count(*) FROM commands")).scalar() == 1
    db.upgrade()
    assert "gpu_moves" in columns(db, "commands")


def test_0008_goes_back_to_0007_keeping_processes_and_their_commands(db: Database) -> None:
    from alembic import command

    ws, _ = _workspace(db)
    devices = [gpu(0, used=3 * GIB), gpu(1, used=2 * GIB)]
    devices[0]["process_bytes"], devices[1]["process_bytes"] = 3 * GIB, 2 * GIB
    _register(db, ws, "dp", memory=5 * GIB, devices=devices)
    _command(db, ws, "pause", "dp")
    migrate_to(db, command.downgrade, "0007")
    assert "gpu_bytes" not in columns(db, "processes")
    with db.session(write=False) as s:
        assert s.execute(text("SELECT count(*) FROM commands")).scalar() == 1
        assert s.execute(text("SELECT process_id FROM processes")).scalar() == "dp"
    db.upgrade()
    assert "gpu_bytes" in columns(db, "processes")
    _register(db, ws, "dp", memory=5 * GIB, devices=devices)
    with db.session(write=False) as s:
        stored = s.scalar(select(models.Process.gpu_bytes))
    assert stored == {"GPU-0000": 3 * GIB, "GPU-0001": 2 * GIB}
