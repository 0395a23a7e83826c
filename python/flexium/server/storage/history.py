"""GPU history: each GPU's memory and utilization, one sample a minute at most, kept
``Retention.history_keep_s`` (``--history-keep-days``; the sweep prunes older ones), for the
dashboard's charts. Samples are taken from the device reports the server writes anyway
(``upsert_devices``), so history costs no extra traffic."""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass

from sqlalchemy import delete, select
from sqlalchemy.orm import Session

from flexium import wire
from flexium.server.models import GpuSample
from flexium.server.storage.retention import retention_of

HISTORY_EVERY_S = 60.0


@dataclass(frozen=True)
class Sample:
    at: float
    memory_used: int
    memory_total: int
    utilization: int | None


def record_samples(
    *, session: Session, workspace_id: int, host: str, devices: Iterable[wire.GpuReport], now: float
) -> int:
    """A sample of each GPU of ``devices`` whose last one is a minute old or more; returns how many."""
    reports = {report.uuid: report for report in devices}
    if not reports:
        return 0
    recent = set(
        session.scalars(
            select(GpuSample.uuid)
            .where(
                GpuSample.workspace_id == workspace_id,
                GpuSample.host == host,
                GpuSample.uuid.in_(list(reports)),
                GpuSample.at > now - HISTORY_EVERY_S,
            )
            .distinct()
        )
    )
    added = 0
    for uuid in sorted(reports):
        if uuid in recent:
            continue
        report = reports[uuid]
        session.add(
            GpuSample(
                workspace_id=workspace_id,
                host=host,
                uuid=uuid,
                at=now,
                memory_used=report.memory_used,
                memory_total=report.memory_total,
                utilization=report.utilization,
            )
        )
        added += 1
    return added


def gpu_history(
    *, session: Session, workspace_id: int, since: float, host: str | None = None
) -> dict[tuple[str, str], list[Sample]]:
    """(host, GPU UUID) -> its samples since ``since``, oldest first."""
    query = select(GpuSample).where(GpuSample.workspace_id == workspace_id, GpuSample.at >= since)
    if host is not None:
        query = query.where(GpuSample.host == host)
    history: dict[tuple[str, str], list[Sample]] = {}
    for row in session.scalars(query.order_by(GpuSample.host, GpuSample.uuid, GpuSample.at)):
        history.setdefault((row.host, row.uuid), []).append(
            Sample(at=row.at, memory_used=row.memory_used, memory_total=row.memory_total, utilization=row.utilization)
        )
    return history


def prune_history(*, session: Session, now: float) -> None:
    session.execute(delete(GpuSample).where(GpuSample.at < now - retention_of(session).history_keep_s))
