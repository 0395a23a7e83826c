"""The dashboard: one server-rendered page, and the fragments its script swaps in when a live
event says something changed (``/ui/...``). Page and fragments render through the same Jinja
macros from the same storage functions as the API, so a row looks the same on first load and
after an update, and every value a client sent goes through Jinja's escaping exactly once.

The script only moves server-rendered HTML around and posts commands to the API; it never
builds markup from data. The pages send a Content-Security-Policy without inline scripts as a
second line against injected markup."""

from __future__ import annotations

import math
import re
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
    """What the dashboard calls a process: its name (``wire.job_name``), else its id."""
    return process.name or process.process_id


# Where a long name may wrap: after _ - / and where a capital follows a small letter (camelCase).
# Browsers break only at spaces and after a hyphen, so overflow-wrap would split inside a word.
_WORD_BOUNDARY = re.compile(r"(?<=[_/-])(?=.)|(?<=[a-z])(?=[A-Z])")
_WRAP_HERE = Markup("<wbr>")


def word_breaks(text: str) -> Markup:
    """``text`` escaped, with a line-break opportunity (``<wbr>``, which adds no character to
    what is read or copied) between its words."""
    return _WRAP_HERE.join(escape(part) for part in _WORD_BOUNDARY.split(text))


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


# Known reasons a process cannot be moved, as the few words shown beside a greyed button (the
# full reason is its tooltip and is on the job page). First match wins; order: most specific.
_SHORT_REASONS = (
    ("needs a token with role", "read-only login: an admin token can"),
    ("CPU-only build", "CPU-only torch: no GPU memory to move"),
    ("no usable GPU", "torch sees no usable GPU"),
    ("engine is not running", "flexium's engine is off in this job"),
    ("install the NVIDIA driver", "no NVIDIA driver"),
    ("no NVIDIA driver", "no NVIDIA driver"),
    ("failed to initialise", "the NVIDIA driver failed to start"),
    ("is too old", "NVIDIA driver too old (550+ / 580+)"),
    ("lacks the checkpoint API", "driver lacks the checkpoint API (580+)"),
    ("migration to another GPU needs 580+", "this driver pauses only; moving needs 580+"),
    ("cannot be paused or moved as a whole", "its job cannot be moved as a whole"),
    ("cannot take part in a job operation", "a rank cannot take part"),
    ("GPU remapping on restore", "mixed driver versions"),
)
SHORT_REASON_MAX = 60


def short_reason(full: str) -> str:
    """A refusal in at most ``SHORT_REASON_MAX`` characters, for beside a greyed button."""
    for needle, short in _SHORT_REASONS:
        if needle in full:
            return short
    first = full.split(";")[0].split(": ")[0].strip()
    return first if len(first) <= SHORT_REASON_MAX else first[: SHORT_REASON_MAX - 1].rstrip() + "…"


def refusal(process: wire.ProcessInfo, kind: str, actions_refused: str) -> str:
    """Why ``kind`` (migrate, pause or resume) of ``process`` is refused before it is sent; ""
    when it is not. The same rules as the greyed buttons of the table."""
    if actions_refused:
        return actions_refused
    caps = process.capabilities
    able = caps.migration if kind == "migrate" else caps.pause_resume
    if able:
        return ""
    needs = "580+" if kind == "migrate" else "550+"
    return "; ".join(caps.problems) or f"This job's driver cannot {kind} (needs {needs})"


def job_pause_refusal(job: wire.JobSummary) -> Optional[str]:
    """Why the job's Pause button is greyed beyond its ranks' own problems: ranks of an NCCL job
    sharing a GPU (``protocol.nccl_ranks_on_one_gpu``, as the server refuses the pause)."""
    if not any(rank.capabilities.nccl for rank in job.ranks):
        return None
    placement = {rank.job.rank: rank.gpu_uuid for rank in job.ranks if rank.job is not None}
    return protocol.nccl_ranks_on_one_gpu(placement, restored=set(placement))


def sparkline(values: Sequence[Optional[float]], times: Sequence[float], *, since: float, until: float) -> str:
    """SVG polyline points of ``values`` (0..1, None: a gap skipped) over [since, until], in a
    240 x 40 box (the charts' viewBox)."""
    span = max(until - since, 1.0)
    points = []
    for value, at in zip(values, times, strict=True):
        if value is None:
            continue
        x = 240 * (at - since) / span
        y = 40 - 40 * min(max(value, 0.0), 1.0)
        points.append(f"{x:.1f},{y:.1f}")
    return " ".join(points)


