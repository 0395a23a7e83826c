"""Jobs of several ranks (torchrun) against SQLite and PostgreSQL: a rank's membership, job
operations (one command per rank, all or nothing), every refusal, the operation's state as its
ranks report, the jobs view, and migration 0005."""

from __future__ import annotations

from typing import Any

import pytest
from sqlalchemy import text
from sqlalchemy.exc import IntegrityError

from flexium import wire
from flexium.server import errors, storage
from flexium.server.db import Database
from flexium.server.settings import normalize_database_url
from support.server import GIB, Api, columns, migrate_to, rank_body, register, table_snapshot

NOW = 1_800_000_000.0
STALE = 30.0


def _workspace(db: Database) -> int:
    record, _token = db.run(storage.create_workspace, write=True, name="team", now=NOW)
    return int(record.id)


def _register(db: Database, ws: int, body: dict[str, Any], now: float = NOW) -> wire.ProcessInfo:
    proc: wire.ProcessInfo = register(db, ws, body, now=now, stale_after=STALE)
    return proc


def _job(db: Database, ws: int, world: int = 2, now: float = NOW, **fields: Any) -> None:
    for rank in range(world):
        _register(db, ws, rank_body(rank, world=world, **fields), now=now)


def _create(
    db: Database,
    ws: int,
    kind: str,
    process_id: str = "rank-0",
    target: Any = None,
    ranks: Any = None,
    now: float = NOW,
) -> list[wire.CommandInfo]:
    return db.run(
        storage.create_commands,
        write=True,
        workspace_id=ws,
        kind=kind,
        process_id=process_id,
        target=target,
        ranks=ranks,
        now=now,
        stale_after=STALE,
    )


def _refused(db: Database, ws: int, error: type[errors.ApiError], match: str, kind: str, **request: Any) -> str:
    """The request is refused with ``error`` and a message matching ``match``, and nothing is written."""
    before = table_snapshot(db)
    with pytest.raises(error, match=match) as info:
        _create(db, ws, kind, **request)
    assert table_snapshot(db) == before
    return info.value.message


def _operation(db: Database, ws: int, operation_id: int) -> wire.JobOperationInfo:
    return db.run(storage.get_operation, write=False, workspace_id=ws, operation_id=operation_id)


def _report(db: Database, ws: int, command_id: int, state: str, **report: Any) -> wire.CommandInfo:
    command, _process, _changed = db.run(
        storage.report_command,
        write=True,
        workspace_id=ws,
        command_id=command_id,
        report=wire.CommandReport.model_validate({"state": state, **report}),
        now=NOW + 1,
        stale_after=STALE,
    )
    return command


# --- membership -------------------------------------------------------------------------------


def test_register_stores_the_job_and_a_new_registration_replaces_it(db: Database) -> None:
    ws = _workspace(db)
    proc = _register(db, ws, rank_body(1))
    assert proc.job == wire.JobInfo(key="run-7f3a", rank=1, world_size=2, local_rank=1, local_world_size=2)
    shown = db.run(storage.get_process, write=False, workspace_id=ws, process_id="rank-1", now=NOW, stale_after=STALE)
    assert shown.job == proc.job
    body = rank_body(1)
    del body["job"]
    assert _register(db, ws, body).job is None
    with pytest.raises(errors.InvalidRequest, match="job.rank 2 is not a rank of a job of world_size 2"):
        _register(db, ws, rank_body(2, world=2))


# --- creation ---------------------------------------------------------------------------------


