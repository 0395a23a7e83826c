"""The dashboard: one server-rendered page, and the fragments its script swaps in when a live
event says something changed (``/ui/...``). Page and fragments render through the same Jinja
macros from the same storage functions as the API, so a row looks the same on first load and
after an update, and every value a client sent goes through Jinja's escaping exactly once.

The script only moves server-rendered HTML around and posts commands to the API; it never
builds markup from data. The pages send a Content-Security-Policy without inline scripts as a
second line against injected markup."""

from __future__ import annotations

import math
import shlex
import time
from pathlib import Path
from typing import Annotated, Any, Awaitable, Callable, Optional, Sequence
from urllib.parse import parse_qs, urlsplit

from fastapi import APIRouter, Depends, Query, Request
from fastapi.responses import HTMLResponse, RedirectResponse, Response
from fastapi.templating import Jinja2Templates
from jinja2 import Environment, FileSystemLoader
from markupsafe import Markup, escape
from sqlalchemy.orm import Session
from starlette.convertors import PathConvertor, register_url_convertor

from flexium import protocol, wire
from flexium.server import services, storage
from flexium.server.auth import resolve_session, resolve_token, role_refusal
from flexium.server.context import Ctx, ServerContext
from flexium.server.errors import NotFound
from flexium.server.storage import AuthInfo

_TEMPLATE_DIR = Path(__file__).resolve().parent.parent / "templates"
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
        loader=FileSystemLoader(str(_TEMPLATE_DIR)),
        autoescape=True,
        finalize=exact_in_html,
        trim_blocks=True,
        lstrip_blocks=True,
    )
)

router = APIRouter(include_in_schema=False)


class JobKeyConvertor(PathConvertor):
    """A job key in a path, whatever text its ranks registered: the ``path`` convertor's ``.*``
    stops at a newline, and a key with one would have no migrate form."""

    regex = r"[\s\S]+"


register_url_convertor("job_key", JobKeyConvertor())

_CSP = (
    "default-src 'self'; script-src 'self'; style-src 'self'; img-src 'self' data:; "
    "connect-src 'self'; object-src 'none'; base-uri 'none'; form-action 'self'; "
    "frame-ancestors 'none'"
)
_HEADERS = {
    "Content-Security-Policy": _CSP,
    "X-Content-Type-Options": "nosniff",
    "Referrer-Policy": "same-origin",
    "Cache-Control": "no-store",
}
# How far back the table looks for each process's last finished command (see ``last_finished``).
_COMMAND_SCAN = 500
_RECENT_COMMANDS = 15
_MAX_BATCH = 200  # ids or hosts one fragment request may name
_AUDIT_SHOWN = 200


# --- formatting (Jinja filters; static/dashboard.js formats ticking times the same way) -----


def fmt_bytes(n: Optional[int]) -> str:
    if not n:
        return "0 B"
    value = float(n)
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if value < 1024 or unit == "TiB":
            return f"{value:.0f} {unit}" if unit in ("B", "KiB") or value >= 100 else f"{value:.1f} {unit}"
        value /= 1024
    return f"{n} B"


def fmt_duration(seconds: Optional[float], precise: bool = True) -> str:
    """``precise``: hundredths under 10 s (how long an operation took); else whole seconds
    (how long a job has run)."""
    if seconds is None or not math.isfinite(seconds):
        return "—"
    s = max(0.0, seconds)
    if s < 10 and precise:
        return f"{s:.2f} s"
    if s < 60:
        return f"{int(s)} s"
    m, sec = divmod(int(s), 60)
    if m < 60:
        return f"{m} min {sec} s" if sec else f"{m} min"
    h, m = divmod(m, 60)
    if h < 24:
        return f"{h} h {m} min" if m else f"{h} h"
    d, h = divmod(h, 24)
    return f"{d} d {h} h" if h else f"{d} d"


def fmt_ago(ts: Optional[float], now: float) -> str:
    if ts is None:
        return "—"
    age = max(0.0, now - ts)
    if age < 2:
        return "just now"
    for unit, size in (("d", 86400), ("h", 3600), ("min", 60)):
        if age >= size:
            return f"{int(age // size)} {unit} ago"
    return f"{int(age)} s ago"


def fmt_utc(ts: float) -> str:
    """An audit entry's time, exact and the same for every reader whatever their time zone."""
    return time.strftime("%Y-%m-%d %H:%M:%S UTC", time.gmtime(ts))


