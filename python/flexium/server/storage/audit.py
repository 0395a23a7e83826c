"""The audit log: who (token id, name and role, copied in so an entry outlives its token) did
what to what, when, and the outcome. Written in the transaction of the change it records, so
an entry exists exactly when the change does; a refused command is written on its own (its
transaction rolled back).

Bounded by count: the newest ``AUDIT_KEEP`` entries of each workspace are kept (older ones go
as new ones are written, a few at a time)."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, Optional

from sqlalchemy import delete, select
from sqlalchemy.orm import Session

from flexium import protocol, wire
from flexium.server.models import AuditRecord
from flexium.server.storage.commands import create_commands, report_command

if TYPE_CHECKING:  # workspaces imports this module
    from flexium.server.storage.workspaces import AuthInfo

AUDIT_KEEP = 10_000  # entries per workspace
_PRUNE_EVERY = 20  # entries written between two prunes
SERVER_ACTOR = "server"  # who did what no token did: a command expired, the command line
COMMAND_LINE_ACTOR = "command line"


def record_audit(
    *,
    session: Session,
    workspace_id: int,
    actor: Optional["AuthInfo"],
    action: str,
    target: str,
    outcome: str,
    detail: str = "",
    now: float,
    anonymous: str = COMMAND_LINE_ACTOR,
) -> None:
    """``actor`` None: the command line on the database, or the server itself (``anonymous``
    names which)."""
    row = AuditRecord(
        workspace_id=workspace_id,
        at=now,
        token_id=actor.token_id if actor is not None else None,
        token_name=(actor.token_name if actor is not None else anonymous)[: protocol.MAX_SHORT_TEXT],
        role=actor.role if actor is not None else "",
        action=action,
        target=target[: protocol.MAX_SHORT_TEXT],
        outcome=outcome[:32],
        detail=detail[: protocol.MAX_LONG_TEXT],
    )
    session.add(row)
    session.flush()
    if row.id % _PRUNE_EVERY == 0:
        _prune(session=session, workspace_id=workspace_id)


def _prune(*, session: Session, workspace_id: int) -> None:
    oldest_kept = session.scalar(
        select(AuditRecord.id)
        .where(AuditRecord.workspace_id == workspace_id)
        .order_by(AuditRecord.id.desc())
        .offset(AUDIT_KEEP - 1)
        .limit(1)
    )
    if oldest_kept is not None:
        session.execute(
            delete(AuditRecord).where(AuditRecord.workspace_id == workspace_id, AuditRecord.id < oldest_kept)
        )


def list_audit(
    *, session: Session, workspace_id: int, limit: int = 100, before_id: Optional[int] = None
) -> list[wire.AuditEntry]:
    """Newest first; ``before_id`` pages back."""
    query = select(AuditRecord).where(AuditRecord.workspace_id == workspace_id)
    if before_id is not None:
        query = query.where(AuditRecord.id < before_id)
    rows = session.scalars(query.order_by(AuditRecord.id.desc()).limit(limit))
    return [
        wire.AuditEntry(
            id=r.id,
            at=r.at,
            token_id=r.token_id,
            token_name=r.token_name,
            role=r.role,
            action=r.action,
            target=r.target,
            outcome=r.outcome,
            detail=r.detail,
        )
        for r in rows
    ]


def _command_label(command: wire.CommandInfo) -> str:
    return f"command {command.id} ({command.kind} {command.process_id})"


def _command_detail(command: wire.CommandInfo) -> str:
    parts = []
    if command.target_uuid:
        parts.append(f"target {command.target_uuid}")
    if command.gpu_moves:
        parts.append("GPU by GPU " + ", ".join(f"{now} -> {after}" for now, after in command.gpu_moves.items()))
    if command.job is not None:
        parts.append(f"rank {command.job.rank} of job operation {command.job.operation_id}")
    if command.error:
        parts.append(command.error)
    return "; ".join(parts)


def record_commands_created(
    *, session: Session, workspace_id: int, actor: "AuthInfo", commands: list[wire.CommandInfo], now: float
) -> None:
    for command in commands:
        record_audit(
            session=session,
            workspace_id=workspace_id,
            actor=actor,
            action="command.created",
            target=_command_label(command),
            outcome="ok",
            detail=_command_detail(command),
            now=now,
        )


def record_command_refused(
    *, session: Session, workspace_id: int, actor: "AuthInfo", request: wire.CommandRequest, reason: str, now: float
) -> None:
    target = "" if request.target is None else f" to {request.target}"
    if request.gpus:
        target += " GPU by GPU " + ", ".join(f"{now}={after}" for now, after in request.gpus.items())
    record_audit(
        session=session,
        workspace_id=workspace_id,
        actor=actor,
        action="command.created",
        target=f"{request.kind} {request.process_id}{target}",
        outcome="refused",
        detail=reason,
        now=now,
    )


def record_command_finished(
    *, session: Session, workspace_id: int, actor: Optional["AuthInfo"], command: wire.CommandInfo, now: float
) -> None:
    """A command's end: reported by its process (``actor``), or decided by the server (None:
    expired, or failed because its process went silent)."""
    record_audit(
        session=session,
        workspace_id=workspace_id,
        actor=actor,
        action="command.finished",
        target=_command_label(command),
        outcome=command.state,
        detail=_command_detail(command),
        now=now,
        anonymous=SERVER_ACTOR,
    )


def record_commands_finished(*, session: Session, finished: list[tuple[int, wire.CommandInfo]], now: float) -> None:
    """What the sweep ended: (workspace id, command) each."""
    for workspace_id, command in finished:
        record_command_finished(session=session, workspace_id=workspace_id, actor=None, command=command, now=now)


def create_commands_audited(
    *, session: Session, workspace_id: int, actor: "AuthInfo", now: float, **request: Any
) -> list[wire.CommandInfo]:
    """``storage.create_commands``, and their audit entries in the same transaction."""
    commands = create_commands(session=session, workspace_id=workspace_id, now=now, **request)
    record_commands_created(session=session, workspace_id=workspace_id, actor=actor, commands=commands, now=now)
    return commands


def report_command_audited(
    *, session: Session, workspace_id: int, actor: "AuthInfo", now: float, **report: Any
) -> tuple[wire.CommandInfo, Optional[wire.ProcessInfo], bool]:
    """``storage.report_command``, and the command's outcome in the audit log when this
    report ended it."""
    command, process, changed = report_command(session=session, workspace_id=workspace_id, now=now, **report)
    if changed and command.state in protocol.FINAL_COMMAND_STATES:
        record_command_finished(session=session, workspace_id=workspace_id, actor=actor, command=command, now=now)
    return command, process, changed