def test_pause_of_one_rank_pauses_every_rank_in_one_operation(db: Database) -> None:
    ws = _workspace(db)
    _job(db, ws)
    commands = _create(db, ws, "pause", "rank-1")
    assert [c.process_id for c in commands] == ["rank-1", "rank-0"]  # the addressed rank's first
    operation_ids = {c.job.operation_id for c in commands if c.job}
    assert len(operation_ids) == 1
    for command in commands:
        assert command.kind == "pause" and command.state == "queued" and command.target_uuid is None
        assert command.job is not None
        assert (command.job.job_key, command.job.world_size, command.job.moves) == ("run-7f3a", 2, {})
        assert command.job.rank == int(command.process_id[-1])
    operation = _operation(db, ws, operation_ids.pop())
    assert (operation.kind, operation.state, operation.world_size, operation.finished_at) == (
        "pause",
        "queued",
        2,
        None,
    )
    assert [c.process_id for c in operation.commands] == ["rank-0", "rank-1"]
    for rank in (0, 1):
        shown = db.run(
            storage.get_process, write=False, workspace_id=ws, process_id=f"rank-{rank}", now=NOW, stale_after=STALE
        )
        assert shown.active_command is not None and shown.active_command.job is not None


def test_migrate_target_moves_the_addressed_rank_alone(db: Database) -> None:
    ws = _workspace(db)
    _job(db, ws)
    commands = _create(db, ws, "migrate", "rank-1", target="cuda:2")
    by_rank = {c.job.rank: c for c in commands if c.job}
    assert by_rank[1].target_uuid == "GPU-0002" and by_rank[0].target_uuid is None
    assert by_rank[0].job is not None and by_rank[0].job.moves == {"1": "GPU-0002"}


def test_swap_counts_the_memory_the_other_rank_takes_away(db: Database) -> None:
    """Each GPU is too full for the other rank while that rank is on it; a swap frees it as it
    fills it."""
    ws = _workspace(db)
    _job(db, ws, memory=100 * GIB)
    commands = _create(db, ws, "migrate", "rank-0", ranks={"0": "cuda:1", "1": "cuda:0"})
    moves = {"0": "GPU-0001", "1": "GPU-0000"}
    assert {c.process_id: c.target_uuid for c in commands} == {"rank-0": "GPU-0001", "rank-1": "GPU-0000"}
    assert all(c.job is not None and c.job.moves == moves for c in commands)
    assert _operation(db, ws, commands[0].job.operation_id).moves == moves  # type: ignore[union-attr]


def test_targets_are_read_in_the_addressed_ranks_numbering(db: Database) -> None:
    ws = _workspace(db)
    order = ["GPU-0003", "GPU-0002", "GPU-0001", "GPU-0000"]
    _register(db, ws, rank_body(0, visible_gpus=order))
    _register(db, ws, rank_body(1))
    commands = _create(db, ws, "migrate", "rank-0", ranks={"0": "cuda:0", "1": 2})
    assert {c.process_id: c.target_uuid for c in commands} == {"rank-0": "GPU-0003", "rank-1": "GPU-0002"}


def test_resume_where_paused_or_by_ranks(db: Database) -> None:
    ws = _workspace(db)
    _job(db, ws, state="PAUSED")
    commands = _create(db, ws, "resume", "rank-0")
    assert [c.target_uuid for c in commands] == [None, None]
    for command in commands:
        _report(db, ws, command.id, "succeeded", process={"state": "RUNNING"})
    commands = _create(db, ws, "pause", "rank-0")
    for command in commands:
        _report(db, ws, command.id, "succeeded")
    commands = _create(db, ws, "resume", "rank-1", ranks={"1": "cuda:3"})
    assert {c.process_id: c.target_uuid for c in commands} == {"rank-1": "GPU-0003", "rank-0": None}


def test_a_job_of_one_rank_and_a_plain_process_take_the_single_path(db: Database) -> None:
    ws = _workspace(db)
    _register(db, ws, rank_body(0, world=1))
    commands = _create(db, ws, "migrate", "rank-0", target=2)
    assert len(commands) == 1 and commands[0].job is None and commands[0].target_uuid == "GPU-0002"
    body = rank_body(0, world=1, key="solo")
    body["process_id"] = "plain"
    del body["job"]
    _register(db, ws, body)
    message = _refused(db, ws, errors.InvalidRequest, "ranks is for a rank", "pause", process_id="plain", ranks={})
    assert "use target" in message


# --- refusals, each before anything is written --------------------------------------------------