def job_name(process: wire.ProcessInfo) -> str:
    """A short name a person recognizes: the script of the command line (launchers such as
    ``torchrun`` or ``python -m torch.distributed.run`` come first), else its ``-m`` module,
    else the program, else the process id."""
    try:
        words = shlex.split(process.cmdline or "")
    except ValueError:
        words = (process.cmdline or "").split()
    for word in words:
        if word.endswith(".py"):
            return Path(word).name
    for i, word in enumerate(words[:-1]):
        if word == "-m":
            return words[i + 1]
    if words:
        return Path(words[0]).name or words[0]
    return process.process_id


def gpu_label(index: Optional[int], uuid: Optional[str]) -> str:
    if index is not None:
        return f"GPU {index}"
    return f"GPU {uuid[:12]}" if uuid else "no GPU"


def membar(device: wire.DeviceInfo) -> dict[str, int]:
    """Widths (of 1000) of the flexium / other / free parts of a GPU's memory bar."""
    total = max(device.memory_total, 1)
    ours = min(device.memory_flexium, total)
    other = min(device.memory_other, total - ours)
    f = round(1000 * ours / total)
    o = round(1000 * other / total)
    if ours and not f:
        f = 1  # a job's sliver stays visible
    return {"flexium": f, "other": o, "free": max(0, 1000 - f - o)}


def command_seconds(command: wire.CommandInfo) -> Optional[float]:
    """The operation's own measure when the process sent one, else the server's clock."""
    seconds = command.result.seconds if command.result is not None else None
    if seconds is not None and seconds >= 0:
        return seconds
    if command.finished_at is not None and command.started_at is not None:
        return command.finished_at - command.started_at
    return None


TEMPLATES.env.filters.update(bytes=fmt_bytes, duration=fmt_duration, utc=fmt_utc)
TEMPLATES.env.globals.update(
    fmt_ago=fmt_ago,
    job_name=job_name,
    gpu_label=gpu_label,
    membar=membar,
    command_seconds=command_seconds,
    DISPLAY_STATES=protocol.DISPLAY_STATES,
    TARGETABLE_HEALTH=protocol.TARGETABLE_HEALTH,
)


# --- what the page shows, read in one transaction ---------------------------------------------


def last_finished(commands: list[wire.CommandInfo]) -> dict[str, wire.CommandInfo]:
    """process id -> its newest finished command, from commands listed newest first."""
    last: dict[str, wire.CommandInfo] = {}
    for command in commands:
        if command.state in protocol.FINAL_COMMAND_STATES:
            last.setdefault(command.process_id, command)
    return last


def dashboard_view(
    *,
    session: Session,
    workspace_id: int,
    now: float,
    stale_after: float,
    process_ids: Optional[Sequence[str]] = None,
    hosts: Optional[Sequence[str]] = None,
    processes: bool = True,
    devices: bool = True,
    commands: bool = True,
    targets: Optional[str] = None,
) -> dict[str, Any]:
    """Processes, GPUs and recent commands through the API's storage functions, in one
    transaction so the parts agree with each other.

    ``process_ids`` narrows the processes to those (the ones gone are left out) and, unless
    ``hosts`` says otherwise, the GPUs to their hosts; ``hosts`` narrows the GPUs. ``targets``
    (migrate or resume) judges the GPUs of the first process as targets of that command:
    ``storage.judge_targets``, the rules the API enforces."""
    view: dict[str, Any] = {
        "now": now,
        "stale_after": stale_after,
        "gpu_indexes": storage.device_indexes(session=session, workspace_id=workspace_id),
    }
    if process_ids is not None:
        view["processes"], view["last"] = [], {}
        for process_id in process_ids:
            try:
                view["processes"].append(
                    storage.get_process(
                        session=session,
                        workspace_id=workspace_id,
                        process_id=process_id,
                        now=now,
                        stale_after=stale_after,
                    )
                )
            except NotFound:
                continue
            view["last"].update(
                last_finished(
                    storage.list_commands(session=session, workspace_id=workspace_id, process_id=process_id, limit=20)
                )
            )
        if hosts is None:
            hosts = sorted({p.host for p in view["processes"]})
    elif processes:
        view["processes"] = storage.list_processes(
            session=session, workspace_id=workspace_id, now=now, stale_after=stale_after
        )
        scanned = storage.list_commands(session=session, workspace_id=workspace_id, limit=_COMMAND_SCAN)
        view["last"] = last_finished(scanned)
        view["commands"] = scanned[:_RECENT_COMMANDS]
    if "processes" in view:
        view["entries"] = table_entries(view["processes"])
    if commands and "commands" not in view:
        view["commands"] = storage.list_commands(session=session, workspace_id=workspace_id, limit=_RECENT_COMMANDS)
    if devices:
        if hosts is None:
            view["hosts"] = storage.list_devices(
                session=session, workspace_id=workspace_id, now=now, stale_after=stale_after
            ).hosts
        else:
            view["hosts"] = [
                entry
                for host in hosts
                for entry in storage.list_devices(
                    session=session, workspace_id=workspace_id, now=now, stale_after=stale_after, host=host
                ).hosts
            ]
    if targets is not None and view.get("processes"):
        view["targets"] = storage.judge_targets(
            session=session,
            workspace_id=workspace_id,
            process_id=view["processes"][0].process_id,
            kind=targets,
            now=now,
            stale_after=stale_after,
        )
    return view


