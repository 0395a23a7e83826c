"""Forgetting a process (``DELETE /processes/{id}``: it exited, or a person removed a stale
entry). Its rows and its commands' go; what is worth keeping goes to the audit log first: who
forgot it, and the outcome of a command it still had under way (ended failed, since nothing
will report it now), which a person waiting for that command would otherwise never learn."""

from __future__ import annotations

from sqlalchemy import select
from sqlalchemy.orm import Session

from flexium import protocol, wire
from flexium.server.models import Command
from flexium.server.storage.audit import record_audit, record_command_finished
from flexium.server.storage.commands import end_command
from flexium.server.storage.processes import find_process
from flexium.server.storage.workspaces import AuthInfo

UNREGISTERED_ERROR = "its process was unregistered (it exited, or was forgotten) before the command finished"


def unregister_process(
    *, session: Session, workspace_id: int, process_id: str, now: float, actor: AuthInfo | None = None
) -> list[wire.CommandInfo]:
    """Forget a process and its commands; the commands it had under way, ended failed (as the
    audit log keeps them). ``actor`` None: the command line."""
    row = find_process(session=session, workspace_id=workspace_id, process_id=process_id, for_update=True)
    ended = []
    for cmd in session.scalars(
        select(Command)
        .where(Command.process_pk == row.pk, Command.state.in_(protocol.ACTIVE_COMMAND_STATES))
        .order_by(Command.id)
        .with_for_update()
    ):
        command = end_command(session=session, cmd=cmd, proc=row, state="failed", error=UNREGISTERED_ERROR, now=now)
        record_command_finished(session=session, workspace_id=workspace_id, actor=actor, command=command, now=now)
        ended.append(command)
    under_way = f"; {', '.join(f'command {c.id} ({c.kind})' for c in ended)} ended failed" if ended else ""
    record_audit(
        session=session,
        workspace_id=workspace_id,
        actor=actor,
        action="process.forgotten",
        target=f"process {process_id}",
        outcome="ok",
        detail=f"on {row.host}{under_way}",
        now=now,
        process_id=process_id,
    )
    session.delete(row)
    return ended
