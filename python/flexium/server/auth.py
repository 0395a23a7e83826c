"""Who is calling, and what they may do. A workspace token from ``Authorization: Bearer``
(processes, CLI, scripts), or a dashboard session from its cookie (``storage.sessions``). A
valid token of another workspace gets the same 404 as a workspace that does not exist, so
names of other workspaces do not leak.

Roles (``protocol.TOKEN_ROLES``): each route names the roles it admits (``Admin``, ``Reader``,
``Worker``, ``Member``), and a job token is further held to the processes it registered
(``require_own_process`` and its kin). A refusal is a 403 naming the role needed.

Session-authenticated writes must carry the ``X-Flexium-Request`` header: a cross-site form
cannot set it, and a cross-site script cannot send it without a CORS preflight we never allow.
"""

from __future__ import annotations

import asyncio
import dataclasses
import time
from collections.abc import Awaitable, Callable
from typing import Annotated, Any

from fastapi import Depends, Path, Request

from flexium import protocol, wire
from flexium.server import services, storage
from flexium.server.context import Ctx, ServerContext
from flexium.server.errors import Forbidden, NotFound, Unauthorized
from flexium.server.storage import AuthInfo

_SAFE_METHODS = ("GET", "HEAD", "OPTIONS")
_MAX_TOKEN_LEN = 256
_TOKEN_HEADER = protocol.TOKEN_HEADER.lower().encode()  # as ASGI servers give header names


def bearer_token(request: Request) -> str | None:
    header = request.headers.get(protocol.TOKEN_HEADER)
    if header is None:
        return None
    token = _bearer_value(header)
    if token is None:
        raise Unauthorized("malformed Authorization header: expected 'Bearer <token>'", error="invalid_request")
    return token


def scope_bearer_token(scope: Any) -> str | None:
    """The bearer token of a raw ASGI request, for the layers in front of FastAPI that answer from
    the token cache; None where it has none, or none a token could be (too long): they then leave
    the request to FastAPI, whose ``bearer_token`` answers it in full."""
    for name, value in scope.get("headers", ()):
        if name == _TOKEN_HEADER:
            token = _bearer_value(value.decode("latin-1"))
            return token if token is not None and len(token) <= _MAX_TOKEN_LEN else None
    return None


def _bearer_value(header: str) -> str | None:
    """The token of an ``Authorization`` value ``Bearer <token>``; None when it is not one."""
    scheme, _, value = header.strip().partition(" ")
    token = value.strip()
    return token if scheme.lower() == "bearer" and token else None


# How long a request waits for its token's lookup once the cached auth is due one (a busy database: then
# the cached auth is served).
LOOKUP_PATIENCE_S = 1.0


def _lookup(ctx: ServerContext, token: str, token_hash: str) -> asyncio.Future[AuthInfo | None]:
    """One database lookup per token at a time, shared by every request that needs it."""
    inflight = ctx.token_lookups.get(token_hash)
    if inflight is None:

        async def run() -> AuthInfo | None:
            auth = await ctx.db.call(storage.authenticate, write=False, token=token, now=time.time())
            ctx.tokens.put(token_hash, auth, time.time())
            if auth is not None:
                services.watch_expiry(ctx, auth)
            return auth

        inflight = asyncio.ensure_future(run())
        ctx.token_lookups[token_hash] = inflight
        inflight.add_done_callback(lambda done: _finished(ctx, token_hash, done))
    return inflight


def _finished(ctx: ServerContext, token_hash: str, done: asyncio.Future[AuthInfo | None]) -> None:
    if ctx.token_lookups.get(token_hash) is done:
        del ctx.token_lookups[token_hash]
    if not done.cancelled() and done.exception() is not None:  # retrieved: not an error of the requests served
        ctx.tokens.lookup_failed(token_hash)


def cached_token(ctx: ServerContext, token: str, now: float) -> AuthInfo | None:
    """The cached auth of a token, for the layers that answer without waiting: None when it is not
    cached, or due for a lookup (started here; the caller leaves the request to ``resolve_token``, which
    waits for it), except while lookups fail (the database down: served within TokenCache's bounds)."""
    token_hash = storage.hash_token(token)
    auth, refresh = ctx.tokens.get(token_hash, now)
    if auth is None or not refresh:
        return auth
    _lookup(ctx, token, token_hash)
    return auth if ctx.tokens.failing(token_hash) else None