def test_malformed_requests_are_invalid(db: Database) -> None:
    ws = _workspace(db)
    _job(db, ws)
    both = {"target": "cuda:2", "ranks": {"0": "cuda:3"}}
    _refused(db, ws, errors.InvalidRequest, "not both", "migrate", **both)
    _refused(db, ws, errors.InvalidRequest, "pause takes no target", "pause", target="cuda:2")
    _refused(db, ws, errors.InvalidRequest, "pause takes no target", "pause", ranks={"0": "cuda:2"})
    _refused(db, ws, errors.InvalidRequest, "migrate needs a target GPU", "migrate")
    for bad in ("2", "x", "-1", "1.0", "", " "):
        _refused(
            db,
            ws,
            errors.InvalidRequest,
            r"is not a rank of job 'run-7f3a' \(its ranks are 0..1\)",
            "migrate",
            ranks={bad: 2},
        )
    _refused(db, ws, errors.InvalidRequest, "rank 1 has no target GPU", "migrate", ranks={"1": ""})
    _refused(db, ws, errors.InvalidRequest, "rank 1 is given twice", "migrate", ranks={"1": 2, "01": 3})


def test_every_rank_must_be_registered_and_listening(db: Database) -> None:
    ws = _workspace(db)
    _register(db, ws, rank_body(0))
    message = _refused(db, ws, errors.InvalidState, "rank 1 of 2 has not registered", "pause")
    assert message.startswith("cannot pause job 'run-7f3a'")
    _register(db, ws, rank_body(1), now=NOW - 100)
    _register(db, ws, rank_body(0))
    _refused(db, ws, errors.Stale, r"rank 1 of 2 \(process 'rank-1'\) is stale: no heartbeat for 100 s", "pause")


def test_a_rank_registered_twice_alive_is_refused_a_stale_duplicate_is_not(db: Database) -> None:
    ws = _workspace(db)
    _job(db, ws)
    _register(db, ws, {**rank_body(1), "process_id": "rank-1-old"}, now=NOW - 100)
    assert len(_create(db, ws, "pause")) == 2
    ws2_record, _ = db.run(storage.create_workspace, write=True, name="other", now=NOW)
    ws2 = int(ws2_record.id)
    _job(db, ws2)
    _register(db, ws2, {**rank_body(1), "process_id": "rank-1-again"})
    _refused(db, ws2, errors.InvalidState, "rank 1 is registered by several live processes", "pause")


def test_ranks_must_agree_on_the_world_size(db: Database) -> None:
    ws = _workspace(db)
    _job(db, ws)
    _register(db, ws, {**rank_body(2, world=3), "process_id": "rank-2"})
    _refused(db, ws, errors.InvalidState, "disagree on its size", "pause")


def test_a_busy_rank_refuses_the_operation(db: Database) -> None:
    ws = _workspace(db)
    _job(db, ws)
    first = _create(db, ws, "pause", "rank-1")
    message = _refused(db, ws, errors.Busy, r"rank \d \(process 'rank-\d'\) already has command", "pause")
    assert "one at a time" in message
    assert {c.id for c in first} == {c.id for c in _operation(db, ws, first[0].job.operation_id).commands}  # type: ignore[union-attr]


def test_states_every_rank_must_share(db: Database) -> None:
    ws = _workspace(db)
    _register(db, ws, rank_body(0))
    _register(db, ws, rank_body(1, state="PAUSED"))
    message = _refused(db, ws, errors.InvalidState, "every rank must be RUNNING", "pause")
    assert "rank 0 is RUNNING, rank 1 is PAUSED" in message
    _refused(db, ws, errors.InvalidState, "every rank must be PAUSED; rank 0 is RUNNING, rank 1 is PAUSED", "resume")
    _register(db, ws, rank_body(0, state="PAUSED"))
    message = _refused(db, ws, errors.InvalidState, "every rank must be RUNNING", "migrate", target=2)
    assert message.endswith("resume it with ranks instead")
    _job(db, ws)
    _refused(db, ws, errors.InvalidState, "every rank must be PAUSED", "resume")
    _register(db, ws, rank_body(1, state="FAILED"))
    _refused(db, ws, errors.InvalidState, r"rank 1 \(process 'rank-1'\) is FAILED: .*restart the job", "pause")


