"""A job's priority (``protocol.PRIORITIES``): what the job said when it registered, changed by an
admin; a job of several ranks has one, set on every rank. Its place in the queue follows it."""

from __future__ import annotations

from sqlalchemy import select, update
from sqlalchemy.orm import Session

from flexium import protocol, wire
from flexium.server.models import Process, Wait
from flexium.server.storage.audit import record_audit
from flexium.server.storage.jobs import is_job_rank
from flexium.server.storage.processes import active_command, find_process, shown_process
from flexium.server.storage.workspaces import AuthInfo


def set_priority(
    *,
    session: Session,
    workspace_id: int,
    actor: AuthInfo,
    process_id: str,
    priority: int,
    now: float,
    stale_after: float,
) -> wire.ProcessInfo:
    proc = find_process(session=session, workspace_id=workspace_id, process_id=process_id, for_update=True)
    if is_job_rank(proc):
        members = list(
            session.scalars(
                select(Process)
                .where(Process.workspace_id == workspace_id, Process.job_key == proc.job_key)
                .with_for_update()
            )
        )
        what = f"job {proc.job_key}"
    else:
        members, what = [proc], f"process {proc.process_id}"
    before = max(member.priority for member in members)
    for member in members:
        member.priority = priority
    session.execute(
        update(Wait)
        .where(Wait.process_pk.in_([m.pk for m in members]), Wait.state.in_(protocol.LIVE_WAIT_STATES))
        .values(priority=priority)
    )
    record_audit(
        session=session,
        workspace_id=workspace_id,
        actor=actor,
        action="priority.set",
        target=what,
        outcome="ok",
        detail=f"{protocol.priority_name(before)} -> {protocol.priority_name(priority)}",
        now=now,
        process_id=proc.process_id,
    )
    session.flush()
    return shown_process(
        session=session,
        row=proc,
        now=now,
        stale_after=stale_after,
        active=active_command(session=session, process_pk=proc.pk),
    )
