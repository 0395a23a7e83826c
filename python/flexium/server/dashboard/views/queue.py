"""The main page's queue: the paused jobs waiting to resume when free (``storage.list_waits``), by
host in the order they will resume, each with the process it is for (its name and link)."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from sqlalchemy.orm import Session

from flexium import wire
from flexium.server import storage

QUEUE_SHOWN = 500  # live waits the panel lists; a queue that long is read with flexium queue


@dataclass(frozen=True)
class HostQueue:
    """One host's waits, the next to resume first (a dispatched one: its resume is under way)."""

    host: str
    waits: tuple[wire.WaitInfo, ...]


@dataclass(frozen=True)
class QueuePanel:
    """fragments/queue.html."""

    now: float
    queues: tuple[HostQueue, ...]
    processes: dict[str, wire.ProcessInfo]  # process id -> the process a wait is for, while it is known
    gpu_indexes: dict[str, int | None]


def by_host(waits: Sequence[wire.WaitInfo]) -> tuple[HostQueue, ...]:
    """Waits listed in queue order (host by host) as one group per host, in that order."""
    hosts: dict[str, list[wire.WaitInfo]] = {}
    for wait in waits:
        hosts.setdefault(wait.host, []).append(wait)
    return tuple(HostQueue(host=host, waits=tuple(listed)) for host, listed in hosts.items())


def queue_panel(*, session: Session, workspace_id: int, now: float, stale_after: float) -> QueuePanel:
    waits = storage.list_waits(session=session, workspace_id=workspace_id, now=now, limit=QUEUE_SHOWN)
    processes = storage.list_processes(session=session, workspace_id=workspace_id, now=now, stale_after=stale_after)
    return QueuePanel(
        now=now,
        queues=by_host(waits),
        processes={p.process_id: p for p in processes},
        gpu_indexes=storage.device_indexes(session=session, workspace_id=workspace_id),
    )


def waits_by_id(*, session: Session, workspace_id: int, now: float) -> dict[int, wire.WaitInfo]:
    """Every live wait by its id: what the process table and a job's page say of a waiting job."""
    return {
        wait.id: wait
        for wait in storage.list_waits(session=session, workspace_id=workspace_id, now=now, limit=QUEUE_SHOWN)
    }