def history_chart(samples: Sequence[storage.Sample], now: float) -> dict[str, Any]:
    """The points of a GPU's memory (share of its total) and utilization charts, from its first
    kept sample to now (at most the retention: a GPU seen for an hour fills the chart)."""
    since = max(now - storage.HISTORY_KEEP_S, min((s.at for s in samples), default=now))
    times = [s.at for s in samples]
    memory = [s.memory_used / s.memory_total if s.memory_total else None for s in samples]
    util = [None if s.utilization is None else s.utilization / 100 for s in samples]
    return {
        "memory": sparkline(memory, times, since=since, until=now),
        "utilization": sparkline(util, times, since=since, until=now),
        "samples": len(samples),
        "peak_memory": max((s.memory_used for s in samples), default=0),
        "peak_util": max((s.utilization for s in samples if s.utilization is not None), default=None),
        "span": fmt_duration(now - since, precise=False),
    }


def fmt_rate(per_s: Optional[float]) -> str:
    if per_s is None:
        return "—"
    return f"{per_s:.2f} steps/s" if per_s < 10 else f"{per_s:.0f} steps/s"


def fmt_loss(loss: Optional[float]) -> str:
    return "—" if loss is None else f"{loss:.4g}"


TEMPLATES.env.filters.update(
    bytes=fmt_bytes,
    duration=fmt_duration,
    utc=fmt_utc,
    rate=fmt_rate,
    loss=fmt_loss,
    short_reason=short_reason,
    word_breaks=word_breaks,
)
TEMPLATES.env.globals.update(
    fmt_ago=fmt_ago,
    job_name=job_name,
    gpu_label=gpu_label,
    membar=membar,
    command_seconds=command_seconds,
    refusal=refusal,
    job_pause_refusal=job_pause_refusal,
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
    if devices and process_ids is None:
        view["history"] = {
            key: history_chart(samples, now)
            for key, samples in storage.gpu_history(
                session=session, workspace_id=workspace_id, since=now - storage.HISTORY_KEEP_S
            ).items()
        }
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


def cluster_totals(view: dict[str, Any], *, moves_today: int) -> dict[str, Any]:
    """The summary over the main page: the GPUs of hosts that report, their memory, the jobs
    (a job of several ranks counts once) by state, and today's moves."""
    devices = [d for h in view.get("hosts", []) if not h.stale for d in h.devices]
    states = [item.state for _kind, item in view.get("entries", [])]
    return {
        "gpus": len(devices),
        "memory_used": sum(d.memory_used for d in devices),
        "memory_total": sum(d.memory_total for d in devices),
        "running": states.count("RUNNING"),
        "paused": states.count("PAUSED"),
        "moves_today": moves_today,
    }


def start_of_day_utc(now: float) -> float:
    return now - now % 86400


_TIMELINE = 200  # commands shown on a job page, newest first


def refused_process(target: str) -> str:
    """The process a refused command was for, from its audit entry's target ("pause gpu-1 to 2",
    ``storage.audit.record_command_refused``)."""
    words = target.split()
    return words[1] if len(words) > 1 else ""


def timeline(commands: list[wire.CommandInfo], refusals: list[wire.AuditEntry]) -> list[tuple[str, Any]]:
    """("command", CommandInfo) and ("refused", AuditEntry: a command the server refused, never
    created), newest first."""
    events: list[tuple[float, str, Any]] = [(c.created_at, "command", c) for c in commands]
    events += [(e.at, "refused", e) for e in refusals]
    events.sort(key=lambda event: event[0], reverse=True)
    return [(kind, item) for _at, kind, item in events]


def job_page_view(
    *, session: Session, workspace_id: int, process_id: str, now: float, stale_after: float
) -> dict[str, Any]:
    """A process, or the job of several ranks it is a rank of, with every command it received
    (newest first, each with who sent it from the audit log) and its GPUs."""
    process = storage.get_process(
        session=session, workspace_id=workspace_id, process_id=process_id, now=now, stale_after=stale_after
    )
    job = None
    ranks = [process]
    if process.job is not None and process.job.world_size > 1:
        everyone = storage.list_processes(session=session, workspace_id=workspace_id, now=now, stale_after=stale_after)
        job = next((j for j in storage.summarize_jobs(everyone) if j.key == process.job.key), None)
        if job is not None:
            ranks = job.ranks
    commands: list[wire.CommandInfo] = []
    for rank in ranks:
        commands += storage.list_commands(
            session=session, workspace_id=workspace_id, process_id=rank.process_id, limit=_TIMELINE
        )
    commands.sort(key=lambda c: c.id, reverse=True)
    senders: dict[int, wire.AuditEntry] = {}
    refusals: list[wire.AuditEntry] = []
    labels = {f"command {c.id} ({c.kind} {c.process_id})": c.id for c in commands}
    ids = {r.process_id for r in ranks}
    for entry in storage.list_audit(session=session, workspace_id=workspace_id, limit=storage.AUDIT_KEEP):
        if entry.action != "command.created":
            continue
        if entry.target in labels:
            senders[labels[entry.target]] = entry
        elif entry.outcome == "refused" and refused_process(entry.target) in ids:
            refusals.append(entry)
    hosts = sorted({r.host for r in ranks})
    history: dict[tuple[str, str], dict[str, Any]] = {}
    for host in hosts:
        samples = storage.gpu_history(
            session=session, workspace_id=workspace_id, since=now - storage.HISTORY_KEEP_S, host=host
        )
        history.update({key: history_chart(kept, now) for key, kept in samples.items()})
    return {
        "history": history,
        "now": now,
        "stale_after": stale_after,
        "gpu_indexes": storage.device_indexes(session=session, workspace_id=workspace_id),
        "process": process,
        "job": job,
        "ranks": ranks,
        "timeline": timeline(commands[:_TIMELINE], refusals),
        "senders": senders,
        "last": last_finished(commands),
        "hosts": [
            entry
            for host in hosts
            for entry in storage.list_devices(
                session=session, workspace_id=workspace_id, now=now, stale_after=stale_after, host=host
            ).hosts
        ],
    }


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


def seen_gpus(process: wire.ProcessInfo, devices: dict[str, Any]) -> list[Any]:
    """The GPUs of ``devices`` (its host's, by UUID) that ``process`` sees: where a migrate form
    may send it."""
    return [devices[uuid] for uuid in process.visible_gpus if uuid in devices]


def rank_targets(job: wire.JobSummary, hosts: list[wire.HostInfo]) -> list[tuple[wire.ProcessInfo, list[Any]]]:
    """(rank, the GPUs it may be sent to) for the job's migrate form."""
    on_host = {h.host: {d.uuid: d for d in h.devices} for h in hosts}
    return [(rank, seen_gpus(rank, on_host.get(rank.host, {}))) for rank in job.ranks]


def gpu_targets(process: wire.ProcessInfo, devices: dict[str, Any]) -> list[tuple[str, list[Any]]]:
    """(a GPU it holds memory on, the GPUs that memory may be sent to) for the migrate form of a
    process on several GPUs; its own device first."""
    seen = seen_gpus(process, devices)
    return [(uuid, seen) for uuid in [process.gpu_uuid or "", *process.other_gpus]]


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
    view["totals"] = await _totals(ctx, auth, view)
    return _render(request, "index.html", view)


@router.get("/ui/totals", response_class=HTMLResponse)
async def totals_fragment(request: Request, ctx: Ctx, auth: FragmentAuth) -> Response:
    """The cluster totals again, for the page's script once events changed what they count."""
    view = await _view(request, ctx, auth)
    view["totals"] = await _totals(ctx, auth, view)
    return _render(request, "fragments/totals.html", view)


async def _totals(ctx: Ctx, auth: AuthInfo, view: dict[str, Any]) -> dict[str, Any]:
    moves = await ctx.db.call(
        storage.count_finished,
        write=False,
        workspace_id=auth.workspace_id,
        kind="migrate",
        state="succeeded",
        since=start_of_day_utc(view["now"]),
    )
    return cluster_totals(view, moves_today=moves)


async def _job_view(request: Request, ctx: Ctx, auth: AuthInfo, process_id: str) -> Optional[dict[str, Any]]:
    try:
        view = await ctx.db.call(
            job_page_view,
            write=False,
            workspace_id=auth.workspace_id,
            process_id=process_id,
            now=time.time(),
            stale_after=ctx.settings.stale_after_s,
        )
    except NotFound:
        return None
    _who(view, auth)
    view["api_base"] = protocol.workspace_path(auth.workspace)
    return view


@router.get("/jobs/{process_id}", response_class=HTMLResponse)
async def job_page(request: Request, ctx: Ctx, auth: PageAuth, process_id: str) -> Response:
    """A job's page: the process (or every rank of its job), its progress and every command it
    received. Reached from the job's name in the main page's table."""
    view = await _job_view(request, ctx, auth, process_id)
    if view is None:
        view = {"now": time.time(), "missing": process_id}
        _who(view, auth)
        return _render(request, "job.html", view, status_code=404)
    view["event_id"] = ctx.bus.last_id
    return _render(request, "job.html", view)


@router.get("/ui/jobs/{process_id}/panel", response_class=HTMLResponse)
async def job_panel(request: Request, ctx: Ctx, auth: FragmentAuth, process_id: str) -> Response:
    """The job page's content, which its script swaps in on a change and every few seconds."""
    view = await _job_view(request, ctx, auth, process_id)
    if view is None:
        return Response("", status_code=404, headers=_HEADERS)
    return _render(request, "fragments/job_panel.html", view)


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
    """The Migrate / Resume dialog's form: the GPUs of the process's host judged as targets; to
    migrate a process on several GPUs, a GPU for each of its GPUs."""
    view = await _view(request, ctx, auth, process_ids=[process_id], commands=False, devices=False, targets=kind)
    if not view["processes"]:
        return Response("", status_code=404, headers=_HEADERS)
    process = view["process"] = view["processes"][0]
    judged = view["targets"]
    if kind == "migrate" and process.other_gpus:
        view["gpu_targets"] = gpu_targets(process, {t.device.uuid: t.device for t in judged})
        return _render(request, "fragments/gpus_migrate.html", view)
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
