"""The one Jinja environment of the dashboard's templates (``templates/``), and ``render``:
a view's frozen dataclasses become the template's names, and every response carries the same
headers, a Content-Security-Policy without inline scripts among them (a second line against
injected markup)."""

from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import Any

from fastapi.templating import Jinja2Templates
from jinja2 import Environment, FileSystemLoader
from markupsafe import Markup, escape
from starlette.requests import Request
from starlette.responses import Response

from flexium import protocol, reasons
from flexium.server.dashboard import formatters, refusals

TEMPLATE_DIR = Path(__file__).resolve().parent / "templates"
STATIC_DIR = Path(__file__).resolve().parent / "static"
_CARRIAGE_RETURN = Markup("&#13;")


def exact_in_html(value: Any) -> Any:
    """Every value a template shows, before Jinja escapes it: a browser reads a carriage return
    in a page as a line feed (CR LF too), but a character reference as itself. So the script
    reads back from an attribute what the server holds: a job key with one still names its job."""
    if isinstance(value, str) and "\r" in value:
        return escape(value).replace("\r", _CARRIAGE_RETURN)
    return value


# autoescape for every template, whatever its file name: fragments hold client-sent text.
TEMPLATES = Jinja2Templates(
    env=Environment(
        loader=FileSystemLoader(str(TEMPLATE_DIR)),
        autoescape=True,
        finalize=exact_in_html,
        trim_blocks=True,
        lstrip_blocks=True,
    )
)
TEMPLATES.env.filters.update(
    bytes=formatters.fmt_bytes,
    duration=formatters.fmt_duration,
    utc=formatters.fmt_utc,
    rate=formatters.fmt_rate,
    loss=formatters.fmt_loss,
    door=formatters.fmt_door,
    short_reason=reasons.short_reason,
    word_breaks=formatters.word_breaks,
    priority=protocol.priority_name,
)
TEMPLATES.env.globals.update(
    fmt_ago=formatters.fmt_ago,
    job_name=formatters.job_name,
    gpu_label=formatters.gpu_label,
    membar=formatters.membar,
    refusal=refusals.refusal,
    job_pause_refusal=refusals.job_pause_refusal,
    DISPLAY_STATES=protocol.DISPLAY_STATES,
    TARGETABLE_HEALTH=protocol.TARGETABLE_HEALTH,
    PRIORITIES=protocol.PRIORITIES,
    MAX_PRIORITY=protocol.MAX_PRIORITY,
    MAX_REASON_LEN=protocol.MAX_REASON_LEN,
)

_CSP = (
    "default-src 'self'; script-src 'self'; style-src 'self'; img-src 'self' data:; "
    "connect-src 'self'; object-src 'none'; base-uri 'none'; form-action 'self'; "
    "frame-ancestors 'none'"
)
HEADERS = {
    "Content-Security-Policy": _CSP,
    "X-Content-Type-Options": "nosniff",
    "Referrer-Policy": "same-origin",
    "Cache-Control": "no-store",
}


def render(request: Request, template: str, *parts: Any, status_code: int = 200, **values: Any) -> Response:
    """``template`` with the fields of each dataclass in ``parts`` (a view, the viewer), then
    ``values``, as its names."""
    context: dict[str, Any] = {}
    for part in parts:
        context.update((field.name, getattr(part, field.name)) for field in dataclasses.fields(part))
    context.update(values)
    return TEMPLATES.TemplateResponse(request, template, context, status_code=status_code, headers=HEADERS)


def nothing(status_code: int) -> Response:
    """An empty answer to a fragment request (404: what it asked for is gone)."""
    return Response("", status_code=status_code, headers=HEADERS)