def test_every_rank_must_be_able_to_take_part(db: Database) -> None:
    ws = _workspace(db)
    why = "NCCL 2.27.3 has no ncclCommSuspend: install NCCL 2.28+ (pip install nvidia-nccl-cu13)"
    _register(db, ws, rank_body(0))
    _register(db, ws, rank_body(1, job_operations=False, problems=[why]))
    message = _refused(db, ws, errors.CapabilityMissing, r"rank 1 \(process 'rank-1'\) cannot take part", "pause")
    assert message.endswith(why)
    old = rank_body(1)
    del old["capabilities"]["job_operations"]  # a flexium from before job operations
    _register(db, ws, old)
    _refused(db, ws, errors.CapabilityMissing, "does not say it can take part in a job operation; upgrade", "pause")


def test_a_rank_moves_only_to_a_gpu_it_sees(db: Database) -> None:
    ws = _workspace(db)
    _register(db, ws, rank_body(0))
    _register(db, ws, rank_body(1, visible_gpus=["GPU-0000", "GPU-0001"]))
    message = _refused(db, ws, errors.TargetRefused, "rank 1 .* cannot see GPU GPU-0003", "migrate", ranks={"1": 3})
    assert "fact `target-must-be-visible` in docs/facts.md" in message and "CUDA_VISIBLE_DEVICES" in message


def test_no_two_ranks_on_one_gpu_after_the_move(db: Database) -> None:
    ws = _workspace(db)
    _job(db, ws)
    message = _refused(
        db, ws, errors.TargetRefused, "rank 0 would share GPU GPU-0001 with rank 1", "migrate", target="cuda:1"
    )
    assert "a swap" in message
    _refused(db, ws, errors.TargetRefused, "would share GPU GPU-0002", "migrate", ranks={"0": 2, "1": 2})


def test_ranks_of_an_nccl_job_on_one_gpu_are_refused_a_pause_and_a_resume_in_place(db: Database) -> None:
    ws = _workspace(db)
    both_on_gpu_0 = {"gpu_index": 0, "placement": {0: 20 * GIB}}
    _job(db, ws, nccl=True, **both_on_gpu_0)
    message = _refused(
        db, ws, errors.TargetRefused, r"^ranks 0 and 1 of this NCCL job would be on one GPU \(GPU-0000\)", "pause"
    )
    assert (
        "fact `nccl-ranks-sharing-gpu-fail` in docs/facts.md" in message
        and "give each rank a GPU of its own" in message
    )
    _job(db, ws, nccl=True, state="PAUSED", **both_on_gpu_0)
    _refused(db, ws, errors.TargetRefused, "would be on one GPU", "resume")
    apart = _create(db, ws, "resume", ranks={"1": "cuda:1"})  # each on a GPU of its own: allowed
    assert {c.process_id: c.target_uuid for c in apart} == {"rank-0": None, "rank-1": "GPU-0001"}
    record, _token = db.run(storage.create_workspace, write=True, name="gloo-team", now=NOW)
    gloo = int(record.id)
    _job(db, gloo, nccl=False, **both_on_gpu_0)
    assert len(_create(db, gloo, "pause")) == 2  # gloo ranks may share a GPU


def test_nothing_to_move_is_refused(db: Database) -> None:
    ws = _workspace(db)
    _job(db, ws)
    message = _refused(
        db, ws, errors.TargetRefused, "nothing to move in job 'run-7f3a'", "migrate", ranks={"0": 0, "1": 1}
    )
    assert "rank 0 is already on GPU-0000, rank 1 is already on GPU-0001" in message


