"""Workspaces and their access tokens. Tokens are 256 random bits, so a plain SHA-256 is the
right hash at rest (a slow password hash buys nothing against brute force here and would cost
every request).

A token has a role (``protocol.TOKEN_ROLES``) and remembers the token that minted it:
revoking a token revokes, in the same transaction, every token it minted and theirs, and ends
their dashboard sessions and login codes. A token may expire (``expires_at``): from then on it is
refused as a revoked one is (``token_alive``), and what it minted expires with it at the latest.
Each issue and revocation is written to the audit log in the transaction that makes it."""

from __future__ import annotations

import hashlib
import secrets
from dataclasses import dataclass
from typing import cast

from sqlalchemy import Select, bindparam, delete, func, or_, select, update
from sqlalchemy.orm import Session

from flexium import protocol, wire
from flexium.server.errors import Conflict, InvalidRequest, NotFound, Unauthorized
from flexium.server.models import (
    AuditRecord,
    Command,
    DashboardSession,
    LoginCode,
    Process,
    Token,
    Workspace,
    table_of,
)
from flexium.server.storage import quotas
from flexium.server.storage.audit import is_reserved_actor, record_audit
from flexium.server.storage.staleness import process_heard
from flexium.server.storage.token_validity import expired, token_alive, token_end
from flexium.units import utc_time

# The label of a workspace's first token, which what it does is signed with ("queued by ...").
FIRST_TOKEN_NAME = "first admin token"
# What a request with a token that opens no door is told (the same whatever the reason, as for a
# token that never existed: `flexium token list` says which).
REFUSED_TOKEN = "invalid, revoked or expired token"


@dataclass(frozen=True)
class AuthInfo:
    """Who is calling: a token (``role``, ``protocol.TOKEN_ROLES``), the dashboard session it
    came through, if any, and the door of this request (``auth.require_auth`` says which)."""

    workspace_id: int
    workspace: str
    token_id: int
    role: str  # no default: what a caller may do is always read from its token
    token_name: str = ""
    session_id: int | None = None
    door: protocol.Door = "api"
    expires_at: float | None = None  # the token's (None: valid until revoked)

    def expired(self, now: float) -> bool:
        return expired(self.expires_at, now)


@dataclass(frozen=True)
class WorkspaceDeleted:
    """What went with a workspace (or would go: ``delete_workspace(dry_run=True)``). ``tokens``: those
    that still opened doors, whose holders the running servers are told to refuse; ``heard``: its
    processes heard within ``stale_after`` (process id, host), which train on unmanaged."""

    name: str
    tokens: list[int]
    processes: int
    heard: list[tuple[str, str]]
    commands: int
    audit_entries: int


@dataclass(frozen=True)
class WorkspaceRecord:
    """A workspace without its counts, for the admin commands (which need its id or name);
    the API's view with counts is ``wire.WorkspaceInfo`` (``workspace_summary``)."""

    id: int
    name: str
    created_at: float


def new_token() -> str:
    return protocol.TOKEN_PREFIX + secrets.token_urlsafe(32)


def hash_token(token: str) -> str:
    return hashlib.sha256(token.encode("utf-8", "surrogatepass")).hexdigest()


def _workspace_record(row: Workspace) -> WorkspaceRecord:
    return WorkspaceRecord(id=row.id, name=row.name, created_at=row.created_at)


def token_info(row: Token, now: float) -> wire.TokenInfo:
    return wire.TokenInfo(
        id=row.id,
        name=row.name,
        prefix=row.prefix,
        role=cast(protocol.TokenRole, row.role),  # written only from protocol.TOKEN_ROLES
        minted_by=row.minted_by,
        created_at=row.created_at,
        revoked_at=row.revoked_at,
        revoked=row.revoked_at is not None,
        expires_at=row.expires_at,
        expired=expired(row.expires_at, now),
        last_used_at=row.last_used_at,
    )


def check_workspace_name(name: str) -> str:
    if not isinstance(name, str) or not protocol.WORKSPACE_NAME_RE.fullmatch(name):
        raise InvalidRequest(
            f"invalid workspace name {name!r}: use lowercase letters, digits, "
            "'.', '_', '-' (at most 63, starting with a letter or digit)"
        )
    return name


