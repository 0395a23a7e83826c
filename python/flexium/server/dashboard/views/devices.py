"""The GPU cards: each host's GPUs as its jobs report them, each GPU's history charts, and the
drains that take GPUs out of use."""

from __future__ import annotations

from collections.abc import Sequence
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


def history_chart(samples: Sequence[storage.Sample], now: float) -> HistoryChart:
    """From the GPU's first kept sample to now (at most the retention: a GPU seen for an hour
    fills the chart)."""
    since = max(now - storage.HISTORY_KEEP_S, min((s.at for s in samples), default=now))
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
    since = now - storage.HISTORY_KEEP_S
    kept: dict[GpuKey, list[storage.Sample]] = {}
    for host in [None] if hosts is None else hosts:
        kept.update(storage.gpu_history(session=session, workspace_id=workspace_id, since=since, host=host))
    return {key: history_chart(samples, now) for key, samples in kept.items()}


def drains_of(
    *, session: Session, workspace_id: int, now: float, stale_after: float, hosts: Sequence[wire.HostInfo]
) -> dict[GpuKey, wire.DrainInfo]:
    """The live drain of each GPU of these hosts that has one (a drain of a whole host is each of its GPUs')."""
    drained: dict[GpuKey, wire.DrainInfo] = {}
    for host in hosts:
        for drain in storage.list_drains(
            session=session, workspace_id=workspace_id, now=now, stale_after=stale_after, host=host.host
        ):
            for device in host.devices:
                if drain.gpu_uuid in (None, device.uuid):
                    drained[(host.host, device.uuid)] = drain
    return drained


@dataclass(frozen=True)
class HostCards:
    """fragments/hosts.html: the GPU cards of some hosts, or of all, and the drains of their GPUs."""

    now: float
    hosts: tuple[wire.HostInfo, ...]
    history: dict[GpuKey, HistoryChart]
    drains: dict[GpuKey, wire.DrainInfo]


def host_cards(
    *, session: Session, workspace_id: int, now: float, stale_after: float, hosts: Sequence[str] | None = None
) -> HostCards:
    shown = hosts_of(session=session, workspace_id=workspace_id, now=now, stale_after=stale_after, hosts=hosts)
    return HostCards(
        now=now,
        hosts=shown,
        history=charts_of(session=session, workspace_id=workspace_id, now=now, hosts=hosts),
        drains=drains_of(session=session, workspace_id=workspace_id, now=now, stale_after=stale_after, hosts=shown),
    )
