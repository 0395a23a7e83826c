"""The main page's queue, host by host in the one order the server acts in (a higher priority
first, first come first served within one): the paused jobs waiting to resume when free
(``storage.list_waits``), each with the process it is for (its name and link), and the jobs
``flexium run`` starts once they are placed (``storage.list_placements``)."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from sqlalchemy.orm import Session

from flexium import wire
from flexium.server import storage
from flexium.server.storage import AuthInfo

QUEUE_SHOWN = 500  # live waits (and as many placements) the panel lists; a queue that long is read with flexium queue


@dataclass(frozen=True)
class QueueEntry:
    """One place in a host's queue: a paused job's wait, or a job not started yet (a placement)."""

    wait: wire.WaitInfo | None = None
    placement: wire.PlacementInfo | None = None

    @property
    def order(self) -> tuple[int, float]:
        """Its place in the queue's order (``storage.queue_order``)."""
        queued = self.wait or self.placement
        assert queued is not None
        return (-queued.priority, queued.created_at)


@dataclass(frozen=True)
class HostQueue:
    """One host's queue, the next first (a dispatched wait: its resume is under way; a placed
    placement: its room is held until its job starts)."""

    host: str
    entries: tuple[QueueEntry, ...]

    @property
    def waits(self) -> tuple[wire.WaitInfo, ...]:
        return tuple(e.wait for e in self.entries if e.wait is not None)

    @property
    def placements(self) -> tuple[wire.PlacementInfo, ...]:
        return tuple(e.placement for e in self.entries if e.placement is not None)


@dataclass(frozen=True)
class QueuePanel:
    """fragments/queue.html."""

    now: float
    queues: tuple[HostQueue, ...]
    processes: dict[str, wire.ProcessInfo]  # process id -> the process a wait is for, while it is known
    gpu_indexes: dict[str, int | None]


def by_host(waits: Sequence[wire.WaitInfo], placements: Sequence[wire.PlacementInfo]) -> tuple[HostQueue, ...]:
    """Waits and placements, each listed in queue order, as one queue per host, hosts by name."""
    hosts: dict[str, list[QueueEntry]] = {}
    for wait in waits:
        hosts.setdefault(wait.host, []).append(QueueEntry(wait=wait))
    for placement in placements:
        hosts.setdefault(placement.host, []).append(QueueEntry(placement=placement))
    return tuple(
        HostQueue(host=host, entries=tuple(sorted(hosts[host], key=lambda e: e.order))) for host in sorted(hosts)
    )


def queue_panel(*, session: Session, actor: AuthInfo, now: float, stale_after: float) -> QueuePanel:
    workspace_id = actor.workspace_id
    waits = storage.list_waits(session=session, workspace_id=workspace_id, now=now, limit=QUEUE_SHOWN)
    placements = storage.list_placements(
        session=session, workspace_id=workspace_id, actor=actor, now=now, limit=QUEUE_SHOWN
    )
    processes = storage.list_processes(session=session, workspace_id=workspace_id, now=now, stale_after=stale_after)
    return QueuePanel(
        now=now,
        queues=by_host(waits, placements),
        processes={p.process_id: p for p in processes},
        gpu_indexes=storage.device_indexes(session=session, workspace_id=workspace_id),
    )


def waits_by_id(*, session: Session, workspace_id: int, now: float) -> dict[int, wire.WaitInfo]:
    """Every live wait by its id: what the process table and a job's page say of a waiting job."""
    return {
        wait.id: wait
        for wait in storage.list_waits(session=session, workspace_id=workspace_id, now=now, limit=QUEUE_SHOWN)
    }