def create_workspace(
    *, session: Session, name: str, now: float, token_name: str = FIRST_TOKEN_NAME
) -> tuple[WorkspaceRecord, str]:
    """A new workspace and its first token, an admin token (returned in clear once; only its
    hash is kept)."""
    check_workspace_name(name)
    if session.scalar(select(Workspace.id).where(Workspace.name == name)) is not None:
        raise Conflict(f"workspace {name!r} already exists")
    row = Workspace(name=name, created_at=now)
    session.add(row)
    session.flush()
    created = issue_token(session=session, workspace_id=row.id, name=token_name, role=protocol.ROLE_ADMIN, now=now)
    return _workspace_record(row), created.token


def delete_workspace(
    *, session: Session, name: str, now: float, stale_after: float, force: bool = False, dry_run: bool = False
) -> WorkspaceDeleted:
    """The workspace and everything of it, its audit log included (the rows go by their foreign keys'
    cascade). Refused, before anything changes, while any of its processes was heard within
    ``stale_after``: they would train on unheard, their tokens refused, unless ``force``."""
    row = session.scalar(select(Workspace).where(Workspace.name == name).with_for_update())
    if row is None:
        raise _no_workspace(name)

    def count(model: type[Command] | type[Process] | type[AuditRecord]) -> int:
        return session.scalar(select(func.count()).select_from(model).where(model.workspace_id == row.id)) or 0

    heard = [
        (p.process_id, p.host)
        for p in session.execute(
            select(Process.process_id, Process.host)
            .where(Process.workspace_id == row.id, process_heard(now=now, stale_after=stale_after))
            .order_by(Process.host, Process.process_id)
        )
    ]
    if heard and not force:
        shown = ", ".join(f"{process_id} on {host}" for process_id, host in heard[:5])
        more = f" and {len(heard) - 5} more" if len(heard) > 5 else ""
        raise Conflict(
            f"workspace {name!r} has {len(heard)} process(es) heard within the last {stale_after:g} s ({shown}{more}): "
            "deleted, they would train on unmanaged and their tokens be refused. Stop them, or wait until "
            "`flexium ps` shows them STALE, or pass --force",
            detail={"heard": [process_id for process_id, _host in heard]},
        )
    deleted = WorkspaceDeleted(
        name=name,
        tokens=list(session.scalars(select(Token.id).where(Token.workspace_id == row.id, token_alive(now)))),
        processes=count(Process),
        heard=heard,
        commands=count(Command),
        audit_entries=count(AuditRecord),
    )
    if not dry_run:
        session.execute(delete(Workspace).where(Workspace.id == row.id))
    return deleted


def ensure_default_workspace(*, session: Session, now: float) -> str | None:
    """On a database with no workspace at all, create ``default``; returns its token, or None
    when there was nothing to do."""
    if session.scalar(select(func.count()).select_from(Workspace)):
        return None
    _row, token = create_workspace(session=session, name=protocol.DEFAULT_WORKSPACE, now=now)
    return token


def get_workspace(*, session: Session, name: str) -> WorkspaceRecord:
    row = session.scalar(select(Workspace).where(Workspace.name == name))
    if row is None:
        raise _no_workspace(name)
    return _workspace_record(row)


def _no_workspace(name: str) -> NotFound:
    return NotFound(f"workspace {name!r} not found (`flexium workspace list` lists those of the server's database)")


def list_workspaces(*, session: Session) -> list[WorkspaceRecord]:
    return [_workspace_record(r) for r in session.scalars(select(Workspace).order_by(Workspace.name))]


def workspace_summary(*, session: Session, workspace_id: int) -> wire.WorkspaceInfo:
    row = session.get(Workspace, workspace_id)
    if row is None:
        raise NotFound("workspace not found")
    processes = (
        session.scalar(select(func.count()).select_from(Process).where(Process.workspace_id == workspace_id)) or 0
    )
    active = (
        session.scalar(
            select(func.count())
            .select_from(Command)
            .where(Command.workspace_id == workspace_id, Command.state.in_(protocol.ACTIVE_COMMAND_STATES))
        )
        or 0
    )
    return wire.WorkspaceInfo(
        id=row.id, name=row.name, created_at=row.created_at, processes=processes, active_commands=active
    )


