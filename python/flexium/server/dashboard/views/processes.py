"""The main page's process table: a row for each job of its own, a row for each job of several
ranks with its ranks under it, and each process's last finished command."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from sqlalchemy.orm import Session

from flexium import protocol, wire
from flexium.server import storage
from flexium.server.dashboard.views.devices import drains_of
from flexium.server.dashboard.views.queue import waits_by_id
from flexium.server.errors import NotFound

# How far back the table looks for each process's last finished command (``last_finished``):
# every process, or one named process.
COMMAND_SCAN = 500
_COMMAND_SCAN_ONE = 20


@dataclass(frozen=True)
class TableEntry:
    """A row of the table: a job of several ranks (its ranks rendered under it), else a process."""

    process: wire.ProcessInfo | None = None
    job: wire.JobSummary | None = None

    @property
    def state(self) -> str:
        return self.job.state if self.job is not None else self.process.state if self.process is not None else ""

    @property
    def host(self) -> str:
        """Where the table lists it: a job of several ranks under its first rank's host."""
        return self.job.ranks[0].host if self.job is not None else self.process.host if self.process is not None else ""


def last_finished(commands: Sequence[wire.CommandInfo]) -> dict[str, wire.CommandInfo]:
    """process id -> its newest finished command, from commands listed newest first."""
    last: dict[str, wire.CommandInfo] = {}
    for command in commands:
        if command.state in protocol.FINAL_COMMAND_STATES:
            last.setdefault(command.process_id, command)
    return last


def table_entries(processes: Sequence[wire.ProcessInfo]) -> tuple[TableEntry, ...]:
    """The table's rows in order: a process for a job of its own, a job of several ranks where
    its first rank would be."""
    jobs = {job.key: job for job in storage.summarize_jobs(list(processes))}
    entries: list[TableEntry] = []
    for process in processes:
        job = jobs.pop(process.job.key, None) if process.job is not None and process.job.world_size > 1 else None
        if job is not None:
            entries.append(TableEntry(job=job))
        elif process.job is None or process.job.world_size <= 1:
            entries.append(TableEntry(process=process))
    return tuple(entries)


@dataclass(frozen=True)
class ProcessRows:
    """fragments/rows.html: rows of the table, and what they show of GPUs, commands and the queue.
    ``grouped``: the whole table, of more than one host: a heading per host, its rows under it."""

    now: float
    gpu_indexes: dict[str, int | None]
    entries: tuple[TableEntry, ...]
    last: dict[str, wire.CommandInfo]
    waits: dict[int, wire.WaitInfo]  # wait id -> the live wait a process's wait_id names
    grouped: bool
    host_drains: dict[str, wire.DrainInfo]  # host -> the live drain of every GPU of it, for its heading


def process_rows(
    *,
    session: Session,
    workspace_id: int,
    now: float,
    stale_after: float,
    process_ids: Sequence[str] | None = None,
) -> ProcessRows:
    """Rows of the processes named (those gone are left out), else of every process."""
    if process_ids is None:
        processes = storage.list_processes(session=session, workspace_id=workspace_id, now=now, stale_after=stale_after)
        scanned = storage.list_commands(session=session, workspace_id=workspace_id, limit=COMMAND_SCAN)
        return _rows(
            session=session,
            workspace_id=workspace_id,
            now=now,
            stale_after=stale_after,
            processes=processes,
            scanned=scanned,
            whole=True,
        )
    processes, scanned = [], []
    for process_id in process_ids:
        try:
            processes.append(
                storage.get_process(
                    session=session, workspace_id=workspace_id, process_id=process_id, now=now, stale_after=stale_after
                )
            )
        except NotFound:
            continue
        scanned += storage.list_commands(
            session=session, workspace_id=workspace_id, process_id=process_id, limit=_COMMAND_SCAN_ONE
        )
    return _rows(
        session=session,
        workspace_id=workspace_id,
        now=now,
        stale_after=stale_after,
        processes=processes,
        scanned=scanned,
        whole=False,
    )


def _rows(
    *,
    session: Session,
    workspace_id: int,
    now: float,
    stale_after: float,
    processes: Sequence[wire.ProcessInfo],
    scanned: Sequence[wire.CommandInfo],
    whole: bool,
) -> ProcessRows:
    """``whole``: the whole table (rows of some processes are swapped in where theirs were)."""
    entries = table_entries(processes)
    grouped = whole and len({entry.host for entry in entries}) > 1
    return ProcessRows(
        now=now,
        gpu_indexes=storage.device_indexes(session=session, workspace_id=workspace_id),
        entries=tuple(sorted(entries, key=lambda entry: entry.host)) if grouped else entries,
        last=last_finished(scanned),
        waits=waits_by_id(session=session, workspace_id=workspace_id, now=now),
        grouped=grouped,
        host_drains=drains_of(
            session=session,
            workspace_id=workspace_id,
            now=now,
            stale_after=stale_after,
            hosts={entry.host for entry in entries},
        ).hosts
        if grouped
        else {},
    )
