"""Dashboard sessions and one-time login codes.

A browser logs in by handing over a token (the login form) or a login code (a login link),
and gets a session: a random id in an HttpOnly cookie, stored here as its SHA-256 like a
token. A session ends at logout, after ``SESSION_IDLE_S`` without a request, after
``SESSION_MAX_S`` whatever its use, when its token is revoked (the rows go with the
token's revocation, ``revoke_token``), and when its token opens its ``sessions_per_token``-th
newer one (``retention.py``; a token logging in without end keeps that many rows, not one per login). It may do
what its token may. Logins and logouts are audited as access entries: one repeated within the
hour counts in the entry before (``storage.audit``).

A login code stands in for a token in a link (``/login#code=...``): used once, within
``LOGIN_CODE_TTL_S``, so a link left in a terminal's scrollback, a chat or a browser history
opens nothing later."""

from __future__ import annotations

import secrets
from collections.abc import Collection
from typing import NamedTuple

from sqlalchemy import ColumnElement, delete, or_, select, update
from sqlalchemy.orm import Session

from flexium import protocol, wire
from flexium.server.errors import InvalidRequest, NotFound
from flexium.server.models import DashboardSession, LoginCode, Token, Workspace
from flexium.server.storage.audit import record_audit
from flexium.server.storage.retention import retention_of
from flexium.server.storage.token_validity import token_alive, token_end
from flexium.server.storage.workspaces import (
    AuthInfo,
    auth_of,
    authenticate,
    hash_token,
    named_token,
    token_info,
    token_label,
)

SESSION_IDLE_S = 12 * 3600.0  # a working day's pause ends it
SESSION_MAX_S = 7 * 86400.0  # log in again once a week, however often it is used
LOGIN_CODE_TTL_S = 600.0
_TOUCH_EVERY_S = 60.0  # last_used is written at most this often (a page polls fragments)
DASHBOARD = "the dashboard"  # what a login or logout entry is about


def _secret() -> str:
    return secrets.token_urlsafe(32)


def _expired(now: float) -> ColumnElement[bool]:
    return or_(DashboardSession.last_used < now - SESSION_IDLE_S, DashboardSession.created_at < now - SESSION_MAX_S)


def open_session(*, session: Session, auth: AuthInfo, how: str, now: float) -> tuple[str, AuthInfo]:
    """A new dashboard session of ``auth``'s token: (the id for the cookie, shown once; who
    it is). ``how``: "token" or "login code", for the audit log."""
    session.execute(delete(DashboardSession).where(_expired(now)))
    session.execute(delete(LoginCode).where(LoginCode.expires_at < now))
    secret = _secret()
    row = DashboardSession(token_id=auth.token_id, session_hash=hash_token(secret), created_at=now, last_used=now)
    session.add(row)
    session.flush()
    oldest = select(DashboardSession.id).where(DashboardSession.token_id == auth.token_id)
    newest_first = oldest.order_by(DashboardSession.id.desc())
    ended = list(session.scalars(newest_first.offset(retention_of(session).sessions_per_token)))
    if ended:
        session.execute(delete(DashboardSession).where(DashboardSession.id.in_(ended)))
    record_audit(
        session=session,
        workspace_id=auth.workspace_id,
        actor=auth,
        action="login",
        target=DASHBOARD,
        outcome="ok",
        detail=f"with a {how} (session {row.id})",
        now=now,
    )
    return secret, AuthInfo(
        workspace_id=auth.workspace_id,
        workspace=auth.workspace,
        token_id=auth.token_id,
        role=auth.role,
        token_name=auth.token_name,
        session_id=row.id,
    )


def session_auth(*, session: Session, secret: str, now: float) -> tuple[AuthInfo | None, bool]:
    """(who a session cookie stands for, whether its last use is due to be written:
    ``touch_session``); None when it is unknown, expired or its token revoked or expired (expired
    rows go at the next login)."""
    found = session.execute(
        select(DashboardSession, Token, Workspace.name)
        .join(Token, Token.id == DashboardSession.token_id)
        .join(Workspace, Workspace.id == Token.workspace_id)
        .where(DashboardSession.session_hash == hash_token(secret), token_alive(now), ~_expired(now))
    ).first()
    if found is None:
        return None, False
    row, token, workspace = found
    return auth_of(token, workspace=workspace, session_id=row.id), now - row.last_used >= _TOUCH_EVERY_S


class Ended(NamedTuple):
    """Of the tokens and dashboard sessions asked about, those that no longer open doors."""

    tokens: set[int]
    sessions: set[int]
    # The ended tokens still in the database (revoked or expired, not deleted), by workspace: whose
    # processes the dashboards are told of.
    by_workspace: dict[int, list[int]]


_IDS_PER_QUERY = 500  # far below any database's bound on a statement's parameters