async def resolve_token(ctx: ServerContext, token: str) -> AuthInfo | None:
    """Who a token stands for (its use noted: ``ServerContext.token_used``). Past its cache time a token
    is looked up again and the request waits for that (one lookup shared by every request that needs it),
    so that a token revoked by another process is refused however seldom it is used; a database that does
    not answer within LOOKUP_PATIENCE_S, or fails, is not waited for: the cached auth is served meanwhile,
    within TokenCache's bounds."""
    auth = await _token_auth(ctx, token)
    if auth is not None:
        ctx.token_used(auth.token_id, time.time())
    return auth


async def _token_auth(ctx: ServerContext, token: str) -> AuthInfo | None:
    if len(token) > _MAX_TOKEN_LEN or not token.isascii():
        return None
    token_hash = storage.hash_token(token)
    cached, refresh = ctx.tokens.get(token_hash, time.time())
    if cached is not None and not refresh:
        return cached
    lookup = _lookup(ctx, token, token_hash)
    if cached is None:
        return await asyncio.shield(lookup)
    if ctx.tokens.failing(token_hash):
        return cached
    try:
        return await asyncio.wait_for(asyncio.shield(lookup), LOOKUP_PATIENCE_S)
    except asyncio.TimeoutError:
        return cached  # a busy database: its lookup goes on
    except Exception:  # a database that failed it: served as cached, looked up again by the next request
        return cached


async def resolve_session(ctx: ServerContext, secret: str) -> AuthInfo | None:
    """Who a dashboard session cookie stands for (None: unknown, expired, or its token revoked).
    Read on every request, so a logout or revocation is seen at once."""
    if len(secret) > _MAX_TOKEN_LEN or not secret.isascii():
        return None
    now = time.time()
    auth, touch = await ctx.db.call(storage.session_auth, write=False, secret=secret, now=now)
    if auth is not None:
        services.watch_expiry(ctx, auth)
        ctx.token_used(auth.token_id, now)
    if auth is not None and touch:
        await ctx.db.call(storage.touch_session, write=True, session_id=auth.session_id, now=now)
    return auth


async def require_auth(
    request: Request, ctx: Ctx, workspace: Annotated[str, Path(max_length=64, description="workspace name")]
) -> AuthInfo:
    token = bearer_token(request)
    if token is not None:
        auth = await resolve_token(ctx, token)
        if auth is None:
            raise Unauthorized(storage.REFUSED_TOKEN, error="invalid_token")
    else:
        secret = request.cookies.get(protocol.SESSION_COOKIE)
        if not secret:
            raise Unauthorized(
                "missing token: send 'Authorization: Bearer <token>' (training jobs read "
                f"it from {protocol.TOKEN_ENV} or the 'token' key of .flexiumrc)"
            )
        auth = await resolve_session(ctx, secret)
        if auth is None:
            raise Unauthorized(
                f"dashboard session ended (logged out, {storage.SESSION_IDLE_S / 3600:g} h idle, "
                f"{storage.SESSION_MAX_S / 86400:g} days old, or its token revoked or expired): log in again"
            )
        if request.method not in _SAFE_METHODS and protocol.CSRF_HEADER not in request.headers:
            raise Forbidden(f"requests authenticated by cookie must send the {protocol.CSRF_HEADER} header")
    if auth.workspace != workspace:
        raise NotFound(
            f"workspace {workspace!r} not found for this token: a token belongs to one workspace; check the "
            "workspace in the server's address (host:port/WORKSPACE)"
        )
    auth = dataclasses.replace(auth, door=_door(request, auth))
    request.state.auth = auth  # whom a refusal after this names (server/refusals.py)
    return auth


def _door(request: Request, auth: AuthInfo) -> protocol.Door:
    """How this request came in. The User-Agent is the client's word, enough to say which tool
    a person used; what they may do is still their token's role alone."""
    if auth.session_id is not None:
        return "dashboard"
    agent = request.headers.get("user-agent", "")
    if agent.startswith("flexium/") and agent.endswith(protocol.CLI_AGENT_MARK):
        return "cli"
    return "api"