def test_each_target_is_judged_for_the_rank_that_goes_there(db: Database) -> None:
    ws = _workspace(db)
    _job(db, ws, memory=100 * GIB, placement={0: 100 * GIB, 1: 100 * GIB, 2: 130 * GIB})
    # Room is judged for the rank that would go there; a command leaves it to that rank's own check.
    judged = db.run(
        storage.judge_targets,
        write=False,
        workspace_id=ws,
        process_id="rank-1",
        kind="migrate",
        now=NOW,
        stale_after=STALE,
    )
    assert judged[2].refusal == "10.0 GiB free, the job needs 100.0 GiB plus 0.5 GiB headroom"
    _refused(db, ws, errors.TargetRefused, "unknown GPU 'GPU-9999'", "migrate", ranks={"1": "GPU-9999"})
    _refused(db, ws, errors.TargetRefused, "reported no GPU with index 7", "migrate", target=7)
    body = rank_body(1, memory=100 * GIB, placement={0: 100 * GIB, 1: 100 * GIB, 2: 130 * GIB})
    body["capabilities"]["migration"] = False
    _register(db, ws, body)
    _refused(db, ws, errors.CapabilityMissing, "process 'rank-1' cannot migrate", "migrate", ranks={"1": 3})


def test_resume_leaves_a_rank_whose_gpu_filled_up_while_paused_to_its_own_check(db: Database) -> None:
    """The last report says its GPU filled up, but that report is older than the command: the
    rank's own room check decides (and the whole job stays paused if it refuses)."""
    ws = _workspace(db)
    _job(db, ws, state="PAUSED", memory=0, footprint_bytes=100 * GIB, placement={1: 130 * GIB})
    assert len(_create(db, ws, "resume")) == 2


def test_creation_is_all_or_nothing(db: Database, monkeypatch: pytest.MonkeyPatch) -> None:
    """A command another request gave rank 1 after the checks read it (the race the unique
    index closes) takes the whole operation back: no rank's command, no operation row."""
    from flexium.server.models import Command, Process
    from flexium.server.storage import jobs

    ws = _workspace(db)
    _job(db, ws)
    before = table_snapshot(db)
    checks = jobs._check_ranks

    def raced(**kw: Any) -> Any:
        chosen = checks(**kw)
        session = kw["session"]
        rank_1 = session.get(Process, chosen[1].pk)
        session.add(
            Command(workspace_id=ws, process_pk=rank_1.pk, kind="pause", state="queued", created_at=NOW, deliveries=0)
        )
        session.flush()
        return chosen

    monkeypatch.setattr(jobs, "_check_ranks", raced)
    with pytest.raises(errors.Busy, match="got another command meanwhile"):
        _create(db, ws, "pause")
    assert table_snapshot(db) == before


# --- the operation's state as its ranks report ------------------------------------------------


def _deliver(db: Database, ws: int, process_id: str) -> wire.CommandInfo:
    command, _first = db.run(storage.next_command, write=True, workspace_id=ws, process_id=process_id, now=NOW)
    assert command is not None and command.job is not None
    return command


def test_operation_state_follows_every_rank(db: Database) -> None:
    ws = _workspace(db)
    _job(db, ws)
    commands = {c.process_id: c for c in _create(db, ws, "migrate", ranks={"0": 1, "1": 0})}
    op_id = commands["rank-0"].job.operation_id  # type: ignore[union-attr]
    assert _operation(db, ws, op_id).state == "queued"
    delivered = _deliver(db, ws, "rank-0")
    assert delivered.job == commands["rank-0"].job  # the long-poll hands the rank its share
    assert _operation(db, ws, op_id).state == "running"
    _report(db, ws, commands["rank-0"].id, "running")
    _report(db, ws, commands["rank-0"].id, "succeeded", process={"state": "RUNNING"})
    assert _operation(db, ws, op_id).state == "running"  # rank 1 has not ended
    _deliver(db, ws, "rank-1")
    _report(db, ws, commands["rank-1"].id, "succeeded", process={"state": "RUNNING"})
    done = _operation(db, ws, op_id)
    assert done.state == "succeeded" and done.finished_at == NOW + 1
    assert [(c.process_id, c.state) for c in done.commands] == [("rank-0", "succeeded"), ("rank-1", "succeeded")]
    placed = {
        p.process_id: p.gpu_uuid
        for p in db.run(storage.list_processes, write=False, workspace_id=ws, now=NOW, stale_after=STALE)
    }
    assert placed == {"rank-0": "GPU-0001", "rank-1": "GPU-0000"}