def issue_token(
    *,
    session: Session,
    workspace_id: int,
    name: str = "",
    role: str = protocol.DEFAULT_ISSUED_ROLE,
    minted_by: AuthInfo | None = None,
    expires_in_s: float | None = None,
    now: float,
) -> wire.TokenCreated:
    """The new token in clear (``.token``) is in this answer only: only its hash is kept.
    ``minted_by``: the caller, whose revocation will revoke this token too; None for the
    command line on the database (and a workspace's first token). Who may mint is the
    route's rule (admins only). ``expires_in_s``: None, valid until revoked, or until its
    minter expires if that one does: a token never outlives the token that minted it (one that
    asks to is refused)."""
    if role not in protocol.TOKEN_ROLES:
        raise InvalidRequest(f"unknown role {role!r}: use one of {', '.join(protocol.TOKEN_ROLES)}")
    if is_reserved_actor(name):
        raise InvalidRequest(
            f"a token may not be named {name!r}: the audit log names the server, the command line and its "
            "policies so; choose another name"
        )
    expires_at = _expiry(expires_in_s, now)
    if minted_by is not None:
        expires_at = _within_minters_life(_minters_expiry(session=session, minter=minted_by, now=now), expires_at, now)
    quotas.check_new_token(session=session, workspace_id=workspace_id, now=now)
    token = new_token()
    row = Token(
        workspace_id=workspace_id,
        name=name or "",
        token_hash=hash_token(token),
        prefix=token[: len(protocol.TOKEN_PREFIX) + 6],
        created_at=now,
        role=role,
        minted_by=minted_by.token_id if minted_by is not None else None,
        expires_at=expires_at,
    )
    session.add(row)
    session.flush()
    record_audit(
        session=session,
        workspace_id=workspace_id,
        actor=minted_by,
        action="token.issued",
        target=token_label(row),
        outcome="ok",
        detail=f"role {role}" + (f", expires at {utc_time(expires_at)}" if expires_at is not None else ""),
        now=now,
    )
    return wire.TokenCreated(**token_info(row, now).model_dump(), token=token)


def _expiry(expires_in_s: float | None, now: float) -> float | None:
    """``expires_in_s`` as ``wire.TokenRequest`` admits it (its callers' rule)."""
    return None if expires_in_s is None else now + expires_in_s


def _minters_expiry(*, session: Session, minter: AuthInfo, now: float) -> float | None:
    """The minter's end of validity. A server trusts a token's cached auth for a few seconds
    (``Settings.token_cache_s``), so a revocation made elsewhere (the command line, another server)
    would let a leaked admin token mint children the revocation never saw. The minter's row is read
    locked: a revocation that commits first is seen here, one that commits after finds the child in
    its cascade."""
    found = session.scalar(
        select(Token).where(Token.id == minter.token_id, Token.workspace_id == minter.workspace_id).with_for_update()
    )
    if found is None or token_end(found, now) is not None:
        raise Unauthorized(REFUSED_TOKEN, error="invalid_token")
    return found.expires_at


def _within_minters_life(minters: float | None, asked: float | None, now: float) -> float | None:
    if asked is None or minters is None or asked <= minters:
        return asked if asked is not None else minters
    raise InvalidRequest(
        f"the token minting this one expires at {utc_time(minters)}, and a token cannot outlive the token "
        f"that minted it: ask for expires_in_s of at most {minters - now:.0f}, or have the command line issue it "
        "(flexium token issue)"
    )


def token_label(row: Token) -> str:
    return f"token {row.id} ({row.prefix}...{' ' + row.name if row.name else ''})"


def list_tokens(*, session: Session, workspace_id: int, now: float) -> list[wire.TokenInfo]:
    rows = session.scalars(select(Token).where(Token.workspace_id == workspace_id).order_by(Token.id))
    return [token_info(r, now) for r in rows]


def named_token(*, workspace_id: int, token_id: int | None, token: str | None) -> Select[Token]:
    """The workspace's token named by the token itself (when given) or by its id."""
    query = select(Token).where(Token.workspace_id == workspace_id)
    if token is not None:
        return query.where(Token.token_hash == hash_token(token))
    return query.where(Token.id == token_id)


