"""Workspaces and their access tokens. Tokens are 256 random bits, so a plain SHA-256 is the
right hash at rest (a slow password hash buys nothing against brute force here and would cost
every request)."""

from __future__ import annotations

import hashlib
import secrets
from dataclasses import dataclass
from typing import Optional

from sqlalchemy import func, select
from sqlalchemy.orm import Session

from flexium import protocol, wire
from flexium.server.errors import Conflict, InvalidRequest, NotFound
from flexium.server.models import Command, Process, Token, Workspace
from flexium.server.storage import quotas


@dataclass(frozen=True)
class AuthInfo:
    workspace_id: int
    workspace: str
    token_id: int


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


def _token_info(row: Token) -> wire.TokenInfo:
    return wire.TokenInfo(
        id=row.id,
        name=row.name,
        prefix=row.prefix,
        created_at=row.created_at,
        revoked_at=row.revoked_at,
        revoked=row.revoked_at is not None,
    )


def check_workspace_name(name: str) -> str:
    if not isinstance(name, str) or not protocol.WORKSPACE_NAME_RE.fullmatch(name):
        raise InvalidRequest(
            f"invalid workspace name {name!r}: use lowercase letters, digits, "
            "'.', '_', '-' (at most 63, starting with a letter or digit)"
        )
    return name


def create_workspace(
    *, session: Session, name: str, now: float, token_name: str = "initial"
) -> tuple[WorkspaceRecord, str]:
    """A new workspace and its first token (returned in clear once; only its hash is kept)."""
    check_workspace_name(name)
    if session.scalar(select(Workspace.id).where(Workspace.name == name)) is not None:
        raise Conflict(f"workspace {name!r} already exists")
    row = Workspace(name=name, created_at=now)
    session.add(row)
    session.flush()
    created = issue_token(session=session, workspace_id=row.id, name=token_name, now=now)
    return _workspace_record(row), created.token


def ensure_default_workspace(*, session: Session, now: float) -> Optional[str]:
    """On a database with no workspace at all, create ``default``; returns its token, or None
    when there was nothing to do."""
    if session.scalar(select(func.count()).select_from(Workspace)):
        return None
    _row, token = create_workspace(session=session, name=protocol.DEFAULT_WORKSPACE, now=now)
    return token


def get_workspace(*, session: Session, name: str) -> WorkspaceRecord:
    row = session.scalar(select(Workspace).where(Workspace.name == name))
    if row is None:
        raise NotFound(f"workspace {name!r} not found")
    return _workspace_record(row)


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


def issue_token(*, session: Session, workspace_id: int, name: str = "", now: float) -> wire.TokenCreated:
    """The new token in clear (``.token``) is in this answer only: only its hash is kept."""
    quotas.check_new_token(session=session, workspace_id=workspace_id)
    token = new_token()
    row = Token(
        workspace_id=workspace_id,
        name=name or "",
        token_hash=hash_token(token),
        prefix=token[: len(protocol.TOKEN_PREFIX) + 6],
        created_at=now,
    )
    session.add(row)
    session.flush()
    return wire.TokenCreated(**_token_info(row).model_dump(), token=token)


def list_tokens(*, session: Session, workspace_id: int) -> list[wire.TokenInfo]:
    rows = session.scalars(select(Token).where(Token.workspace_id == workspace_id).order_by(Token.id))
    return [_token_info(r) for r in rows]


def revoke_token(
    *, session: Session, workspace_id: int, token_id: Optional[int] = None, token: Optional[str] = None, now: float
) -> wire.TokenInfo:
    """Revoke by id or by the token itself. Revoking twice is not an error."""
    query = select(Token).where(Token.workspace_id == workspace_id)
    if token is not None:
        query = query.where(Token.token_hash == hash_token(token))
    elif token_id is not None:
        query = query.where(Token.id == token_id)
    else:
        raise InvalidRequest("name the token to revoke by id or by value")
    row = session.scalar(query)
    if row is None:
        raise NotFound("token not found in this workspace")
    if row.revoked_at is None:
        row.revoked_at = now
    return _token_info(row)


def authenticate(*, session: Session, token: str) -> Optional[AuthInfo]:
    row = session.execute(
        select(Token.id, Token.workspace_id, Workspace.name)
        .join(Workspace, Workspace.id == Token.workspace_id)
        .where(Token.token_hash == hash_token(token), Token.revoked_at.is_(None))
    ).first()
    if row is None:
        return None
    return AuthInfo(workspace_id=row.workspace_id, workspace=row.name, token_id=row.id)