def test_operation_fails_when_a_rank_fails_once_all_ended(db: Database) -> None:
    ws = _workspace(db)
    _job(db, ws)
    commands = {c.process_id: c for c in _create(db, ws, "pause")}
    op_id = commands["rank-0"].job.operation_id  # type: ignore[union-attr]
    _report(db, ws, commands["rank-1"].id, "failed", error="rank 1: ncclCommSuspend failed; every rank rolled back")
    assert _operation(db, ws, op_id).state == "running"  # rank 0 is still rolling back
    _report(db, ws, commands["rank-0"].id, "failed", error="rank 1 failed; rolled back")
    failed = _operation(db, ws, op_id)
    assert failed.state == "failed"
    assert [c.error for c in failed.commands] == [
        "rank 1 failed; rolled back",
        "rank 1: ncclCommSuspend failed; every rank rolled back",
    ]
    states = {
        p.process_id: p.state
        for p in db.run(storage.list_processes, write=False, workspace_id=ws, now=NOW, stale_after=STALE)
    }
    assert states == {"rank-0": "RUNNING", "rank-1": "RUNNING"}


def test_unknown_operation_is_not_found(db: Database) -> None:
    ws = _workspace(db)
    with pytest.raises(errors.NotFound, match="job operation 99 not found"):
        _operation(db, ws, 99)


# --- the jobs view ----------------------------------------------------------------------------


def test_jobs_list_their_ranks_and_a_state_for_all(db: Database) -> None:
    ws = _workspace(db)
    _register(db, ws, rank_body(1, world=3))
    _register(db, ws, rank_body(0, world=3))
    body = rank_body(0, world=1, key="solo")
    body["process_id"] = "single"
    _register(db, ws, body)

    def jobs() -> list[wire.JobSummary]:
        return db.run(storage.list_jobs, write=False, workspace_id=ws, now=NOW, stale_after=STALE)

    (job,) = jobs()
    assert (job.key, job.world_size, job.state, job.missing_ranks) == ("run-7f3a", 3, "INCOMPLETE", [2])
    assert [p.process_id for p in job.ranks] == ["rank-0", "rank-1"]
    _register(db, ws, rank_body(2, world=3, state="PAUSED"))
    assert jobs()[0].state == "MIXED"
    _register(db, ws, rank_body(2, world=3))
    assert jobs()[0].state == "RUNNING" and jobs()[0].active_operation_id is None
    command = _create(db, ws, "pause", "rank-2")[0]
    _report(db, ws, command.id, "running")
    (job,) = jobs()
    assert job.state == "PAUSING" and job.active_operation_id == command.job.operation_id  # type: ignore[union-attr]
    (job,) = db.run(storage.list_jobs, write=False, workspace_id=ws, now=NOW + STALE + 5, stale_after=STALE)
    assert job.state == "STALE"


# --- over HTTP --------------------------------------------------------------------------------


