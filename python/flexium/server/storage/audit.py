"""The audit log: who (token id, name and role, copied in so an entry outlives its token) did
what to what, when, and the outcome. Written in the transaction of the change it records, so
an entry exists exactly when the change does; a refused command is written on its own (its
transaction rolled back).

Kept by age and class, never by count (a count is one any reader could fill by logging in
again and again, pushing out what admins did): an access entry (a login, a logout, a refused
login or request) for ``Retention.access_keep_s``, every other one (a change) for its
``change_keep_s`` (the server's settings, ``retention.py``); older
ones go as new ones are written, a few at a time. Access entries are what a viewer, or anyone
with a wrong token, can cause without end: one repeated within ``REPEAT_WITHIN_S`` (same
workspace, action, token and target) counts its repeats in the entry before instead of taking a
row, so a flood of them is a few rows an hour.

An entry about a command names its process and the command (None for a refused one, never
created), so a job's page reads its own entries (``command_senders``, ``refused_commands``)."""

from __future__ import annotations

from collections.abc import Collection
from dataclasses import dataclass
from typing import TYPE_CHECKING, cast

from sqlalchemy import ColumnElement, and_, delete, func, or_, select, update
from sqlalchemy.orm import Session

from flexium import protocol, wire
from flexium.server.models import AuditRecord, Command, Workspace
from flexium.server.storage.retention import retention_of

if TYPE_CHECKING:  # workspaces imports this module
    from flexium.server.storage.workspaces import AuthInfo

ACCESS_ACTIONS = ("login", "logout", "login.refused", "request.refused")  # as migration 0017 has them
REPEAT_WITHIN_S = 3600.0
_PRUNE_EVERY = 20  # entries written between two prunes
SERVER_ACTOR = "server"  # who did what no token did: a command expired, the command line
COMMAND_LINE_ACTOR = "command line"
NO_TOKEN_ACTOR = "no valid token"  # a request refused before any token was known
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


def given_why(why: str | None) -> str:
    """The reason a person gave (``--reason``), as what is done for them carries it after its own:
    the commands a policy sends, and the audit entries of waits and placements; "" for none."""
    return f"; why: {why}" if why else ""


def is_reserved_actor(name: str) -> bool:
    """Whether a token named ``name`` would pass in the audit log, a command's sender or a job's
    timeline for the server, the command line or one of its policies."""
    spoken = " ".join(name.split()).casefold()
    return spoken in (SERVER_ACTOR, COMMAND_LINE_ACTOR, NO_TOKEN_ACTOR) or spoken.startswith(POLICY_ROLE + ":")


def sender_of(actor: AuthInfo | PolicyActor) -> tuple[str, protocol.Door]:
    """Who sent a command as its row, its audit entry and the job's timeline say it: a token's
    name (its id when unnamed) and the door of its request, or the policy."""
    if isinstance(actor, PolicyActor):
        return actor.label[: protocol.MAX_SHORT_TEXT], "policy"
    return (actor.token_name or f"token {actor.token_id}")[: protocol.MAX_SHORT_TEXT], actor.door


@dataclass(frozen=True)
class Refusal:
    """Requests refused (``server/refusals.py``), counted by sender: a workspace's name (it may
    name none of this server's), the token when one was known, and where they came from."""

    workspace: str
    auth: AuthInfo | None
    address: str
    action: str
    times: int
    detail: str
    what: str = ""  # the method and route refused ("" for a login): entries of one kind each


def record_refusals(*, session: Session, refusals: list[Refusal], now: float) -> None:
    """Each as an access entry of its workspace (a workspace named that does not exist: none)."""
    names = {r.workspace for r in refusals}
    named = session.execute(select(Workspace.name, Workspace.id).where(Workspace.name.in_(names)))
    ids = {name: workspace_id for name, workspace_id in named}
    for refusal in refusals:
        workspace_id = ids.get(refusal.workspace)
        if workspace_id is None or (refusal.auth is not None and refusal.auth.workspace_id != workspace_id):
            continue
        record_audit(
            session=session,
            workspace_id=workspace_id,
            actor=refusal.auth,
            action=refusal.action,
            target=f"{refusal.what} from {refusal.address}" if refusal.what else f"from {refusal.address}",
            outcome=_REFUSED,
            detail=refusal.detail,
            now=now,
            anonymous=NO_TOKEN_ACTOR,
            repeats=refusal.times,
        )


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
    repeats: int = 1,
) -> None:
    """``actor`` None: the command line on the database, or the server itself (``anonymous``
    names which); ``repeats``: how many times it happened (refusals counted in memory)."""
    if action in ACCESS_ACTIONS and _repeated(
        session,
        workspace_id=workspace_id,
        actor=actor,
        action=action,
        target=target,
        detail=detail,
        now=now,
        repeats=repeats,
    ):
        return
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
        kept_until=now + _keep_s(session, action),
        repeats=repeats,
        last_at=now if repeats > 1 else None,
    )
    session.add(row)
    session.flush()
    if row.id % _PRUNE_EVERY == 0:
        _prune(session, workspace_id, now)


def _prune(session: Session, workspace_id: int, now: float) -> None:
    """An entry goes at its ``kept_until``, or sooner where the keep of its class is now shorter
    than when it was written: a keep shortened applies to every entry at once, one lengthened to
    entries written from then on."""
    kept = retention_of(session)
    access = AuditRecord.action.in_(ACCESS_ACTIONS)
    session.execute(
        delete(AuditRecord).where(
            AuditRecord.workspace_id == workspace_id,
            or_(
                AuditRecord.kept_until < now,
                and_(access, func.coalesce(AuditRecord.last_at, AuditRecord.at) < now - kept.access_keep_s),
                and_(~access, AuditRecord.at < now - kept.change_keep_s),
            ),
        )
    )


def _keep_s(session: Session, action: str) -> float:
    kept = retention_of(session)
    return kept.access_keep_s if action in ACCESS_ACTIONS else kept.change_keep_s


def _repeated(
    session: Session,
    *,
    workspace_id: int,
    actor: AuthInfo | PolicyActor | None,
    action: str,
    target: str,
    detail: str,
    now: float,
    repeats: int,
) -> bool:
    """Whether this access entry was counted as a repeat of the same one begun within
    ``REPEAT_WITHIN_S`` (its detail then says the last one's)."""
    token_id = actor.token_id if actor is not None and not isinstance(actor, PolicyActor) else None
    target = target[: protocol.MAX_SHORT_TEXT]
    found = session.scalar(
        select(AuditRecord.id)
        .where(
            AuditRecord.workspace_id == workspace_id,
            AuditRecord.action == action,
            AuditRecord.token_id.is_(None) if token_id is None else AuditRecord.token_id == token_id,
            AuditRecord.target == target,
            AuditRecord.at >= now - REPEAT_WITHIN_S,
        )
        .order_by(AuditRecord.id.desc())
        .limit(1)
    )
    if found is None:
        return False
    session.execute(
        update(AuditRecord)
        .where(AuditRecord.id == found)
        .values(
            repeats=AuditRecord.repeats + repeats,
            last_at=now,
            detail=detail[: protocol.MAX_LONG_TEXT],
            kept_until=now + retention_of(session).access_keep_s,
        )
    )
    return True


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
        repeats=row.repeats,
        last_at=row.last_at,
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
