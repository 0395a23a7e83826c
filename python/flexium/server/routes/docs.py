"""The API reference, ``/docs`` (Swagger UI) and ``/redoc``, with their scripts and styles
served by this server: FastAPI's own pages load them from a CDN, which a server without
internet (most GPU clusters) cannot reach, and the page stays blank. The assets come from the
``fastapi-offline`` package (the server extra); without it the pages fall back to the CDN."""

from __future__ import annotations

import base64
import hashlib
import importlib.resources
import logging
import re
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any

from fastapi import APIRouter, FastAPI, Request
from fastapi.openapi.docs import get_redoc_html, get_swagger_ui_html
from fastapi.responses import HTMLResponse
from fastapi.staticfiles import StaticFiles

from flexium import protocol

log = logging.getLogger("flexium.server")

ASSETS_PATH = "/docs-assets"
_TITLE = "flexium server API"

router = APIRouter(include_in_schema=False)


def asset_dir() -> Path | None:
    """Where the Swagger UI and ReDoc files are, None when the package that ships them is missing."""
    try:
        folder = Path(str(importlib.resources.files("fastapi_offline") / "static"))
    except ModuleNotFoundError:
        return None
    return folder if (folder / "swagger-ui-bundle.js").is_file() else None


def _reference_page(
    build: Callable[..., HTMLResponse], **local_assets: Any
) -> Callable[[Request], Awaitable[HTMLResponse]]:
    """A page drawn by FastAPI's ``build`` (Swagger UI or ReDoc), given this server's copies of
    its assets when they are installed, else FastAPI's CDN defaults."""

    async def page(request: Request) -> HTMLResponse:
        local = request.app.state.docs_assets_local
        answer = build(openapi_url=request.app.openapi_url, title=_TITLE, **(local_assets if local else {}))
        answer.headers.update(_headers(bytes(answer.body).decode(), local=local))
        return answer

    return page


_CDN = "https://cdn.jsdelivr.net"  # FastAPI's pages' assets, where this server has none of its own


def _headers(html: str, *, local: bool) -> dict[str, str]:
    """A Content-Security-Policy for a reference page: its scripts from this server (or the CDN
    its assets fall back to) and the page's one inline script by its hash, nothing else; inline
    styles are Swagger UI's and ReDoc's own way of drawing. A script injected into the page (a
    schema text the page mishandled) does not run."""
    hashes = " ".join(
        "'sha256-" + base64.b64encode(hashlib.sha256(script.encode()).digest()).decode() + "'"
        for script in re.findall(r"<script>(.*?)</script>", html, flags=re.S)
    )
    sources = "'self'" if local else f"'self' {_CDN}"
    return {
        "Content-Security-Policy": (
            f"default-src 'self'; script-src {sources} {hashes}; style-src {sources} 'unsafe-inline'; "
            "img-src 'self' data:; worker-src 'self' blob:; connect-src 'self'; object-src 'none'; "
            "base-uri 'none'; form-action 'none'; frame-ancestors 'none'"
        ),
        "X-Content-Type-Options": "nosniff",
        "Referrer-Policy": "same-origin",
    }


router.add_api_route(
    "/docs",
    _reference_page(
        get_swagger_ui_html,
        swagger_js_url=f"{ASSETS_PATH}/swagger-ui-bundle.js",
        swagger_css_url=f"{ASSETS_PATH}/swagger-ui.css",
        swagger_favicon_url=f"{ASSETS_PATH}/favicon.png",
    ),
    response_class=HTMLResponse,
)
router.add_api_route(
    "/redoc",
    _reference_page(
        get_redoc_html,
        redoc_js_url=f"{ASSETS_PATH}/redoc.standalone.js",
        redoc_favicon_url=f"{ASSETS_PATH}/favicon.png",
        with_google_fonts=False,
    ),
    response_class=HTMLResponse,
)


BEARER_SCHEME = "workspaceToken"


def declare_bearer_scheme(app: FastAPI) -> None:
    """The schema says how /api calls authenticate: a bearer token (the workspace token) on
    every /api operation, so that Swagger UI offers its Authorize button and sends the token.
    The routes check the header themselves (auth.py); this only describes it."""
    build = app.openapi

    def openapi() -> dict[str, Any]:
        if app.openapi_schema is not None:
            return app.openapi_schema
        schema = build()
        schemes = schema.setdefault("components", {}).setdefault("securitySchemes", {})
        schemes[BEARER_SCHEME] = {
            "type": "http",
            "scheme": "bearer",
            "description": "a workspace token (flx_...), as `flexium server` or `flexium token issue` printed it",
        }
        for path, operations in schema["paths"].items():
            if path.startswith(f"{protocol.API_PREFIX}/"):
                for operation in operations.values():
                    operation["security"] = [{BEARER_SCHEME: []}]
        return schema

    app.openapi = openapi  # type: ignore[method-assign]  # FastAPI's documented way to extend its schema


def install_docs(app: FastAPI) -> None:
    """For an app made with ``docs_url=None, redoc_url=None``."""
    declare_bearer_scheme(app)
    folder = asset_dir()
    app.state.docs_assets_local = folder is not None
    if folder is None:
        log.warning("fastapi-offline is not installed: /docs and /redoc load their scripts from a CDN")
    else:
        app.mount(ASSETS_PATH, StaticFiles(directory=str(folder)), name="docs-assets")
    app.include_router(router)