def role_refusal(auth: AuthInfo, roles: tuple[str, ...], doing: str) -> str:
    """Why ``auth`` may not do ``doing``: the message of the 403, and the reason a dashboard
    shows beside a disabled button."""
    needed = " or ".join(roles)
    return (
        f"{doing} needs a token with role {needed}; this one ({auth.token_name or 'token ' + str(auth.token_id)}) "
        f"is a {auth.role} token. An admin issues one: flexium token issue {auth.workspace} --role {roles[-1]}"
    )


def _role(*roles: str, doing: str) -> Callable[[Request, ServerContext, str], Awaitable[AuthInfo]]:
    async def check(request: Request, ctx: Ctx, workspace: Annotated[str, Path(max_length=64)]) -> AuthInfo:
        auth = await require_auth(request, ctx, workspace)
        if auth.role not in roles:
            raise Forbidden(role_refusal(auth, roles, doing))
        return auth

    return check


Member = Annotated[AuthInfo, Depends(require_auth)]
"""Any role; a job token is then held to its own processes by the route."""
Reader = Annotated[AuthInfo, Depends(_role(protocol.ROLE_ADMIN, protocol.ROLE_VIEWER, doing="reading the workspace"))]
Worker = Annotated[AuthInfo, Depends(_role(protocol.ROLE_ADMIN, protocol.ROLE_JOB, doing="what a training job does"))]
Admin = Annotated[AuthInfo, Depends(_role(protocol.ROLE_ADMIN, doing="this change"))]


def _not_yours(auth: AuthInfo, what: str) -> Forbidden:
    return Forbidden(
        f"{what} belongs to a process this job token did not register: a job token acts only on "
        "its own processes (use an admin or viewer token)"
    )


async def _owner(ctx: ServerContext, auth: AuthInfo, process_id: str) -> tuple[bool, int | None]:
    """(whether the process exists, the token that registered it), from memory when it can."""
    snapshot = ctx.snapshots.get((auth.workspace_id, process_id))
    if snapshot is not None:
        return True, snapshot.token_id
    exists, owner = await ctx.db.call(
        storage.process_owner, write=False, workspace_id=auth.workspace_id, process_id=process_id
    )
    return exists, owner


async def require_own_process(ctx: ServerContext, auth: AuthInfo, process_id: str) -> None:
    """A job token may act only on the processes it registered. An unknown process passes:
    the route answers its 404 (for a heartbeat: register again)."""
    if auth.role != protocol.ROLE_JOB:
        return
    exists, owner = await _owner(ctx, auth, process_id)
    if exists and owner != auth.token_id:
        raise _not_yours(auth, f"process {process_id!r}")


async def require_own_command(ctx: ServerContext, auth: AuthInfo, command_id: int) -> None:
    if auth.role != protocol.ROLE_JOB:
        return
    command = await ctx.db.call(storage.get_command, write=False, workspace_id=auth.workspace_id, command_id=command_id)
    await require_own_process(ctx, auth, command.process_id)


async def require_own_operation(ctx: ServerContext, auth: AuthInfo, operation_id: int) -> None:
    """A job token reads a job operation when one of its ranks is a process it registered."""
    if auth.role != protocol.ROLE_JOB:
        return
    operation: wire.JobOperationInfo = await ctx.db.call(
        storage.get_operation, write=False, workspace_id=auth.workspace_id, operation_id=operation_id
    )
    for command in operation.commands:
        exists, owner = await _owner(ctx, auth, command.process_id)
        if exists and owner == auth.token_id:
            return
    raise _not_yours(auth, f"job operation {operation_id}")


def may_beat_from_memory(ctx: ServerContext, auth: AuthInfo, process_id: str) -> bool:
    """Whether the heartbeat shortcut may answer for ``auth`` (else the route decides, and
    refuses what the role may not do)."""
    if auth.role == protocol.ROLE_ADMIN:
        return True
    if auth.role != protocol.ROLE_JOB:
        return False
    snapshot = ctx.snapshots.get((auth.workspace_id, process_id))
    return snapshot is not None and snapshot.token_id == auth.token_id