def ended_among(*, session: Session, token_ids: Collection[int], session_ids: Collection[int], now: float) -> Ended:
    """Which of these tokens are revoked, expired or gone (their workspace deleted), and which of these
    sessions are ended (logged out, past their life, their token's revocation): for a server that
    was not told, since the command line changed the database (SQLite has no replica link)."""
    tokens, sessions = sorted(token_ids), sorted(session_ids)
    alive_tokens: set[int] = set()
    by_workspace: dict[int, list[int]] = {}
    for at in range(0, len(tokens), _IDS_PER_QUERY):
        ids = tokens[at : at + _IDS_PER_QUERY]
        for token_id, workspace_id, alive in session.execute(
            select(Token.id, Token.workspace_id, token_alive(now)).where(Token.id.in_(ids))
        ):
            if alive:
                alive_tokens.add(token_id)
            else:
                by_workspace.setdefault(workspace_id, []).append(token_id)
    alive_sessions: set[int] = set()
    for at in range(0, len(sessions), _IDS_PER_QUERY):
        ids = sessions[at : at + _IDS_PER_QUERY]
        alive_sessions.update(
            session.scalars(select(DashboardSession.id).where(DashboardSession.id.in_(ids), ~_expired(now)))
        )
    return Ended(tokens=set(tokens) - alive_tokens, sessions=set(sessions) - alive_sessions, by_workspace=by_workspace)


def touch_session(*, session: Session, session_id: int, now: float) -> None:
    session.execute(update(DashboardSession).where(DashboardSession.id == session_id).values(last_used=now))


def end_session(*, session: Session, secret: str, now: float) -> AuthInfo | None:
    """Logout: the session is deleted; who it was (None: no such session)."""
    auth, _touch = session_auth(session=session, secret=secret, now=now)
    if auth is None:
        return None
    session.execute(delete(DashboardSession).where(DashboardSession.id == auth.session_id))
    record_audit(
        session=session,
        workspace_id=auth.workspace_id,
        actor=auth,
        action="logout",
        target=DASHBOARD,
        outcome="ok",
        detail=f"session {auth.session_id}",
        now=now,
    )
    return auth


def issue_login_code(*, session: Session, token_id: int, now: float) -> str:
    """A one-time code that opens a session of the token within ``LOGIN_CODE_TTL_S``."""
    code = _secret()
    session.add(LoginCode(token_id=token_id, code_hash=hash_token(code), expires_at=now + LOGIN_CODE_TTL_S))
    session.flush()
    return code


def login_code_for(*, session: Session, token: str, now: float) -> str:
    """A login code for a token held in clear (the one the server or ``flexium demo`` prints)."""
    auth = authenticate(session=session, token=token, now=now)
    if auth is None:
        raise NotFound("no such token, or it is revoked or expired")
    return issue_login_code(session=session, token_id=auth.token_id, now=now)


def login_code_as(
    *, session: Session, workspace_id: int, token_id: int | None = None, token: str | None = None, now: float
) -> tuple[str, wire.TokenInfo]:
    """A login code for a token of the workspace, named by its id or by itself, for the command line
    on the database, which holds no token in clear (and whoever reaches the database may do
    anything already); neither: the workspace's oldest admin token that opens doors. A revoked or expired token and
    a job token (the dashboard opens no session of one) are refused. The audit log keeps it: the
    link opens a session of a token that its holder did not hand out."""
    if token is None and token_id is None:
        oldest_admin = select(Token).where(
            Token.workspace_id == workspace_id, Token.role == protocol.ROLE_ADMIN, token_alive(now)
        )
        row = session.scalars(oldest_admin.order_by(Token.id).limit(1)).first()
    else:
        row = session.scalar(named_token(workspace_id=workspace_id, token_id=token_id, token=token))
    if row is None:
        if token is None and token_id is None:
            raise NotFound(
                "this workspace has no admin token that is neither revoked nor expired: issue one (flexium token issue)"
            )
        raise NotFound("token not found in this workspace (`flexium token list WORKSPACE` lists their ids)")
    ended = token_end(row, now)
    if ended is not None:
        raise InvalidRequest(f"{token_label(row)} is {ended}: name another (`flexium token list WORKSPACE`)")
    if row.role == protocol.ROLE_JOB:
        raise InvalidRequest(
            f"{token_label(row)} is a job token, which cannot open the dashboard: name a viewer or admin token"
        )
    code = issue_login_code(session=session, token_id=row.id, now=now)
    record_audit(
        session=session,
        workspace_id=workspace_id,
        actor=None,
        action="login_link.issued",
        target=token_label(row),
        outcome="ok",
        detail=f"role {row.role}, valid {LOGIN_CODE_TTL_S / 60:.0f} min",
        now=now,
    )
    return code, token_info(row, now)


def redeem_login_code(*, session: Session, code: str, now: float) -> AuthInfo | None:
    """The token a login code stands for, once: the code is deleted whatever the outcome.
    None when it is unknown, used, expired or its token revoked."""
    row = session.scalar(select(LoginCode).where(LoginCode.code_hash == hash_token(code)).with_for_update())
    if row is None:
        return None
    session.delete(row)
    session.flush()
    if row.expires_at < now:
        return None
    found = session.execute(
        select(Token, Workspace.name)
        .join(Workspace, Workspace.id == Token.workspace_id)
        .where(Token.id == row.token_id, token_alive(now))
    ).first()
    return None if found is None else auth_of(found[0], workspace=found[1])