def table_entries(processes: list[wire.ProcessInfo]) -> list[tuple[str, Any]]:
    """The process table's rows in order: ("process", ProcessInfo) for a job of its own,
    ("job", JobSummary) for a job of several ranks, where its first rank would be (its ranks
    are rendered under it)."""
    jobs = {job.key: job for job in storage.summarize_jobs(processes)}
    entries: list[tuple[str, Any]] = []
    for process in processes:
        job = jobs.pop(process.job.key, None) if process.job is not None and process.job.world_size > 1 else None
        if job is not None:
            entries.append(("job", job))
        elif process.job is None or process.job.world_size <= 1:
            entries.append(("process", process))
    return entries


def rank_targets(job: wire.JobSummary, hosts: list[wire.HostInfo]) -> list[tuple[wire.ProcessInfo, list[Any]]]:
    """(rank, the GPUs it may be sent to: those of its host that it sees) for the job's migrate form."""
    devices = {(h.host, d.uuid): d for h in hosts for d in h.devices}
    return [
        (rank, [devices[(rank.host, uuid)] for uuid in rank.visible_gpus if (rank.host, uuid) in devices])
        for rank in job.ranks
    ]


# --- auth and responses -----------------------------------------------------------------------


class SignedOut(Exception):
    """No valid login cookie: the app answers with ``response`` (see ``install_error_handlers``)."""

    def __init__(self, response: Response) -> None:
        super().__init__("signed out")
        self.response = response


def _signed_in(*, redirect: bool) -> Callable[[Request, ServerContext], Awaitable[AuthInfo]]:
    """The one check of the dashboard's session cookie. The page sends a person without a
    live session to the login form; fragments answer 401 instead, and the script sends the
    person there."""

    async def page_auth(request: Request, ctx: Ctx) -> AuthInfo:
        secret = request.cookies.get(protocol.SESSION_COOKIE)
        auth = await resolve_session(ctx, secret) if secret else None
        if auth is None:
            raise SignedOut(
                RedirectResponse("/login", status_code=303)
                if redirect
                else Response("log in again", status_code=401, media_type="text/plain", headers=_HEADERS)
            )
        return auth

    return page_auth


PageAuth = Annotated[AuthInfo, Depends(_signed_in(redirect=True))]
FragmentAuth = Annotated[AuthInfo, Depends(_signed_in(redirect=False))]


def _render(request: Request, name: str, context: dict[str, Any], status_code: int = 200) -> Response:
    return TEMPLATES.TemplateResponse(request, name, context, status_code=status_code, headers=_HEADERS)


async def _view(request: Request, ctx: Ctx, auth: AuthInfo, **narrow: Any) -> dict[str, Any]:
    view = await ctx.db.call(
        dashboard_view,
        write=False,
        workspace_id=auth.workspace_id,
        now=time.time(),
        stale_after=ctx.settings.stale_after_s,
        **narrow,
    )
    _who(view, auth)
    view["api_base"] = protocol.workspace_path(auth.workspace)
    return view


def _who(view: dict[str, Any], auth: AuthInfo) -> None:
    """What every page shows of who is logged in; ``actions_refused``: why the buttons that
    change something are disabled ("" when they are not)."""
    view["workspace"] = auth.workspace
    view["role"] = auth.role
    view["actions_refused"] = (
        ""
        if auth.role == protocol.ROLE_ADMIN
        else role_refusal(auth, (protocol.ROLE_ADMIN,), "moving, pausing, resuming or forgetting a job")
    )


# --- the page ---------------------------------------------------------------------------------


@router.get("/", response_class=HTMLResponse)
async def index(request: Request, ctx: Ctx, auth: PageAuth) -> Response:
    view = await _view(request, ctx, auth)
    host = request.url.hostname or "localhost"
    port = request.url.port or (443 if request.url.scheme == "https" else 80)
    view["server_address"] = f"{host}:{port}/{auth.workspace}"
    view["token_env"] = protocol.TOKEN_ENV
    view["server_env"] = protocol.SERVER_ENV
    # Events published between this read and the script's subscription are not replayed to
    # it; the script compares this with the stream's first id and reloads the lists if they differ.
    view["event_id"] = ctx.bus.last_id
    return _render(request, "index.html", view)


# --- fragments (the script swaps these in on live events) -------------------------------------


