"""The main page: the cluster's totals, the GPU cards, the process table, the queue and the
recent commands, read in one transaction so the parts agree with each other."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from sqlalchemy.orm import Session

from flexium import wire
from flexium.server import storage
from flexium.server.dashboard.views.commands import RecentCommands, recent_commands
from flexium.server.dashboard.views.devices import HostCards, host_cards, hosts_of
from flexium.server.dashboard.views.processes import ProcessRows, TableEntry, process_rows, table_entries
from flexium.server.dashboard.views.queue import QueuePanel, queue_panel
from flexium.server.storage import AuthInfo


@dataclass(frozen=True)
class Totals:
    """The summary over the main page: the GPUs of hosts that report, their memory, the jobs (a
    job of several ranks counts once) by state, and today's moves."""

    gpus: int
    memory_used: int
    memory_total: int
    running: int
    paused: int
    moves_today: int


def start_of_day_utc(now: float) -> float:
    return now - now % 86400


def cluster_totals(
    *, session: Session, workspace_id: int, now: float, hosts: Sequence[wire.HostInfo], entries: Sequence[TableEntry]
) -> Totals:
    devices = [d for h in hosts if not h.stale for d in h.devices]
    states = [entry.state for entry in entries]
    return Totals(
        gpus=len(devices),
        memory_used=sum(d.memory_used for d in devices),
        memory_total=sum(d.memory_total for d in devices),
        running=states.count("RUNNING"),
        paused=states.count("PAUSED"),
        moves_today=storage.count_finished(
            session=session, workspace_id=workspace_id, kind="migrate", state="succeeded", since=start_of_day_utc(now)
        ),
    )


def totals(*, session: Session, workspace_id: int, now: float, stale_after: float) -> Totals:
    """fragments/totals.html, again once events changed what it counts."""
    processes = storage.list_processes(session=session, workspace_id=workspace_id, now=now, stale_after=stale_after)
    return cluster_totals(
        session=session,
        workspace_id=workspace_id,
        now=now,
        hosts=hosts_of(session=session, workspace_id=workspace_id, now=now, stale_after=stale_after),
        entries=table_entries(processes),
    )


@dataclass(frozen=True)
class MainPage:
    """index.html, which includes the fragments of each part."""

    rows: ProcessRows
    cards: HostCards
    queue: QueuePanel
    recent: RecentCommands
    totals: Totals


def main_page(*, session: Session, actor: AuthInfo, now: float, stale_after: float) -> MainPage:
    """As ``actor`` may see it (a job token's placements are its own)."""
    workspace_id = actor.workspace_id
    rows = process_rows(session=session, workspace_id=workspace_id, now=now, stale_after=stale_after)
    cards = host_cards(session=session, workspace_id=workspace_id, now=now, stale_after=stale_after)
    return MainPage(
        rows=rows,
        cards=cards,
        queue=queue_panel(session=session, actor=actor, now=now, stale_after=stale_after),
        recent=recent_commands(session=session, workspace_id=workspace_id, now=now),
        totals=cluster_totals(
            session=session, workspace_id=workspace_id, now=now, hosts=cards.hosts, entries=rows.entries
        ),
    )
