"""Housekeeping the server runs every few seconds: expire commands nobody picked up, fail
commands whose process died mid-operation (what either means to the queue's waits included),
forget processes and GPUs silent for too long, drop room held past its time.

``alive_since`` is when this server started: a process cannot heartbeat while the server is
down, so silence is only counted from then (a restart must not delete attached jobs)."""

from __future__ import annotations

from dataclasses import dataclass, field

from sqlalchemy import delete, exists, select
from sqlalchemy.orm import Session

from flexium import protocol, wire
from flexium.server.models import Command, Device, JobOperation, Process
from flexium.server.storage.commands import end_command
from flexium.server.storage.history import prune_history
from flexium.server.storage.processes import shown_processes
from flexium.server.storage.progress_history import prune_progress, sample_progress
from flexium.server.storage.reservations import expire_reservations
from flexium.server.storage.staleness import process_heard, process_stale


@dataclass
class SweepResult:
    expired: list[tuple[int, wire.CommandInfo]] = field(default_factory=list)  # (workspace, command)
    failed: list[tuple[int, wire.CommandInfo]] = field(default_factory=list)
    removed: list[tuple[int, str]] = field(default_factory=list)  # (workspace, process id)
    newly_stale: list[tuple[int, wire.ProcessInfo]] = field(default_factory=list)  # (workspace, process)
    released: list[tuple[int, str]] = field(default_factory=list)  # (workspace, host) of expired reservations


def sweep(
    *,
    session: Session,
    now: float,
    alive_since: float,
    stale_after: float,
    remove_after: float,
    command_ttl: float,
    stale_since: float,
    reservation_ttl: float,
) -> SweepResult:
    """``stale_since``: the previous sweep's time; processes that became stale after it are
    reported once in ``newly_stale``."""
    result = SweepResult()
    for cmd, proc in session.execute(
        select(Command, Process)
        .join(Process, Process.pk == Command.process_pk)
        .where(Command.state.in_(protocol.PENDING_COMMAND_STATES), Command.created_at < now - command_ttl)
        .with_for_update()
    ):
        error = f"not started within {command_ttl:.0f} s"
        command = end_command(session=session, cmd=cmd, proc=proc, state="expired", error=error, now=now)
        result.expired.append((cmd.workspace_id, command))
    if alive_since < now - stale_after:  # silence is counted only while we were up
        for cmd, proc in session.execute(
            select(Command, Process)
            .join(Process, Process.pk == Command.process_pk)
            .where(
                Command.state == "running",
                process_stale(now=now, stale_after=stale_after),
                Command.started_at < now - command_ttl,
            )
            .with_for_update()
        ):
            error = "the process stopped reporting during the operation"
            command = end_command(session=session, cmd=cmd, proc=proc, state="failed", error=error, now=now)
            result.failed.append((cmd.workspace_id, command))
    if alive_since <= now - remove_after:
        doomed = list(
            session.execute(
                select(Process.pk, Process.workspace_id, Process.process_id).where(
                    Process.last_seen < now - remove_after
                )
            )
        )
        if doomed:
            pks = [d.pk for d in doomed]
            session.execute(delete(Command).where(Command.process_pk.in_(pks)))
            # What this sweep deleted, not what it found: another replica's sweep, or an unregister,
            # may have deleted some first, and said so (one `removed` event each).
            removed = session.execute(
                delete(Process).where(Process.pk.in_(pks)).returning(Process.workspace_id, Process.process_id)
            )
            result.removed = [(ws, process_id) for ws, process_id in removed]
            # A job operation is its ranks' commands: once none is left, nothing shows it.
            session.execute(delete(JobOperation).where(~exists().where(Command.operation_id == JobOperation.id)))
        session.execute(delete(Device).where(Device.updated_at < now - remove_after))
    result.released = expire_reservations(session=session, now=now, ttl=reservation_ttl)
    prune_history(session=session, now=now)
    sample_progress(session=session, now=now)
    prune_progress(session=session, now=now)
    newly_stale: dict[int, list[Process]] = {}
    for proc in session.scalars(
        select(Process)
        .where(process_stale(now=now, stale_after=stale_after), process_heard(now=stale_since, stale_after=stale_after))
        .order_by(Process.workspace_id, Process.host, Process.registered_at, Process.pk)
    ):
        newly_stale.setdefault(proc.workspace_id, []).append(proc)
    for ws, rows in newly_stale.items():  # what they share read once a workspace, not once a process
        shown = shown_processes(
            session=session, workspace_id=ws, rows=rows, now=now, stale_after=stale_after, active={}
        )
        result.newly_stale += [(ws, view) for view in shown]
    return result