@router.get("/ui/processes", response_class=HTMLResponse)
async def process_rows(
    request: Request,
    ctx: Ctx,
    auth: FragmentAuth,
    ids: Annotated[Optional[list[wire.ProcessId]], Query(alias="id")] = None,
) -> Response:
    """Rows of the processes named by ``id`` (repeated; those gone are left out), else all."""
    narrow = {"process_ids": ids[:_MAX_BATCH]} if ids else {}
    return _render(
        request, "fragments/rows.html", await _view(request, ctx, auth, devices=False, commands=False, **narrow)
    )


@router.get("/ui/processes/{process_id}/targets", response_class=HTMLResponse)
async def target_form(
    request: Request,
    ctx: Ctx,
    auth: FragmentAuth,
    process_id: wire.ProcessId,
    kind: str = Query("migrate", pattern="^(migrate|resume)$"),
) -> Response:
    view = await _view(request, ctx, auth, process_ids=[process_id], commands=False, devices=False, targets=kind)
    if not view["processes"]:
        return Response("", status_code=404, headers=_HEADERS)
    view["process"] = view["processes"][0]
    judged = view["targets"]
    view.update(
        kind=kind,
        fits=[t.device for t in judged if t.refusal is None],
        refused=[(t.device, t.refusal) for t in judged if t.refusal is not None],
    )
    return _render(request, "fragments/targets.html", view)


@router.get("/ui/jobs/{job_key:job_key}/migrate", response_class=HTMLResponse)
async def job_migrate_form(request: Request, ctx: Ctx, auth: FragmentAuth, job_key: str) -> Response:
    """The migrate form of a job of several ranks: a GPU for each rank, where it is by default."""
    view = await _view(request, ctx, auth, commands=False)
    job = next((item for kind, item in view["entries"] if kind == "job" and item.key == job_key), None)
    if job is None:
        return Response("", status_code=404, headers=_HEADERS)
    view.update(job=job, rank_targets=rank_targets(job, view["hosts"]))
    return _render(request, "fragments/job_migrate.html", view)


@router.get("/ui/devices", response_class=HTMLResponse)
async def device_cards(
    request: Request,
    ctx: Ctx,
    auth: FragmentAuth,
    hosts: Annotated[Optional[list[wire.HostName]], Query(alias="host")] = None,
) -> Response:
    """GPU cards of the hosts named by ``host`` (repeated), else of all hosts."""
    narrow = {"hosts": hosts[:_MAX_BATCH]} if hosts else {}
    view = await _view(request, ctx, auth, processes=False, commands=False, **narrow)
    return _render(request, "fragments/hosts.html", view)


@router.get("/ui/commands", response_class=HTMLResponse)
async def recent_commands(request: Request, ctx: Ctx, auth: FragmentAuth) -> Response:
    return _render(request, "fragments/commands.html", await _view(request, ctx, auth, processes=False, devices=False))


# --- the audit log -----------------------------------------------------------------------------


@router.get("/audit", response_class=HTMLResponse)
async def audit_page(request: Request, ctx: Ctx, auth: PageAuth) -> Response:
    view: dict[str, Any] = {"now": time.time(), "keep": storage.AUDIT_KEEP}
    view["entries"] = await ctx.db.call(
        storage.list_audit, write=False, workspace_id=auth.workspace_id, limit=_AUDIT_SHOWN
    )
    _who(view, auth)
    return _render(request, "audit.html", view)


# --- log in / out -----------------------------------------------------------------------------


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


def _login_form(request: Request, error: str, status_code: int) -> Response:
    return _render(request, "login.html", {"error": error}, status_code=status_code)


@router.get("/login", response_class=HTMLResponse)
async def login_page(request: Request) -> Response:
    return _render(request, "login.html", {"error": None})


@router.post("/login", response_class=HTMLResponse)
async def login(request: Request, ctx: Ctx) -> Response:
    """A token (the form) or a one-time login code (a login link, posted by login.js) opens a
    dashboard session; the cookie holds the session's id, never the token."""
    if cross_site(request):
        return _login_form(request, "refused: a login form must be posted from this server's own page", 403)
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
        refused = "invalid or revoked token"
    if auth is None:
        return _login_form(request, refused, 401)
    if auth.role == protocol.ROLE_JOB:
        return _login_form(request, "a job token cannot open the dashboard: log in with a viewer or admin token", 403)
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
    """Ends the session on the server (its event stream too), not only in this browser."""
    secret = request.cookies.get(protocol.SESSION_COOKIE)
    if secret:
        await services.log_out(ctx, secret=secret)
    response = RedirectResponse("/login", status_code=303)
    response.delete_cookie(protocol.SESSION_COOKIE)
    return response
