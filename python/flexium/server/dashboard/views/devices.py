"""The GPU cards: each host's GPUs as its jobs report them, each GPU's history charts, and the
drains that take GPUs out of use."""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass

from sqlalchemy.orm import Session

from flexium import wire
from flexium.server import storage
from flexium.server.dashboard.formatters import fmt_duration, sparkline

GpuKey = tuple[str, str]  # (host, GPU UUID)


@dataclass(frozen=True)
class HistoryChart:
    """A GPU's memory (share of its total) and utilization charts, as SVG polyline points."""

    memory: str
    utilization: str
    samples: int
    peak_memory: int
    peak_util: int | None
    span: str


def history_chart(samples: Sequence[storage.Sample], now: float, keep_s: float) -> HistoryChart:
    """From the GPU's first kept sample to now (at most ``keep_s``, the retention: a GPU seen for
    an hour fills the chart)."""
    since = max(now - keep_s, min((s.at for s in samples), default=now))
    times = [s.at for s in samples]
    memory = [s.memory_used / s.memory_total if s.memory_total else None for s in samples]
    util = [None if s.utilization is None else s.utilization / 100 for s in samples]
    return HistoryChart(
        memory=sparkline(memory, times, since=since, until=now),
        utilization=sparkline(util, times, since=since, until=now),
        samples=len(samples),
        peak_memory=max((s.memory_used for s in samples), default=0),
        peak_util=max((s.utilization for s in samples if s.utilization is not None), default=None),
        span=fmt_duration(now - since, precise=False),
    )


def hosts_of(
    *, session: Session, workspace_id: int, now: float, stale_after: float, hosts: Sequence[str] | None = None
) -> tuple[wire.HostInfo, ...]:
    """The hosts named (those that report no GPU left out), else every host."""
    if hosts is None:
        return tuple(
            storage.list_devices(session=session, workspace_id=workspace_id, now=now, stale_after=stale_after).hosts
        )
    return tuple(
        entry
        for host in hosts
        for entry in storage.list_devices(
            session=session, workspace_id=workspace_id, now=now, stale_after=stale_after, host=host
        ).hosts
    )


def charts_of(
    *, session: Session, workspace_id: int, now: float, hosts: Sequence[str] | None = None
) -> dict[GpuKey, HistoryChart]:
    """The history chart of every GPU of the hosts named, else of every host."""
    keep_s = storage.retention_of(session).history_keep_s
    since = now - keep_s
    kept: dict[GpuKey, list[storage.Sample]] = {}
    for host in [None] if hosts is None else hosts:
        kept.update(storage.gpu_history(session=session, workspace_id=workspace_id, since=since, host=host))
    return {key: history_chart(samples, now, keep_s) for key, samples in kept.items()}


@dataclass(frozen=True)
class Drains:
    """The live drains of some hosts: a GPU's own, and a whole host's (each of its GPUs is drained
    by it too)."""

    gpus: dict[GpuKey, wire.DrainInfo]
    hosts: dict[str, wire.DrainInfo]

    def of(self, host: str, uuid: str) -> wire.DrainInfo | None:
        """What drains this GPU: its own drain, else its host's."""
        return self.gpus.get((host, uuid)) or self.hosts.get(host)


def drains_of(*, session: Session, workspace_id: int, now: float, stale_after: float, hosts: Iterable[str]) -> Drains:
    """The live drains of the hosts named."""
    gpus: dict[GpuKey, wire.DrainInfo] = {}
    whole: dict[str, wire.DrainInfo] = {}
    for host in hosts:
        for drain in storage.list_drains(
            session=session, workspace_id=workspace_id, now=now, stale_after=stale_after, host=host
        ):
            if drain.gpu_uuid is None:
                whole[host] = drain
            else:
                gpus[(host, drain.gpu_uuid)] = drain
    return Drains(gpus=gpus, hosts=whole)


@dataclass(frozen=True)
class HostCards:
    """fragments/hosts.html: the GPU cards of some hosts, or of all, and the drains of their GPUs."""

    now: float
    hosts: tuple[wire.HostInfo, ...]
    history: dict[GpuKey, HistoryChart]
    drains: Drains


def host_cards(
    *, session: Session, workspace_id: int, now: float, stale_after: float, hosts: Sequence[str] | None = None
) -> HostCards:
    shown = hosts_of(session=session, workspace_id=workspace_id, now=now, stale_after=stale_after, hosts=hosts)
    return HostCards(
        now=now,
        hosts=shown,
        history=charts_of(session=session, workspace_id=workspace_id, now=now, hosts=hosts),
        drains=drains_of(
            session=session, workspace_id=workspace_id, now=now, stale_after=stale_after, hosts=(h.host for h in shown)
        ),
    )


@dataclass(frozen=True)
class HostDrainForm:
    """fragments/drain_host.html: what draining every GPU of a host does, for an admin to confirm:
    the jobs on its GPUs (paused and queued: no GPU of their host is left to move them to) and the
    GPUs drained on their own already."""

    host: wire.HostInfo
    jobs: tuple[wire.ProcessInfo, ...]
    drains: Drains


def host_drain_form(
    *, session: Session, workspace_id: int, host: str, now: float, stale_after: float
) -> HostDrainForm | None:
    """None when the host reports no GPU."""
    shown = hosts_of(session=session, workspace_id=workspace_id, now=now, stale_after=stale_after, hosts=[host])
    if not shown:
        return None
    processes = storage.list_processes(
        session=session, workspace_id=workspace_id, now=now, stale_after=stale_after, host=host
    )
    on_its_gpus = {pid for d in shown[0].devices for pid in d.processes}
    return HostDrainForm(
        host=shown[0],
        jobs=tuple(p for p in processes if p.process_id in on_its_gpus),
        drains=drains_of(
            session=session, workspace_id=workspace_id, now=now, stale_after=stale_after, hosts=(h.host for h in shown)
        ),
    )
