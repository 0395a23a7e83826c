"""The audit log: who (token id, name and role, copied in so an entry outlives its token) did
what to what, when, and the outcome. Written in the transaction of the change it records, so
an entry exists exactly when the change does; a refused command is written on its own (its
transaction rolled back).

Bounded by count: the newest ``AUDIT_KEEP`` entries of each workspace are kept (older ones go
as new ones are written, a few at a time).

An entry about a command names its process and the command (None for a refused one, never
created), so a job's page reads its own entries (``command_senders``, ``refused_commands``)."""

from __future__ import annotations

from collections.abc import Collection
from dataclasses import dataclass
from typing import TYPE_CHECKING, cast

from sqlalchemy import ColumnElement, delete, select, update
from sqlalchemy.orm import Session

from flexium import protocol, wire
from flexium.server.models import AuditRecord, Command

if TYPE_CHECKING:  # workspaces imports this module
    from flexium.server.storage.workspaces import AuthInfo

AUDIT_KEEP = 10_000  # entries per workspace
_PRUNE_EVERY = 20  # entries written between two prunes
SERVER_ACTOR = "server"  # who did what no token did: a command expired, the command line
COMMAND_LINE_ACTOR = "command line"
_CREATED = "command.created"
_REFUSED = "refused"
# What the queue did to a job, beside its commands: a job's timeline shows these entries too.
QUEUE_ACTIONS = ("wait.created", "wait.cancelled", "priority.set")
POLICY_ROLE = "policy"


@dataclass(frozen=True)
class PolicyActor:
    """The server acting on its own, by one of its policies (``server/policies/``): entries name the
    policy where others name a token."""

    name: str  # "resume when free", "make room"

    @property
    def label(self) -> str:
        return f"policy: {self.name}"


def sender_of(actor: AuthInfo | PolicyActor) -> tuple[str, protocol.Door]:
    """Who sent a command as its row, its audit entry and the job's timeline say it: a token's
    name (its id when unnamed) and the door of its request, or the policy."""
    if isinstance(actor, PolicyActor):
        return actor.label[: protocol.MAX_SHORT_TEXT], "policy"
    return (actor.token_name or f"token {actor.token_id}")[: protocol.MAX_SHORT_TEXT], actor.door


def record_audit(
    *,
    session: Session,
    workspace_id: int,
    actor: AuthInfo | PolicyActor | None,
    action: str,
    target: str,
    outcome: str,
    detail: str = "",
    now: float,
    anonymous: str = COMMAND_LINE_ACTOR,
    process_id: str | None = None,
    command_id: int | None = None,
) -> None:
    """``actor`` None: the command line on the database, or the server itself (``anonymous``
    names which)."""
    door: protocol.Door | None = None
    if isinstance(actor, PolicyActor):
        token_id, token_name, role, door = None, actor.label, POLICY_ROLE, "policy"
    elif actor is not None:
        token_id, token_name, role, door = actor.token_id, actor.token_name, actor.role, actor.door
    else:
        token_id, token_name, role = None, anonymous, ""
    row = AuditRecord(
        workspace_id=workspace_id,
        at=now,
        token_id=token_id,
        token_name=token_name[: protocol.MAX_SHORT_TEXT],
        role=role,
        door=door,
        action=action,
        target=target[: protocol.MAX_SHORT_TEXT],
        outcome=outcome[:32],
        detail=detail[: protocol.MAX_LONG_TEXT],
        process_id=process_id,
        command_id=command_id,
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
    *, session: Session, workspace_id: int, limit: int = 100, before_id: int | None = None
) -> list[wire.AuditEntry]:
    """Newest first; ``before_id`` pages back."""
    query = select(AuditRecord).where(AuditRecord.workspace_id == workspace_id)
    if before_id is not None:
        query = query.where(AuditRecord.id < before_id)
    return [_entry(r) for r in session.scalars(query.order_by(AuditRecord.id.desc()).limit(limit))]


def command_senders(
    *, session: Session, workspace_id: int, process_ids: Collection[str], command_ids: Collection[int]
) -> dict[int, wire.AuditEntry]:
    """Command id -> the entry of its creation (who sent it), for these commands of these
    processes."""
    if not command_ids:
        return {}
    rows = session.scalars(
        select(AuditRecord).where(
            AuditRecord.workspace_id == workspace_id,
            AuditRecord.process_id.in_(process_ids),
            AuditRecord.command_id.in_(command_ids),
            AuditRecord.action == _CREATED,
        )
    )
    return {r.command_id: _entry(r) for r in rows if r.command_id is not None}