def test_api_job_operation_round_trip(api: Api) -> None:
    for rank in (0, 1):
        api.register(**rank_body(rank))
    refused = api.command("migrate", "rank-0", ranks={"5": "cuda:1"})
    assert refused.status_code == 422 and refused.json()["error"] == "invalid_request"
    assert "its ranks are 0..1" in refused.json()["message"]
    refused = api.command("migrate", "rank-0", ranks={"0": "cuda:1"})
    assert refused.status_code == 422 and refused.json()["error"] == "target_refused"
    r = api.command("migrate", "rank-0", ranks={"0": "cuda:1", "1": "cuda:0"})
    assert r.status_code == 201, r.text
    created = r.json()
    assert created["process_id"] == "rank-0" and created["job"]["moves"] == {"0": "GPU-0001", "1": "GPU-0000"}
    op_id = created["job"]["operation_id"]
    operation = api.get(f"/operations/{op_id}").json()
    assert operation["state"] == "queued" and [c["job"]["rank"] for c in operation["commands"]] == [0, 1]
    busy = api.command("pause", "rank-1")
    assert busy.status_code == 409 and busy.json()["error"] == "busy"
    for rank in (0, 1):
        delivered = api.get(f"/processes/rank-{rank}/commands/next", params={"wait": 0}).json()
        assert delivered["job"]["operation_id"] == op_id
        update = {"state": "RUNNING", "gpu_uuid": delivered["target_uuid"]}
        ok = api.post(f"/commands/{delivered['id']}/report", {"state": "succeeded", "process": update})
        assert ok.status_code == 200, ok.text
    done = api.get(f"/operations/{op_id}", params={"wait": 5}).json()
    assert done["state"] == "succeeded"
    (job,) = api.get("/jobs").json()
    assert [(p["job"]["rank"], p["gpu_uuid"]) for p in job["ranks"]] == [(0, "GPU-0001"), (1, "GPU-0000")]
    assert job["state"] == "RUNNING" and job["world_size"] == 2
    assert api.get("/operations/4242").status_code == 404


# --- migration 0005 ---------------------------------------------------------------------------


def test_0005_keeps_processes_and_commands_and_goes_back(database_url: str) -> None:
    """A server upgraded with jobs attached and commands stored keeps them all (on SQLite the
    commands table is copied: ids, the one-active index and never-reused ids survive)."""
    from alembic import command

    db = Database(normalize_database_url(database_url))
    migrate_to(db, command.upgrade, "0004")
    with db.session(write=True) as s:
        s.execute(text("INSERT INTO workspaces (id, name, created_at) VALUES (1, 'team', 0)"))
        s.execute(
            text(
                'INSERT INTO processes (pk, workspace_id, process_id, host, "user", pid, gpu_uuid, gpu_model,'
                " logical_device, visible_gpus, torch_version, driver_version, flexium_version, capabilities,"
                " memory_bytes, footprint_bytes, state, registered_at, last_seen, cmdline) VALUES (7, 1, 'gpu-1',"
                " 'node1', 'alice', 42, 'GPU-0002', 'NVIDIA H200', 'cuda:0', :visible, '', '', '', '{}', 1024, 1024,"
                " 'RUNNING', :now, :now, '')"
            ),
            {"visible": '["GPU-0001", "GPU-0002"]', "now": NOW},
        )
        for state in ("succeeded", "queued"):
            s.execute(
                text(
                    "INSERT INTO commands (workspace_id, process_pk, kind, state, created_at, deliveries)"
                    " VALUES (1, 7, 'pause', :state, :now, 0)"
                ),
                {"state": state, "now": NOW},
            )
    db.upgrade()
    assert {"job_key", "job_rank", "job_world_size"} <= columns(db, "processes")
    assert {"operation_id", "job"} <= columns(db, "commands")
    proc = db.run(storage.get_process, write=False, workspace_id=1, process_id="gpu-1", now=NOW, stale_after=STALE)
    assert proc.job is None and proc.gpu_uuid == "GPU-0002"
    assert proc.active_command is not None and proc.active_command.id == 2 and proc.active_command.job is None
    listed = db.run(storage.list_commands, write=False, workspace_id=1)
    assert [(c.id, c.state) for c in listed] == [(2, "queued"), (1, "succeeded")]
    with pytest.raises(IntegrityError), db.session(write=True) as s:  # the one-active-command index stays
        s.execute(
            text(
                "INSERT INTO commands (workspace_id, process_pk, kind, state, created_at, deliveries)"
                " VALUES (1, 7, 'pause', 'queued', :now, 0)"
            ),
            {"now": NOW},
        )
    with db.session(write=True) as s:  # ids are never reused: deleting the newest does not free its id
        s.execute(text("DELETE FROM commands WHERE id = 2"))
        new_id = s.execute(
            text(
                "INSERT INTO commands (workspace_id, process_pk, kind, state, created_at, deliveries)"
                " VALUES (1, 7, 'pause', 'queued', :now, 0) RETURNING id"
            ),
            {"now": NOW},
        ).scalar()
        assert new_id is not None and new_id > 2
    _register(db, 1, rank_body(0))
    _register(db, 1, rank_body(1))
    assert len(_create(db, 1, "pause")) == 2
    migrate_to(db, command.downgrade, "0004")
    assert not {"job_key", "job_rank"} & columns(db, "processes")
    assert not {"operation_id", "job"} & columns(db, "commands")
    with db.session(write=False) as s:
        assert s.execute(text("SELECT count(*) FROM commands")).scalar() == 4
        assert s.execute(text("SELECT count(*) FROM processes")).scalar() == 3
    db.upgrade()
    assert "job_key" in columns(db, "processes")
    db.dispose()


