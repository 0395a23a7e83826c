"""What a command must pass before it is written: its target, the process's state and
capabilities, one active command per process, where a resume goes; on SQLite and PostgreSQL."""

from __future__ import annotations

import re
import threading
from typing import Any

import pytest
from sqlalchemy import select

from flexium import wire
from flexium.server import errors, models, storage
from flexium.server.db import Database
from support.server import GIB, gpu
from support.storage import (
    NOW,
    STALE,
    add_process,
    make_command,
    make_workspace,
    next_for,
    report,
)


def test_migrate_checks(db: Database) -> None:
    ws, _ = make_workspace(db)
    devices = [
        gpu(0, used=10 * GIB),
        gpu(1, used=135 * GIB),
        gpu(2, name="NVIDIA A100"),
        gpu(3, health="xid 79"),
        gpu(4),
    ]
    add_process(db, ws, "gpu-1", devices=devices)
    add_process(db, ws, "gpu-far", host="node2", gpu_index=0, n_gpus=1, devices=[{**gpu(0), "uuid": "GPU-far"}])
    cases = [
        ("nope", 4, errors.NotFound),
        ("gpu-1", None, errors.InvalidRequest),
        ("gpu-1", "GPU-0000", errors.TargetRefused),  # already there
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
            make_command(db, ws, "migrate", process_id, target)
        assert info.value.message, (process_id, target)
    with pytest.raises(errors.TargetRefused, match="other|host"):
        make_command(db, ws, "migrate", "gpu-1", "GPU-far")
    cmd = make_command(db, ws, "migrate", "gpu-1", "cuda:4")
    assert cmd.state == "queued" and cmd.target_uuid == "GPU-0004"
    assert "target_index" not in cmd.model_dump() and "target_device" not in cmd.model_dump()


def test_room_by_a_report_older_than_the_command_is_the_jobs_to_judge(db: Database) -> None:
    """A GPU whose last report shows too little room is not refused: the report is older than the
    command, and the job's own room check, on fresh state, has the last word (it refuses before
    anything changes). A dialog still shows what the report says."""
    ws, _ = make_workspace(db)
    add_process(db, ws, "gpu-1", devices=[gpu(0, used=10 * GIB), gpu(1, used=135 * GIB)])
    judged = db.run(
        storage.judge_targets,
        write=False,
        workspace_id=ws,
        process_id="gpu-1",
        kind="migrate",
        now=NOW,
        stale_after=STALE,
    )
    assert judged[1].refusal == "5.0 GiB free, the job needs 10.0 GiB plus 0.5 GiB headroom"
    assert make_command(db, ws, "migrate", "gpu-1", 1).target_uuid == "GPU-0001"


def test_target_text_has_one_meaning_each(db: Database) -> None:
    """cuda:N = entry N of the job's visible_gpus; a bare integer (or digits) = the nvidia-smi
    index on its host; GPU-... = a UUID. The job below sees GPU 3 as cuda:0 and GPU 1 as cuda:1."""
    ws, _ = make_workspace(db)
    add_process(db, ws, "gpu-1", gpu_index=3, visible_gpus=["GPU-0003", "GPU-0001", "GPU-0002"])
    proc = db.run(storage.get_process, write=False, workspace_id=ws, process_id="gpu-1", now=NOW, stale_after=STALE)
    for target, uuid in (
        ("cuda:1", "GPU-0001"),
        (2, "GPU-0002"),
        ("2", "GPU-0002"),
        ("1", "GPU-0001"),
        ("GPU-0002", "GPU-0002"),
        ("cuda:2", "GPU-0002"),
    ):
        cmd = make_command(db, ws, "migrate", "gpu-1", target)
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
        make_command(db, ws, "migrate", "gpu-1", "cuda:0")
    # what is shown is derived from the UUID: the job's own ordinal, the host's index
    assert wire.cuda_ordinal(proc.visible_gpus, "GPU-0001") == "cuda:1"
    assert wire.cuda_ordinal(proc.visible_gpus, "GPU-0000") is None
    assert (proc.gpu_index, proc.physical_device) == (3, "cuda:0")  # derived: the host's index, the job's cuda:N
    assert db.run(storage.device_indexes, write=False, workspace_id=ws)["GPU-0001"] == 1


def test_unknown_health_is_a_target_known_bad_is_not(db: Database) -> None:
    ws, _ = make_workspace(db)
    add_process(db, ws, devices=[gpu(0, used=10 * GIB), gpu(1, health="unknown"), gpu(2, health="ecc_errors")])
    with pytest.raises(errors.TargetRefused, match="ecc_errors"):
        make_command(db, ws, "migrate", target=2)
    assert make_command(db, ws, "migrate", target=1).target_uuid == "GPU-0001"


def test_target_not_visible_to_process(db: Database) -> None:
    ws, _ = make_workspace(db)
    add_process(db, ws, "gpu-1", visible_gpus=["GPU-0000", "GPU-0001"])
    with pytest.raises(errors.TargetRefused, match="not visible"):
        make_command(db, ws, "migrate", "gpu-1", 2)
    assert make_command(db, ws, "migrate", "gpu-1", 1).target_uuid == "GPU-0001"


def test_state_and_capability_checks(db: Database) -> None:
    ws, _ = make_workspace(db)
    add_process(db, ws, "paused", state="PAUSED")
    add_process(db, ws, "old-driver", migration=False, pause_resume=True)
    add_process(db, ws, "no-ckpt", migration=False, pause_resume=False)
    add_process(db, ws, "running")
    with pytest.raises(errors.InvalidState, match="PAUSED"):
        make_command(db, ws, "pause", "paused")
    with pytest.raises(errors.InvalidState, match="resume it"):
        make_command(db, ws, "migrate", "paused", 1)
    with pytest.raises(errors.InvalidState, match="RUNNING"):
        make_command(db, ws, "resume", "running")
    with pytest.raises(errors.CapabilityMissing, match="migrat"):
        make_command(db, ws, "migrate", "old-driver", 1)
    with pytest.raises(errors.CapabilityMissing, match="pause"):
        make_command(db, ws, "pause", "no-ckpt")
    with pytest.raises(errors.InvalidRequest):
        make_command(db, ws, "pause", "running", 1)
    with pytest.raises(errors.InvalidRequest):
        make_command(db, ws, "explode", "running")
    assert make_command(db, ws, "pause", "old-driver").kind == "pause"


def test_capability_refusal_quotes_the_process_problems(db: Database) -> None:
    ws, _ = make_workspace(db)
    cpu = "flexium's engine is not running in this process (training on cpu)"
    add_process(db, ws, "cpu-job", capabilities={"pause_resume": False, "migration": False, "problems": [cpu]})
    with pytest.raises(errors.CapabilityMissing) as info:
        make_command(db, ws, "pause", "cpu-job")
    assert cpu in info.value.message and "driver" not in info.value.message
    add_process(db, ws, "old", capabilities={"pause_resume": True, "migration": False})
    with pytest.raises(errors.CapabilityMissing, match="580"):
        make_command(db, ws, "migrate", "old", 1)


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
    ws, _ = make_workspace(db)
    add_process(db, ws, "rank-0", capabilities=reported.model_dump(mode="json"))
    for kind, target in (("pause", None), ("migrate", 1)):
        with pytest.raises(errors.CapabilityMissing) as info:
            make_command(db, ws, kind, "rank-0", target)
        assert info.value.message.startswith(f"process 'rank-0' cannot {kind}: it reports no ")
        assert "this process is rank 0 of 2 of a torch.distributed job" in info.value.message
        assert "the job cannot be paused or moved as a whole: the job has not started its process group" in (
            info.value.message
        )
        assert "driver" not in info.value.message


def test_stale_process_refuses_commands(db: Database) -> None:
    ws, _ = make_workspace(db)
    add_process(db, ws, now=NOW)
    with pytest.raises(errors.Stale):
        make_command(db, ws, "pause", now=NOW + STALE + 1)


def test_one_active_command_per_process(db: Database) -> None:
    ws, _ = make_workspace(db)
    add_process(db, ws)
    first = make_command(db, ws, "pause")
    with pytest.raises(errors.Busy) as info:
        make_command(db, ws, "migrate", target=1)
    assert info.value.detail == {"command_id": first.id}


def test_one_active_command_under_concurrency(db: Database) -> None:
    ws, _ = make_workspace(db)
    add_process(db, ws)
    outcomes: list[str] = []
    barrier = threading.Barrier(6)

    def attempt() -> None:
        barrier.wait()
        try:
            make_command(db, ws, "pause")
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
    ws, _ = make_workspace(db)
    # paused from GPU 0, which is now full: resume goes to the emptiest same-model GPU
    devices = [gpu(0, used=139 * GIB), gpu(1, used=50 * GIB), gpu(2, used=20 * GIB), gpu(3, name="NVIDIA A100")]
    add_process(db, ws, "p", state="PAUSED", memory=0, footprint_bytes=30 * GIB, devices=devices)
    elsewhere = make_command(db, ws, "resume", "p")
    assert elsewhere.target_uuid == "GPU-0002"
    assert elsewhere.reason == (  # the command line and the job's timeline say why
        "to GPU 2, the one with the most room (where it paused: GPU 0, 1.0 GiB free, the job needs 30.0 GiB)"
    )
    # room on its own GPU: resume there
    add_process(db, ws, "q", state="PAUSED", memory=0, footprint_bytes=30 * GIB, host="n2", n_gpus=2)
    home = make_command(db, ws, "resume", "q")
    assert home.target_uuid == "GPU-0000" and home.reason is None
    # cannot migrate and its GPU is full by the last report: it resumes there, the job judging the room
    add_process(
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
    # explicit other GPU needs migration
    with pytest.raises(errors.CapabilityMissing):
        make_command(db, ws, "resume", "r", 1)
    assert make_command(db, ws, "resume", "r").target_uuid == "GPU-0000"
    # explicit GPU without room by the last report: sent, the job judges
    add_process(
        db,
        ws,
        "s",
        state="PAUSED",
        memory=0,
        footprint_bytes=30 * GIB,
        host="n4",
        devices=[gpu(0), gpu(1, used=139 * GIB)],
    )
    assert make_command(db, ws, "resume", "s", 1).target_uuid == "GPU-0001"


def test_resume_without_device_reports_lets_process_choose(db: Database) -> None:
    ws, _ = make_workspace(db)
    add_process(db, ws, "p", state="PAUSED", memory=0, devices=[])
    cmd = make_command(db, ws, "resume", "p")
    assert cmd.target_uuid is None


def test_a_job_on_two_gpus_needs_room_for_the_share_that_moves(db: Database) -> None:
    """A process holding 100 GiB on each of GPUs 0 and 1: a migration moves its own device's
    share; onto GPU 1 (its other one) the restore swaps the two shares. Judged against its whole
    200 GiB, no 140 GiB GPU could take it. One process per host: one command each. (The target
    rules judge it so; a command leaves room to the job, see the test above.)"""
    ws, _ = make_workspace(db)
    for host in ("n1", "n2", "n3"):
        devices = [gpu(0, used=100 * GIB), gpu(1, used=100 * GIB), gpu(2, used=20 * GIB), gpu(3, used=60 * GIB)]
        devices[0]["process_bytes"], devices[1]["process_bytes"] = 100 * GIB, 100 * GIB
        add_process(db, ws, f"dp-{host}", host=host, memory=200 * GIB, devices=devices)
    judged = {
        host: db.run(
            storage.judge_targets,
            write=False,
            workspace_id=ws,
            process_id=f"dp-{host}",
            kind="migrate",
            now=NOW,
            stale_after=STALE,
        )
        for host in ("n1", "n2", "n3")
    }
    assert judged["n1"][1].refusal is None  # a swap
    assert judged["n2"][2].refusal is None
    assert judged["n3"][3].refusal == "80.0 GiB free, the job needs 100.0 GiB plus 0.5 GiB headroom"
    assert make_command(db, ws, "migrate", "dp-n1", target=1).target_uuid == "GPU-0001"


def test_a_process_on_two_gpus_is_moved_gpu_by_gpu(db: Database) -> None:
    """gpus names where the memory on each GPU the process uses goes: checked move by move for
    that GPU's share, stored on the command (UUID to UUID), handed to the process as such."""
    ws, _ = make_workspace(db)
    devices = [gpu(0, used=3 * GIB), gpu(1, used=2 * GIB), gpu(2, used=0), gpu(3, used=138 * GIB)]
    devices[0]["process_bytes"], devices[1]["process_bytes"] = 3 * GIB, 2 * GIB
    add_process(db, ws, "dp", memory=5 * GIB, devices=devices)

    refusals: dict[str, dict[str, Any]] = {
        "holds nothing on GPU GPU-0002 (2): gpus name the GPUs it uses (GPU-0000, GPU-0001)": {"2": 3},
        "two GPUs of process 'dp' cannot both go to GPU GPU-0002": {"0": 2, "1": 2},
        "the job is already on it": {"GPU-0001": "GPU-0001"},
        "gpus names no GPU": {},
    }
    for message, gpus in refusals.items():
        with pytest.raises((errors.TargetRefused, errors.InvalidRequest), match=re.escape(message)):
            make_command(db, ws, "migrate", "dp", gpus=gpus)
    with pytest.raises(errors.InvalidRequest, match="gpus is for a migrate of one process on several GPUs"):
        make_command(db, ws, "migrate", "dp", target=2, gpus={"0": 2})

    # Its GPU 1's memory onto GPU 0, which its own device leaves.
    command = make_command(db, ws, "migrate", "dp", gpus={"0": 2, "cuda:1": 0})
    assert command.gpu_moves == {"GPU-0000": "GPU-0002", "GPU-0001": "GPU-0000"}
    assert command.target_uuid == "GPU-0002"  # where the process's own device goes
    with db.session(write=False) as s:
        assert s.scalar(select(models.Command.gpu_moves)) == command.gpu_moves

    # Done: it is shown where each GPU's memory went at once, before its next device report.
    next_for(db, ws, "dp")
    report(db, ws, command.id, "running")
    _command_after, shown, changed = report(db, ws, command.id, "succeeded", process={"state": "RUNNING"})
    assert changed and (shown.gpu_uuid, shown.other_gpus) == ("GPU-0002", ["GPU-0000"])
