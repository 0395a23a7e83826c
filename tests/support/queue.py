"""What the queue's storage tests share: an admin acting, paused jobs, a host's GPU reports, a
job queued, the queue's pass and what it resumed."""

from __future__ import annotations

from typing import Any

from flexium import protocol, wire
from flexium.server import storage
from flexium.server.db import Database
from flexium.server.policies.resume_when_free import Queued, QueueOutcome, queue_resume, run_queue
from flexium.server.settings import BACKFILL_PATIENCE_S
from flexium.server.storage.workspaces import AuthInfo
from support.server import GIB, gpu
from support.storage import NOW, STALE, add_process

HOST = "node1"


def admin(ws: int) -> AuthInfo:
    return AuthInfo(workspace_id=ws, workspace="team", token_id=1, role="admin", token_name="alice")


def paused(db: Database, ws: int, process_id: str, *, footprint: int = 30 * GIB, home: int = 0, **fields: Any) -> None:
    fields.setdefault("visible_gpus", ["GPU-0000", "GPU-0001"])
    add_process(
        db, ws, process_id, state="PAUSED", memory=0, footprint_bytes=footprint, gpu_index=home, devices=[], **fields
    )


def gpus_report(db: Database, ws: int, now: float, *used: int, host: str = HOST) -> None:
    """The host's GPUs as a heartbeat reports them at ``now``: GPU i with ``used[i]`` in use."""
    reports = [wire.GpuReport.model_validate(gpu(i, used=u)) for i, u in enumerate(used)]
    db.run(storage.upsert_devices, write=True, workspace_id=ws, host=host, devices=reports, now=now)


def queue(
    db: Database, ws: int, process_id: str, now: float = NOW, *, patience: float = BACKFILL_PATIENCE_S, **request: Any
) -> wire.WaitCreated:
    queued: Queued = db.run(
        queue_resume,
        write=True,
        workspace_id=ws,
        actor=admin(ws),
        request=wire.WaitRequest(process_id=process_id, **request),
        now=now,
        stale_after=STALE,
        reservation_ttl=protocol.RESERVATION_TTL_S,
        backfill_patience=patience,
    )
    return queued.answer


def run(db: Database, now: float, *, patience: float = BACKFILL_PATIENCE_S) -> QueueOutcome:
    """The queue's pass over every host at ``now``, with the server's default backfill patience unless
    told."""
    outcome: QueueOutcome = db.run(run_queue, write=True, now=now, stale_after=STALE, backfill_patience=patience)
    return outcome


def resumed(outcome: QueueOutcome) -> list[str]:
    return [command.process_id for done in outcome.dispatched for command in done.commands]


def waits(db: Database, ws: int, now: float = NOW) -> dict[str, wire.WaitInfo]:
    return {w.process_id: w for w in db.run(storage.list_waits, write=False, workspace_id=ws, now=now)}
