"""Logging in to the dashboard and out: HTTP only, each route one call."""

from __future__ import annotations

import time
from dataclasses import dataclass
from urllib.parse import parse_qs, urlsplit

from fastapi import APIRouter, Request
from fastapi.responses import HTMLResponse, RedirectResponse, Response

from flexium import protocol
from flexium.server import services, storage
from flexium.server.auth import resolve_token
from flexium.server.context import Ctx, ServerContext
from flexium.server.dashboard.templating import render
from flexium.server.storage import AuthInfo

router = APIRouter(include_in_schema=False)


@dataclass(frozen=True)
class LoginForm:
    """login.html; ``error``: why the last attempt was refused."""

    error: str | None = None


def cross_site(request: Request) -> bool:
    """Whether a browser says this request comes from another site: ``Sec-Fetch-Site`` (sent by
    every current browser), else an ``Origin`` that is not this server's. A request with
    neither (curl, an old browser's same-origin form) is not a cross-site one."""
    fetch_site = request.headers.get("sec-fetch-site")
    if fetch_site is not None:
        return fetch_site not in ("same-origin", "none")
    origin = request.headers.get("origin")
    if origin is None:
        return False
    return origin == "null" or urlsplit(origin).netloc.lower() != request.headers.get("host", "").lower()


def _note_refused(request: Request, ctx: ServerContext, auth: AuthInfo | None, why: str) -> None:
    """A refused login goes to its token's workspace's audit log; one whose token or code named
    no workspace, to the server's log (``server/refusals.py``)."""
    ctx.refusals.note(
        ctx,
        workspace=auth.workspace if auth else None,
        auth=auth,
        address=request.client.host if request.client else "an unknown address",
        action="login.refused",
        detail=why,
    )


def _refused(request: Request, error: str, status_code: int) -> Response:
    return render(request, "login.html", LoginForm(error=error), status_code=status_code)


@router.get("/login", response_class=HTMLResponse)
async def login_page(request: Request) -> Response:
    return render(request, "login.html", LoginForm())


@router.post("/login", response_class=HTMLResponse)
async def login(request: Request, ctx: Ctx) -> Response:
    """A token (the form) or a one-time login code (a login link, posted by login.js) opens a
    dashboard session; the cookie holds the session's id, never the token."""
    if cross_site(request):
        return _refused(request, "refused: a login form must be posted from this server's own page", 403)
    body = parse_qs((await request.body())[:4096].decode("utf-8", "replace"))
    token = (body.get("token") or [""])[0].strip()
    code = (body.get("code") or [""])[0].strip()
    now = time.time()
    if code:
        how = "login code"
        auth = await ctx.db.call(storage.redeem_login_code, write=True, code=code[:256], now=now)
        refused = "this login link was used already or has expired: ask for a new one, or paste a token"
    else:
        how = "token"
        auth = await resolve_token(ctx, token) if token else None
        refused = storage.REFUSED_TOKEN
    if auth is None:
        _note_refused(request, ctx, None, f"with a {how}: {refused}")
        return _refused(request, refused, 401)
    if auth.role == protocol.ROLE_JOB:
        _note_refused(request, ctx, auth, "with a job token")
        return _refused(request, "a job token cannot open the dashboard: log in with a viewer or admin token", 403)
    previous = request.cookies.get(protocol.SESSION_COOKIE)
    if previous:
        await services.log_out(ctx, secret=previous)
    secret, _session = await ctx.db.call(storage.open_session, write=True, auth=auth, how=how, now=now)
    response = RedirectResponse("/", status_code=303)
    response.set_cookie(
        protocol.SESSION_COOKIE,
        secret,
        httponly=True,
        samesite="strict",
        secure=request.url.scheme == "https",
        max_age=int(storage.SESSION_MAX_S),
    )
    return response


@router.post("/logout")
async def logout(request: Request, ctx: Ctx) -> Response:
    """Ends the session on the server (its event stream too), not only in this browser. Another
    site may not end it: SameSite keeps the cookie from its form, not from a sibling subdomain."""
    if cross_site(request):
        return _refused(request, "refused: logging out must be asked from this server's own page", 403)
    secret = request.cookies.get(protocol.SESSION_COOKIE)
    if secret:
        await services.log_out(ctx, secret=secret)
    response = RedirectResponse("/login", status_code=303)
    response.delete_cookie(protocol.SESSION_COOKIE)
    return response
