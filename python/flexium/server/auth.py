"""Who is calling: a workspace token from ``Authorization: Bearer`` (processes, CLI, scripts)
or from the dashboard's login cookie. A valid token of another workspace gets the same 404 as
a workspace that does not exist, so names of other workspaces do not leak.

Cookie-authenticated writes must carry the ``X-Flexium-Request`` header: a cross-site form
cannot set it, and a cross-site script cannot send it without a CORS preflight we never allow.
"""

from __future__ import annotations

import asyncio
import time
from typing import Annotated, Optional

from fastapi import Depends, Path, Request

from flexium import protocol
from flexium.server import storage
from flexium.server.context import Ctx
from flexium.server.errors import Forbidden, NotFound, Unauthorized
from flexium.server.storage import AuthInfo

_SAFE_METHODS = ("GET", "HEAD", "OPTIONS")
_MAX_TOKEN_LEN = 256


def token_from_request(request: Request) -> tuple[Optional[str], bool]:
    """(token, came from the cookie)."""
    header = request.headers.get(protocol.TOKEN_HEADER)
    if header is not None:
        scheme, _, value = header.strip().partition(" ")
        if scheme.lower() != "bearer" or not value.strip():
            raise Unauthorized("malformed Authorization header: expected 'Bearer <token>'")
        return value.strip(), False
    cookie = request.cookies.get(protocol.TOKEN_COOKIE)
    if cookie:
        return cookie, True
    return None, False


def _lookup(ctx: Ctx, token: str, token_hash: str) -> "asyncio.Future[Optional[AuthInfo]]":
    """One database lookup per token at a time, shared by every request that needs it."""
    inflight = ctx.token_lookups.get(token_hash)
    if inflight is None:

        async def run() -> Optional[AuthInfo]:
            auth = await ctx.db.call(storage.authenticate, write=False, token=token)
            ctx.tokens.put(token_hash, auth, time.time())
            return auth

        inflight = asyncio.ensure_future(run())
        ctx.token_lookups[token_hash] = inflight
        inflight.add_done_callback(lambda done: _finished(ctx, token_hash, done))
    return inflight


def _finished(ctx: Ctx, token_hash: str, done: "asyncio.Future[Optional[AuthInfo]]") -> None:
    if ctx.token_lookups.get(token_hash) is done:
        del ctx.token_lookups[token_hash]
    if not done.cancelled():
        done.exception()  # retrieved: a failed background refresh is not an error here


def cached_token(ctx: Ctx, token: str, now: float) -> Optional[AuthInfo]:
    """The cached auth of a token, starting a background refresh when it is due; None when
    not cached (the caller looks it up)."""
    token_hash = storage.hash_token(token)
    auth, refresh = ctx.tokens.get(token_hash, now)
    if auth is not None and refresh:
        _lookup(ctx, token, token_hash)
    return auth


async def resolve_token(ctx: Ctx, token: str) -> Optional[AuthInfo]:
    if len(token) > _MAX_TOKEN_LEN or not token.isascii():
        return None
    auth = cached_token(ctx, token, time.time())
    if auth is not None:
        return auth
    return await asyncio.shield(_lookup(ctx, token, storage.hash_token(token)))


async def require_auth(
    request: Request, ctx: Ctx, workspace: Annotated[str, Path(max_length=64, description="workspace name")]
) -> AuthInfo:
    token, via_cookie = token_from_request(request)
    if token is None:
        raise Unauthorized(
            "missing token: send 'Authorization: Bearer <token>' (training jobs read "
            f"it from {protocol.TOKEN_ENV} or the 'token' key of .flexiumrc)"
        )
    auth = await resolve_token(ctx, token)
    if auth is None:
        raise Unauthorized("invalid or revoked token")
    if via_cookie and request.method not in _SAFE_METHODS and protocol.CSRF_HEADER not in request.headers:
        raise Forbidden(f"requests authenticated by cookie must send the {protocol.CSRF_HEADER} header")
    if auth.workspace != workspace:
        raise NotFound(f"workspace {workspace!r} not found")
    return auth


Auth = Annotated[AuthInfo, Depends(require_auth)]