def revoke_token(
    *,
    session: Session,
    workspace_id: int,
    token_id: int | None = None,
    token: str | None = None,
    revoked_by: AuthInfo | None = None,
    now: float,
) -> wire.TokenRevoked:
    """Revoke by id or by the token itself, and with it every token it minted, transitively
    (``cascade``: their ids), ending their dashboard sessions and login codes. Revoking twice
    is not an error (what it minted since is revoked then too). ``revoked_by``: the caller,
    for the audit log; None for the command line."""
    if token is None and token_id is None:
        raise InvalidRequest("name the token to revoke by id or by value")
    row = session.scalar(named_token(workspace_id=workspace_id, token_id=token_id, token=token))
    if row is None:
        raise NotFound("token not found in this workspace (`flexium token list WORKSPACE` lists their ids)")
    cascade = minted_from(session=session, workspace_id=workspace_id, token_id=row.id)
    for revoked in (row, *cascade):
        if revoked.revoked_at is not None:
            continue
        revoked.revoked_at = now
        record_audit(
            session=session,
            workspace_id=workspace_id,
            actor=revoked_by,
            action="token.revoked",
            target=token_label(revoked),
            outcome="ok",
            detail="" if revoked is row else f"minted (directly or not) by token {row.id}, revoked with it",
            now=now,
        )
    ids = [t.id for t in (row, *cascade)]
    session.execute(delete(DashboardSession).where(DashboardSession.token_id.in_(ids)))
    session.execute(delete(LoginCode).where(LoginCode.token_id.in_(ids)))
    registered = session.scalars(
        select(Process.process_id)
        .where(Process.workspace_id == workspace_id, Process.token_id.in_(ids))
        .order_by(Process.host, Process.process_id)
    )
    return wire.TokenRevoked(
        **token_info(row, now).model_dump(), cascade=[t.id for t in cascade], processes=list(registered)
    )


def minted_from(*, session: Session, workspace_id: int, token_id: int) -> list[Token]:
    """The tokens ``token_id`` minted, and those they minted in turn: what revoking it revokes."""
    cascade: list[Token] = []
    seen = {token_id}
    frontier = [token_id]
    while frontier:
        minted = list(
            session.scalars(
                select(Token)
                .where(Token.workspace_id == workspace_id, Token.minted_by.in_(frontier))
                .order_by(Token.id)
            )
        )
        minted = [t for t in minted if t.id not in seen]
        seen.update(t.id for t in minted)
        cascade.extend(minted)
        frontier = [t.id for t in minted]
    return cascade


def record_token_use(*, session: Session, used: dict[int, float]) -> None:
    """When requests last came with these tokens (token id -> time), in one statement; never moved
    backwards (another server may have written a later use)."""
    if used:
        session.execute(_TOKEN_USE_UPDATE, [{"b_id": token_id, "b_used": at} for token_id, at in used.items()])


_TOKENS = table_of(Token)
_TOKEN_USE_UPDATE = (
    update(_TOKENS)
    .where(
        _TOKENS.c.id == bindparam("b_id"),
        or_(_TOKENS.c.last_used_at.is_(None), _TOKENS.c.last_used_at < bindparam("b_used")),
    )
    .values(last_used_at=bindparam("b_used"))
)


def revoked_since(*, session: Session, since: float) -> list[int]:
    """The ids of the tokens revoked at ``since`` or later (a replica that may have missed hearing
    of them ends what they hold)."""
    return list(session.scalars(select(Token.id).where(Token.revoked_at >= since).order_by(Token.id)))


def authenticate(*, session: Session, token: str, now: float) -> AuthInfo | None:
    row = session.execute(
        select(Token, Workspace.name)
        .join(Workspace, Workspace.id == Token.workspace_id)
        .where(Token.token_hash == hash_token(token), token_alive(now))
    ).first()
    return None if row is None else auth_of(row[0], workspace=row[1])


def auth_of(row: Token, *, workspace: str, session_id: int | None = None) -> AuthInfo:
    """Who a token stands for (its row read where ``token_alive``)."""
    return AuthInfo(
        workspace_id=row.workspace_id,
        workspace=workspace,
        token_id=row.id,
        role=row.role,
        token_name=row.name,
        session_id=session_id,
        expires_at=row.expires_at,
    )
