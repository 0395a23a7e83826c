"""The main page's recent commands, newest first."""

from __future__ import annotations

import math
from dataclasses import dataclass

from sqlalchemy.orm import Session

from flexium import wire
from flexium.server import storage

RECENT_COMMANDS = 15


@dataclass(frozen=True)
class RecentCommands:
    """fragments/commands.html."""

    now: float
    gpu_indexes: dict[str, int | None]
    commands: tuple[wire.CommandInfo, ...]
    simulated: frozenset[str]  # the processes on flexium's simulated host: their timings are no measurements


def recent_commands(*, session: Session, workspace_id: int, now: float) -> RecentCommands:
    # Whether a process is simulated does not depend on when it went silent: any staleness bound does.
    processes = storage.list_processes(session=session, workspace_id=workspace_id, now=now, stale_after=math.inf)
    return RecentCommands(
        now=now,
        gpu_indexes=storage.device_indexes(session=session, workspace_id=workspace_id),
        commands=tuple(storage.list_commands(session=session, workspace_id=workspace_id, limit=RECENT_COMMANDS)),
        simulated=frozenset(p.process_id for p in processes if p.simulated),
    )