def refused_commands(
    *, session: Session, workspace_id: int, process_ids: Collection[str], limit: int
) -> list[wire.AuditEntry]:
    """The commands for these processes that the server refused (never created), newest first."""
    refused = (AuditRecord.action == _CREATED, AuditRecord.outcome == _REFUSED)
    return _entries_of(session, workspace_id, process_ids, limit, *refused)


def queue_entries(
    *, session: Session, workspace_id: int, process_ids: Collection[str], limit: int
) -> list[wire.AuditEntry]:
    """These processes' waits queued and cancelled and their priorities set, newest first."""
    return _entries_of(session, workspace_id, process_ids, limit, AuditRecord.action.in_(QUEUE_ACTIONS))


def _entries_of(
    session: Session, workspace_id: int, process_ids: Collection[str], limit: int, *where: ColumnElement[bool]
) -> list[wire.AuditEntry]:
    rows = session.scalars(
        select(AuditRecord)
        .where(AuditRecord.workspace_id == workspace_id, AuditRecord.process_id.in_(process_ids), *where)
        .order_by(AuditRecord.id.desc())
        .limit(limit)
    )
    return [_entry(r) for r in rows]


def _entry(row: AuditRecord) -> wire.AuditEntry:
    return wire.AuditEntry(
        id=row.id,
        at=row.at,
        token_id=row.token_id,
        token_name=row.token_name,
        role=row.role,
        action=row.action,
        target=row.target,
        outcome=row.outcome,
        detail=row.detail,
        process_id=row.process_id,
        command_id=row.command_id,
        door=cast(protocol.Door | None, row.door),
    )


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
    if command.reason:
        parts.append(command.reason)
    return "; ".join(parts)


def record_commands_created(
    *, session: Session, workspace_id: int, actor: AuthInfo | PolicyActor, commands: list[wire.CommandInfo], now: float
) -> list[wire.CommandInfo]:
    """The entry of each command, and the commands stamped with who sent them and by which door
    (their rows keep it: ``sender_of``), whichever way they were created (a request, a policy)."""
    sent_by, door = sender_of(actor)
    ids = [c.id for c in commands]
    session.execute(update(Command).where(Command.id.in_(ids)).values(sent_by=sent_by, door=door))
    commands = [c.model_copy(update={"sent_by": sent_by, "door": door}) for c in commands]
    for command in commands:
        record_audit(
            session=session,
            workspace_id=workspace_id,
            actor=actor,
            action=_CREATED,
            target=_command_label(command),
            outcome="ok",
            detail=_command_detail(command),
            now=now,
            process_id=command.process_id,
            command_id=command.id,
        )
    return commands


def record_command_refused(
    *, session: Session, workspace_id: int, actor: AuthInfo, request: wire.CommandRequest, reason: str, now: float
) -> None:
    target = "" if request.target is None else f" to {request.target}"
    if request.gpus:
        target += " GPU by GPU " + ", ".join(f"{now}={after}" for now, after in request.gpus.items())
    record_audit(
        session=session,
        workspace_id=workspace_id,
        actor=actor,
        action=_CREATED,
        target=f"{request.kind} {request.process_id}{target}",
        outcome=_REFUSED,
        detail=reason,
        now=now,
        process_id=request.process_id,
    )


def record_command_finished(
    *, session: Session, workspace_id: int, actor: AuthInfo | None, command: wire.CommandInfo, now: float
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
        process_id=command.process_id,
        command_id=command.id,
    )


def record_commands_finished(*, session: Session, finished: list[tuple[int, wire.CommandInfo]], now: float) -> None:
    """What the sweep ended: (workspace id, command) each."""
    for workspace_id, command in finished:
        record_command_finished(session=session, workspace_id=workspace_id, actor=None, command=command, now=now)


def record_wait(
    *,
    session: Session,
    workspace_id: int,
    actor: AuthInfo | PolicyActor | None,
    action: str,
    wait: wire.WaitInfo,
    detail: str,
    now: float,
) -> None:
    """A wait of the queue queued (``wait.created``) or cancelled (``wait.cancelled``); ``actor``
    None: the server, on its own (the job is gone, or cannot resume any more)."""
    gpu = f" on {wait.gpu_uuid}" if wait.gpu_uuid else ""
    record_audit(
        session=session,
        workspace_id=workspace_id,
        actor=actor,
        action=action,
        target=f"wait {wait.id} (resume {wait.process_id}{gpu} when free)",
        outcome="ok",
        detail=detail,
        now=now,
        anonymous=SERVER_ACTOR,
        process_id=wait.process_id,
    )
