"""What ``/metrics`` shows per GPU and per job of one workspace: the dashboard's views of it (the
database is the truth after a restart, as for the counts by state)."""

from __future__ import annotations

from dataclasses import dataclass

from sqlalchemy.orm import Session

from flexium import wire
from flexium.server.storage.devices import list_devices
from flexium.server.storage.processes import list_processes


@dataclass(frozen=True)
class WorkspaceSeries:
    workspace: str
    hosts: list[wire.HostInfo]
    processes: list[wire.ProcessInfo]


def workspace_series(
    *, session: Session, workspace_id: int, workspace: str, now: float, stale_after: float
) -> WorkspaceSeries:
    return WorkspaceSeries(
        workspace=workspace,
        hosts=list_devices(session=session, workspace_id=workspace_id, now=now, stale_after=stale_after).hosts,
        processes=list_processes(session=session, workspace_id=workspace_id, now=now, stale_after=stale_after),
    )