# --- live events and the dashboard's rendering ------------------------------------------------


def test_job_operation_events_and_escaped_pages(api: Api) -> None:
    import asyncio
    import json
    from urllib.parse import quote

    key = "<b>run</b>/7"
    for rank in (0, 1):
        api.register(**rank_body(rank, key=key))
    workspace_id = api.get("").json()["id"]
    before = api.ctx.bus.last_id
    assert api.command("pause", "rank-1").status_code == 201

    async def backlog() -> list[str]:
        sub, frames = api.ctx.bus.subscribe(workspace_id, last_event_id=before)
        api.ctx.bus.unsubscribe(sub)
        return list(frames)

    created = [json.loads(frame.split("data: ", 1)[1]) for frame in asyncio.run(backlog()) if "event: command" in frame]
    assert [(e["action"], e["command"]["process_id"]) for e in created] == [
        ("created", "rank-1"),
        ("created", "rank-0"),
    ]
    assert len({e["command"]["job"]["operation_id"] for e in created}) == 1

    page, rows, form = api.pages("/", "/ui/processes", f"/ui/jobs/{quote(key, safe='')}/migrate")
    for html in (page, rows):
        assert "<b>run</b>" not in html and 'id="job-&lt;b&gt;run&lt;/b&gt;/7"' in html
        assert html.index('id="job-&lt;b&gt;run') < html.index('id="proc-rank-0"') < html.index('id="proc-rank-1"')
        assert 'data-action="job-pause"' not in html  # an operation is under way: no buttons
        assert "operation " in html and " under way" in html
    assert "<b>run</b>" not in form and 'data-job-key="&lt;b&gt;run&lt;/b&gt;/7"' in form
    assert form.count("<select") == 2 and "data-swap" in form
    [missing] = api.pages("/ui/jobs/no-such-job/migrate")
    assert missing == ""


def test_sweep_expires_a_job_operation_and_forgets_it_with_its_ranks(db: Database) -> None:
    ws = _workspace(db)
    _job(db, ws)
    commands = _create(db, ws, "pause")
    op_id = commands[0].job.operation_id  # type: ignore[union-attr]

    def sweep(now: float) -> storage.SweepResult:
        return db.run(
            storage.sweep,
            write=True,
            now=now,
            alive_since=NOW - 10_000,
            stale_after=STALE,
            remove_after=600.0,
            command_ttl=120.0,
            stale_since=now - 2,
            reservation_ttl=300.0,
        )

    expired = sweep(NOW + 121).expired
    assert sorted(c.job.rank for _ws, c in expired if c.job) == [0, 1]
    operation = _operation(db, ws, op_id)
    assert operation.state == "failed" and [c.state for c in operation.commands] == ["expired", "expired"]
    _register(db, ws, rank_body(0), now=NOW + 500)  # rank 0 lives on, rank 1 went silent
    sweep(NOW + 700)
    assert [c.process_id for c in _operation(db, ws, op_id).commands] == ["rank-0"]
    _register(db, ws, rank_body(0), now=NOW)
    with db.session(write=False) as s:
        assert s.execute(text("SELECT count(*) FROM job_operations")).scalar() == 1
    sweep(NOW + 700)  # now rank 0 is gone too: nothing shows the operation any more
    with pytest.raises(errors.NotFound):
        _operation(db, ws, op_id)
