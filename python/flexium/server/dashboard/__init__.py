"""The dashboard: server-rendered pages, and the fragments their scripts swap in when a live
event says something changed (``/ui/...``). Pages and fragments render through the same Jinja
macros from the same storage functions as the API, so a row looks the same on first load and
after an update, and every value a client sent goes through Jinja's escaping exactly once.

The scripts (``static/``) only move server-rendered HTML around and post commands to the API;
they never build markup from data.

- ``routes.py``, ``login.py``: HTTP only; each route reads its request, makes one call, renders.
- ``views/``: what each page and fragment shows, one module per area, as frozen dataclasses.
- ``formatters.py``, ``refusals.py``: the templates' filters and globals, pure functions.
- ``templating.py``: the Jinja environment, ``render`` and the pages' headers; ``viewer.py``:
  the session check (``PageAuth``, ``FragmentAuth``) and who is looking (``Viewer``).
"""

from __future__ import annotations

from fastapi import FastAPI, Request
from fastapi.responses import Response
from fastapi.staticfiles import StaticFiles

from flexium.server.dashboard import login, routes
from flexium.server.dashboard.templating import STATIC_DIR
from flexium.server.dashboard.viewer import SignedOut


def install_dashboard(app: FastAPI) -> None:
    """The pages, the login, ``/static`` and the answer to a signed-out request."""

    @app.exception_handler(SignedOut)
    async def _signed_out(_request: Request, exc: SignedOut) -> Response:
        return exc.response

    app.include_router(routes.router)
    app.include_router(login.router)
    app.mount("/static", StaticFiles(directory=str(STATIC_DIR)), name="static")
