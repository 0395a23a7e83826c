"""Training history: each process's steps, steps/s and loss, one sample every
``PROGRESS_EVERY_S`` at most, kept ``Retention.progress_keep_s``, for the job page's curves. Samples are
copied by the sweep from the progress the heartbeats already store (``Process.steps`` ...), so
history costs no extra traffic and no write on the heartbeat's path."""

from __future__ import annotations

from dataclasses import dataclass

from sqlalchemy import and_, delete, exists, insert, select
from sqlalchemy.orm import Session, aliased

from flexium.server.models import Process, ProgressSample
from flexium.server.storage.retention import retention_of

PROGRESS_EVERY_S = 10.0  # a first curve within a minute of the job's start


@dataclass(frozen=True)
class ProgressPoint:
    at: float  # when the process reported it
    steps: int | None
    steps_per_s: float | None
    loss: float | None


def sample_progress(*, session: Session, now: float) -> None:
    """A sample of each process whose last report of steps is ``PROGRESS_EVERY_S`` newer than
    its last sample, taken at the report's time (so a process that stopped reporting adds none)."""
    kept = aliased(ProgressSample)
    recent = exists().where(and_(kept.process_pk == Process.pk, kept.at > Process.steps_at - PROGRESS_EVERY_S))
    reported = select(Process.pk, Process.steps_at, Process.steps, Process.steps_per_s, Process.loss).where(
        Process.steps_at.is_not(None), Process.steps_at > now - retention_of(session).progress_keep_s, ~recent
    )
    session.execute(insert(ProgressSample).from_select(["process_pk", "at", "steps", "steps_per_s", "loss"], reported))


def progress_history(*, session: Session, workspace_id: int, process_id: str, since: float) -> list[ProgressPoint]:
    """The samples of one process since ``since``, oldest first (none for an unknown process)."""
    query = (
        select(ProgressSample)
        .join(Process, Process.pk == ProgressSample.process_pk)
        .where(Process.workspace_id == workspace_id, Process.process_id == process_id, ProgressSample.at >= since)
        .order_by(ProgressSample.at)
    )
    return [
        ProgressPoint(at=row.at, steps=row.steps, steps_per_s=row.steps_per_s, loss=row.loss)
        for row in session.scalars(query)
    ]


def prune_progress(*, session: Session, now: float) -> None:
    session.execute(delete(ProgressSample).where(ProgressSample.at < now - retention_of(session).progress_keep_s))
