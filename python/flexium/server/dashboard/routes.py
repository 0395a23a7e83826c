"""The dashboard's pages and the fragments its scripts swap in (``/ui/...``): HTTP only. Each
route reads its request, makes one call (a view of ``views/``, in one transaction) and renders
the view's template."""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Annotated

from fastapi import APIRouter, Query, Request
from fastapi.responses import HTMLResponse, Response
from starlette.convertors import PathConvertor, register_url_convertor

from flexium import wire
from flexium.server.context import Ctx, ServerContext
from flexium.server.dashboard.templating import nothing, render
from flexium.server.dashboard.viewer import ConnectLine, FragmentAuth, PageAuth, Viewer
from flexium.server.dashboard.views.audit import audit_page
from flexium.server.dashboard.views.commands import recent_commands
from flexium.server.dashboard.views.devices import host_cards, host_drain_form
from flexium.server.dashboard.views.job import job_page, job_progress
from flexium.server.dashboard.views.main import main_page, totals
from flexium.server.dashboard.views.processes import process_rows
from flexium.server.dashboard.views.queue import queue_panel
from flexium.server.dashboard.views.targets import GpusForm, job_migrate_form, target_form
from flexium.server.dashboard.views.tokens import issue_form, revoke_form, token_table
from flexium.server.errors import NotFound
from flexium.server.routes.api import RowIdPath
from flexium.server.storage import AuthInfo

router = APIRouter(include_in_schema=False)

_MAX_BATCH = 200  # ids or hosts one fragment request may name


class JobKeyConvertor(PathConvertor):
    """A job key in a path, whatever text its ranks registered: the ``path`` convertor's ``.*``
    stops at a newline, and a key with one would have no migrate form."""

    regex = r"[\s\S]+"


register_url_convertor("job_key", JobKeyConvertor())


@router.get("/", response_class=HTMLResponse)
async def index(request: Request, ctx: Ctx, auth: PageAuth) -> Response:
    view = await ctx.db.call(
        main_page, write=False, actor=auth, now=time.time(), stale_after=ctx.settings.stale_after_s
    )
    return render(
        request,
        "index.html",
        view.rows,
        view.cards,
        view.queue,
        view.recent,
        Viewer.of(auth),
        ConnectLine.of(request, auth),
        totals=view.totals,
        # Events published between this read and the script's subscription are not replayed to
        # it; the script compares this with the stream's first id and reloads the lists if they differ.
        event_id=ctx.bus.last_event_id,
    )


@router.get("/ui/totals", response_class=HTMLResponse)
async def totals_fragment(request: Request, ctx: Ctx, auth: FragmentAuth) -> Response:
    """The cluster totals again, for the page's script once events changed what they count."""
    view = await ctx.db.call(
        totals, write=False, workspace_id=auth.workspace_id, now=time.time(), stale_after=ctx.settings.stale_after_s
    )
    return render(request, "fragments/totals.html", totals=view)


@router.get("/jobs/{process_id}", response_class=HTMLResponse)
async def job(request: Request, ctx: Ctx, auth: PageAuth, process_id: str) -> Response:
    """A job's page: the process (or every rank of its job), its progress and every command it
    received. Reached from the job's name in the main page's table."""
    try:
        view = await ctx.db.call(
            job_page,
            write=False,
            workspace_id=auth.workspace_id,
            process_id=process_id,
            now=time.time(),
            stale_after=ctx.settings.stale_after_s,
        )
    except NotFound:
        return render(request, "job.html", Viewer.of(auth), now=time.time(), missing=process_id, status_code=404)
    return render(request, "job.html", view, Viewer.of(auth), event_id=ctx.bus.last_event_id)


@router.get("/ui/jobs/{process_id}/panel", response_class=HTMLResponse)
async def job_panel(request: Request, ctx: Ctx, auth: FragmentAuth, process_id: str) -> Response:
    """The job page's content, which its script swaps in when an event says the job changed."""
    try:
        view = await ctx.db.call(
            job_page,
            write=False,
            workspace_id=auth.workspace_id,
            process_id=process_id,
            now=time.time(),
            stale_after=ctx.settings.stale_after_s,
        )
    except NotFound:
        return nothing(404)
    return render(request, "fragments/job_panel.html", view, Viewer.of(auth))


@router.get("/ui/jobs/{process_id}/progress", response_class=HTMLResponse)
async def job_progress_fragment(request: Request, ctx: Ctx, auth: FragmentAuth, process_id: str) -> Response:
    """The job page's training sections, which its script swaps in on a progress event."""
    try:
        view = await ctx.db.call(
            job_progress,
            write=False,
            workspace_id=auth.workspace_id,
            process_id=process_id,
            now=time.time(),
            stale_after=ctx.settings.stale_after_s,
        )
    except NotFound:
        return nothing(404)
    return render(request, "fragments/job_progress.html", view, Viewer.of(auth))


@router.get("/ui/processes", response_class=HTMLResponse)
async def processes_fragment(
    request: Request,
    ctx: Ctx,
    auth: FragmentAuth,
    ids: Annotated[list[wire.ProcessId] | None, Query(alias="id")] = None,
) -> Response:
    """Rows of the processes named by ``id`` (repeated; those gone are left out), else all."""
    view = await ctx.db.call(
        process_rows,
        write=False,
        workspace_id=auth.workspace_id,
        now=time.time(),
        stale_after=ctx.settings.stale_after_s,
        process_ids=ids[:_MAX_BATCH] if ids else None,
    )
    return render(request, "fragments/rows.html", view, Viewer.of(auth))


