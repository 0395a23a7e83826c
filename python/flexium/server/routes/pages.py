"""Server-rendered dashboard pages (Jinja templates in ``server/templates``), built on the same
storage functions as the API. Only the frame is here: login, logout and a minimal overview;
the dashboard proper grows from ``index.html``."""

from __future__ import annotations

import time
from pathlib import Path
from typing import Optional
from urllib.parse import parse_qs

from fastapi import APIRouter, Request
from fastapi.responses import HTMLResponse, RedirectResponse, Response
from fastapi.templating import Jinja2Templates

from flexium import protocol
from flexium.server import storage
from flexium.server.auth import resolve_token
from flexium.server.context import Ctx
from flexium.server.storage import AuthInfo

TEMPLATES = Jinja2Templates(directory=str(Path(__file__).resolve().parent.parent / "templates"))

router = APIRouter(include_in_schema=False)


async def page_auth(request: Request, ctx: Ctx) -> Optional[AuthInfo]:
    token = request.cookies.get(protocol.TOKEN_COOKIE)
    return await resolve_token(ctx, token) if token else None


@router.get("/", response_class=HTMLResponse)
async def index(request: Request, ctx: Ctx) -> Response:
    auth = await page_auth(request, ctx)
    if auth is None:
        return RedirectResponse("/login", status_code=303)
    now = time.time()
    processes = await ctx.db.call(storage.list_processes, write=False, workspace_id=auth.workspace_id,
                                  now=now, stale_after=ctx.settings.stale_after_s)
    devices = await ctx.db.call(storage.list_devices, write=False, workspace_id=auth.workspace_id,
                                now=now, stale_after=ctx.settings.stale_after_s)
    return TEMPLATES.TemplateResponse(request, "index.html", {
        "workspace": auth.workspace, "processes": processes, "hosts": devices["hosts"],
        "api_base": protocol.workspace_path(auth.workspace)})


@router.get("/login", response_class=HTMLResponse)
async def login_page(request: Request) -> Response:
    return TEMPLATES.TemplateResponse(request, "login.html", {"error": None})


@router.post("/login", response_class=HTMLResponse)
async def login(request: Request, ctx: Ctx) -> Response:
    body = (await request.body())[:4096].decode("utf-8", "replace")
    token = (parse_qs(body).get("token") or [""])[0].strip()
    auth = await resolve_token(ctx, token) if token else None
    if auth is None:
        return TEMPLATES.TemplateResponse(request, "login.html", {"error": "invalid or revoked token"},
                                          status_code=401)
    response = RedirectResponse("/", status_code=303)
    response.set_cookie(protocol.TOKEN_COOKIE, token, httponly=True, samesite="strict",
                        secure=request.url.scheme == "https", max_age=30 * 24 * 3600)
    return response


@router.post("/logout")
async def logout() -> Response:
    response = RedirectResponse("/login", status_code=303)
    response.delete_cookie(protocol.TOKEN_COOKIE)
    return response


