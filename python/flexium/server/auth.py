"""Who is calling: a workspace token from ``Authorization: Bearer`` (processes, CLI, scripts)
or from the dashboard's login cookie. A valid token of another workspace gets the same 404 as
a workspace that does not exist, so names of other workspaces do not leak.

Cookie-authenticated writes must carry the ``X-Flexium-Request`` header: a cross-site form
cannot set it, and a cross-site script cannot send it without a CORS preflight we never allow.
"""

from __future__ import annotations

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


async def resolve_token(ctx: Ctx, token: str) -> Optional[AuthInfo]:
    if len(token) > _MAX_TOKEN_LEN or not token.isascii():
        return None
    now = time.time()
    token_hash = storage.hash_token(token)
    auth = ctx.tokens.get(token_hash, now)
    if auth is None:
        auth = await ctx.db.call(storage.authenticate, write=False, token=token)
        if auth is not None:
            ctx.tokens.put(token_hash, auth, now)
    return auth


async def require_auth(
        request: Request, ctx: Ctx,
        workspace: Annotated[str, Path(max_length=64, description="workspace name")]) -> AuthInfo:
    token, via_cookie = token_from_request(request)
    if token is None:
        raise Unauthorized("missing token: send 'Authorization: Bearer <token>' (training jobs read "
                           f"it from {protocol.TOKEN_ENV} or the 'token' key of .flexiumrc)")
    auth = await resolve_token(ctx, token)
    if auth is None:
        raise Unauthorized("invalid or revoked token")
    if via_cookie and request.method not in _SAFE_METHODS and protocol.CSRF_HEADER not in request.headers:
        raise Forbidden(f"requests authenticated by cookie must send the {protocol.CSRF_HEADER} header")
    if auth.workspace != workspace:
        raise NotFound(f"workspace {workspace!r} not found")
    return auth


Auth = Annotated[AuthInfo, Depends(require_auth)]
