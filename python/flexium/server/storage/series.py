"""What ``/metrics`` shows per GPU and per job: the dashboard's views of every workspace, read
at scrape time (the database is the truth after a restart, as for the counts by state)."""

from __future__ import annotations

from dataclasses import dataclass

from sqlalchemy import select
from sqlalchemy.orm import Session

from flexium import wire
from flexium.server.models import Workspace
from flexium.server.storage.devices import list_devices
from flexium.server.storage.processes import list_processes


@dataclass(frozen=True)
class WorkspaceSeries:
    workspace: str
    hosts: list[wire.HostInfo]
    processes: list[wire.ProcessInfo]


def metric_series(*, session: Session, now: float, stale_after: float) -> list[WorkspaceSeries]:
    series = []
    for workspace_id, name in session.execute(select(Workspace.id, Workspace.name).order_by(Workspace.name)):
        series.append(
            WorkspaceSeries(
                workspace=name,
                hosts=list_devices(session=session, workspace_id=workspace_id, now=now, stale_after=stale_after).hosts,
                processes=list_processes(session=session, workspace_id=workspace_id, now=now, stale_after=stale_after),
            )
        )
    return series