@router.get("/ui/processes/{process_id}/targets", response_class=HTMLResponse)
async def targets_fragment(
    request: Request,
    ctx: Ctx,
    auth: FragmentAuth,
    process_id: wire.ProcessId,
    kind: str = Query("migrate", pattern="^(migrate|resume)$"),
) -> Response:
    """The Migrate / Resume dialog's form: the GPUs of the process's host judged as targets; to
    migrate a process on several GPUs, a GPU for each of its GPUs."""

    def template(view: object) -> str:
        return "fragments/gpus_migrate.html" if isinstance(view, GpusForm) else "fragments/targets.html"

    return await _dialog_form(request, ctx, auth, target_form, template, process_id=process_id, kind=kind)


@router.get("/ui/jobs/{job_key:job_key}/migrate", response_class=HTMLResponse)
async def job_migrate_fragment(request: Request, ctx: Ctx, auth: FragmentAuth, job_key: wire.NonEmptyText) -> Response:
    """The migrate form of a job of several ranks: a GPU for each rank, where it is by default
    (``job_key`` checked as its ranks' was, before it reaches the database)."""
    return await _dialog_form(request, ctx, auth, job_migrate_form, "fragments/job_migrate.html", job_key=job_key)


@router.get("/ui/devices", response_class=HTMLResponse)
async def devices_fragment(
    request: Request,
    ctx: Ctx,
    auth: FragmentAuth,
    hosts: Annotated[list[wire.HostName] | None, Query(alias="host")] = None,
) -> Response:
    """GPU cards of the hosts named by ``host`` (repeated), else of all hosts."""
    view = await ctx.db.call(
        host_cards,
        write=False,
        workspace_id=auth.workspace_id,
        now=time.time(),
        stale_after=ctx.settings.stale_after_s,
        hosts=hosts[:_MAX_BATCH] if hosts else None,
    )
    return render(request, "fragments/hosts.html", view, Viewer.of(auth))


@router.get("/ui/drain-host", response_class=HTMLResponse)
async def drain_host_fragment(request: Request, ctx: Ctx, auth: FragmentAuth, host: wire.HostName) -> Response:
    """The Drain host dialog's form: what draining every GPU of ``host`` does to its jobs."""
    return await _dialog_form(request, ctx, auth, host_drain_form, "fragments/drain_host.html", host=host)


async def _dialog_form(
    request: Request,
    ctx: ServerContext,
    auth: AuthInfo,
    read: Callable[..., object | None],
    template: str | Callable[[object], str],
    **asked: str,
) -> Response:
    """A dialog's form: its view read in one transaction and rendered in ``template`` (or the one
    ``template(view)`` names); 404 where what it is about is gone (``read`` gave None)."""
    view = await ctx.db.call(
        read,
        write=False,
        workspace_id=auth.workspace_id,
        now=time.time(),
        stale_after=ctx.settings.stale_after_s,
        **asked,
    )
    if view is None:
        return nothing(404)
    return render(request, template if isinstance(template, str) else template(view), view, Viewer.of(auth))


@router.get("/ui/queue", response_class=HTMLResponse)
async def queue_fragment(request: Request, ctx: Ctx, auth: FragmentAuth) -> Response:
    """The queue again, for the page's script once an event said it changed (a ``wait`` event, or
    a ``devices`` event: flexium run's placements tell no event of their own)."""
    view = await ctx.db.call(
        queue_panel,
        write=False,
        actor=auth,
        now=time.time(),
        stale_after=ctx.settings.stale_after_s,
    )
    return render(request, "fragments/queue.html", view, Viewer.of(auth))


@router.get("/ui/commands", response_class=HTMLResponse)
async def commands_fragment(request: Request, ctx: Ctx, auth: FragmentAuth) -> Response:
    view = await ctx.db.call(recent_commands, write=False, workspace_id=auth.workspace_id, now=time.time())
    return render(request, "fragments/commands.html", view, Viewer.of(auth))


@router.get("/audit", response_class=HTMLResponse)
async def audit(request: Request, ctx: Ctx, auth: PageAuth) -> Response:
    view = await ctx.db.call(audit_page, write=False, workspace_id=auth.workspace_id, now=time.time())
    return render(request, "audit.html", view, Viewer.of(auth))


@router.get("/tokens", response_class=HTMLResponse)
async def tokens(request: Request, ctx: Ctx, auth: PageAuth) -> Response:
    """The workspace's tokens; for an admin, the forms that issue and revoke them (through the API)."""
    view = await ctx.db.call(token_table, write=False, actor=auth, now=time.time())
    return render(request, "tokens.html", view, issue_form(auth), Viewer.of(auth), ConnectLine.of(request, auth))


@router.get("/ui/tokens", response_class=HTMLResponse)
async def tokens_fragment(request: Request, ctx: Ctx, auth: FragmentAuth) -> Response:
    """The tokens table again, for the page's script once it issued or revoked one."""
    view = await ctx.db.call(token_table, write=False, actor=auth, now=time.time())
    return render(request, "fragments/tokens.html", view, Viewer.of(auth))


@router.get("/ui/tokens/{token_id}/revoke", response_class=HTMLResponse)
async def revoke_token_fragment(request: Request, ctx: Ctx, auth: FragmentAuth, token_id: RowIdPath) -> Response:
    """The Revoke dialog's form: the tokens revoked with it and the processes left unheard, to
    confirm; 404 where the token is no longer active."""
    view = await ctx.db.call(
        revoke_form,
        write=False,
        actor=auth,
        token_id=token_id,
        now=time.time(),
        stale_after=ctx.settings.stale_after_s,
    )
    if view is None:
        return nothing(404)
    return render(request, "fragments/revoke_token.html", view, Viewer.of(auth))
