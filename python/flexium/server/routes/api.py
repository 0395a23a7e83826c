"""The JSON API under ``/api/w/{workspace}``. Route functions only translate HTTP to storage
calls and storage results to events; the rules live in ``flexium.server.storage``."""

from __future__ import annotations

import asyncio
import time
from typing import Annotated, Any, Optional

from fastapi import APIRouter, Header, Path, Query, Request, Response
from fastapi.responses import JSONResponse, StreamingResponse

from flexium import protocol
from flexium.server import storage
from flexium.server.auth import Auth
from flexium.server.context import Ctx
from flexium.server.errors import ApiError
from flexium.server.schemas import (CommandIn, CommandOut, CommandReportIn, CommandState,
                                    DevicesOut, DisplayState, ErrorOut, HeartbeatIn,
                                    HeartbeatOut, ProcessOut, RegisterIn, RegisterOut,
                                    TargetOut, TokenCreatedOut, TokenIn, TokenOut, WorkspaceOut)

_ERRORS: dict[int | str, dict[str, Any]] = {
    code: {"model": ErrorOut} for code in (400, 401, 404, 409, 413, 422, 503)}

router = APIRouter(prefix=protocol.API_PREFIX + "/w/{workspace}", responses=_ERRORS)

_NO_NUL = r"^[^\x00]*$"
ProcessIdPath = Annotated[str, Path(max_length=protocol.MAX_SHORT_TEXT, pattern=protocol.PROCESS_ID_RE.pattern)]
CommandIdPath = Annotated[int, Path(ge=1, le=2**31 - 1)]
WaitQuery = Annotated[Optional[float], Query(ge=0, le=protocol.MAX_POLL_TIMEOUT_S,
                                             description="seconds to wait (long-poll)")]


@router.get("", response_model=WorkspaceOut, summary="This workspace and its counts")
async def workspace_info(auth: Auth, ctx: Ctx) -> Any:
    return await ctx.db.call(storage.workspace_summary, write=False, workspace_id=auth.workspace_id)


# --- processes ------------------------------------------------------------------------------

@router.post("/processes", response_model=RegisterOut, status_code=201,
             summary="Register a process (again after a restart: same process_id, 200)")
async def register_process(body: RegisterIn, auth: Auth, ctx: Ctx, response: Response) -> Any:
    s = ctx.settings
    now = time.time()
    process, created, snapshot = await ctx.db.call(
        storage.register_process_snapshot, write=True, workspace_id=auth.workspace_id,
        report=body.model_dump(), now=now, stale_after=s.stale_after_s)
    ctx.process_hosts[(auth.workspace_id, body.process_id)] = process["host"]
    ctx.snapshots[(auth.workspace_id, body.process_id)] = snapshot
    if body.devices:
        ctx.devices_written(auth.workspace_id, process["host"], now)
        ctx.publish(auth.workspace_id, protocol.EVENT_DEVICES, {"host": process["host"]})
    ctx.publish(auth.workspace_id, protocol.EVENT_PROCESS,
                {"action": "registered" if created else "updated", "process": process})
    response.status_code = 201 if created else 200
    return {"process": process, "heartbeat_interval_s": s.heartbeat_interval_s,
            "poll_timeout_s": s.poll_timeout_s, "stale_after_s": s.stale_after_s, "server_time": now}


@router.get("/processes", response_model=list[ProcessOut], summary="List processes")
async def list_processes(auth: Auth, ctx: Ctx, state: Optional[DisplayState] = None,
                         host: Annotated[Optional[str], Query(max_length=protocol.MAX_HOST_LEN, pattern=_NO_NUL)] = None,
                         gpu: Annotated[Optional[str], Query(max_length=protocol.MAX_SHORT_TEXT, pattern=_NO_NUL,
                                                             description="GPU UUID")] = None) -> Any:
    return await ctx.db.call(storage.list_processes, write=False, workspace_id=auth.workspace_id,
                             now=time.time(), stale_after=ctx.settings.stale_after_s,
                             state=state, host=host, gpu=gpu)


@router.get("/processes/{process_id}", response_model=ProcessOut, summary="One process")
async def get_process(process_id: ProcessIdPath, auth: Auth, ctx: Ctx) -> Any:
    return await ctx.db.call(storage.get_process, write=False, workspace_id=auth.workspace_id,
                             process_id=process_id, now=time.time(),
                             stale_after=ctx.settings.stale_after_s)


@router.get("/processes/{process_id}/targets", response_model=list[TargetOut],
            summary="Every GPU of the process's host, with why a migrate or resume to it would be refused")
async def process_targets(process_id: ProcessIdPath, auth: Auth, ctx: Ctx,
                          kind: Annotated[str, Query(pattern="^(migrate|resume)$")] = "migrate") -> Any:
    return await ctx.db.call(storage.judge_targets, write=False, workspace_id=auth.workspace_id,
                             process_id=process_id, kind=kind, now=time.time(),
                             stale_after=ctx.settings.stale_after_s)


@router.delete("/processes/{process_id}", status_code=204,
               summary="Unregister (the process exits) or forget a stale entry")
async def unregister_process(process_id: ProcessIdPath, auth: Auth, ctx: Ctx) -> Response:
    await ctx.db.call(storage.unregister_process, write=True, workspace_id=auth.workspace_id,
                      process_id=process_id)
    ctx.forget_process(auth.workspace_id, process_id)
    ctx.publish(auth.workspace_id, protocol.EVENT_PROCESS,
                {"action": "removed", "process": {"process_id": process_id}})
    ctx.notifier.notify((auth.workspace_id, process_id))
    return Response(status_code=204)


@router.post("/processes/{process_id}/heartbeat", response_model=HeartbeatOut,
             summary="Liveness, memory and state; 404 means: register again")
async def heartbeat(process_id: ProcessIdPath, body: HeartbeatIn, auth: Auth, ctx: Ctx) -> Any:
    now = time.time()
    ws = auth.workspace_id
    report = body.model_dump(exclude_unset=True)
    ctx.metrics.heartbeats.inc()
    write_devices = bool(body.devices) and ctx.should_write_devices(ws, process_id, now)
    if not write_devices:
        report.pop("devices", None)
        if ctx.beat(ws, process_id, report, now):
            return JSONResponse({"ok": True, "pending_command": ctx.pending.get((ws, process_id)),
                                 "heartbeat_interval_s": ctx.settings.heartbeat_interval_s,
                                 "server_time": now})
    outcome = await ctx.db.call(storage.heartbeat, write=True, workspace_id=ws,
                                process_id=process_id, report=report, now=now,
                                stale_after=ctx.settings.stale_after_s, write_devices=write_devices)
    ctx.snapshots[(ws, process_id)] = outcome.snapshot
    ctx.command_pending(ws, process_id, outcome.pending_command)
    ctx.process_hosts[(ws, process_id)] = outcome.host
    if write_devices:
        ctx.devices_written(ws, outcome.host, now)
        ctx.publish(ws, protocol.EVENT_DEVICES, {"host": outcome.host})
    if outcome.changed is not None:
        ctx.publish(ws, protocol.EVENT_PROCESS, {"action": "updated", "process": outcome.changed})
    return {"ok": True, "pending_command": outcome.pending_command,
            "heartbeat_interval_s": ctx.settings.heartbeat_interval_s, "server_time": now}


@router.get("/processes/{process_id}/commands/next", response_model=CommandOut,
            responses={204: {"description": "nothing to do within the wait; poll again"}},
            summary="Long-poll: the next command for this process")
async def next_command(process_id: ProcessIdPath, auth: Auth, ctx: Ctx, wait: WaitQuery = None) -> Any:
    ws = auth.workspace_id
    key = (ws, process_id)
    loop = asyncio.get_running_loop()
    deadline = loop.time() + (ctx.settings.poll_timeout_s if wait is None else wait)
    woken = False
    while True:
        waiter = ctx.notifier.register(key)
        try:
            # Most polls find nothing; the in-memory view of pending commands (exact: every
            # command is created and settled in this process, and the sweep re-reads the
            # database) spares them any database work.
            if ctx.stopping:
                return Response(status_code=204)
            pending = woken or key in ctx.pending
            if not pending and key not in ctx.process_hosts:
                host, command_id = await ctx.db.call(storage.peek_command, write=False,
                                                     workspace_id=ws, process_id=process_id)
                ctx.process_hosts[key] = host
                pending = command_id is not None
            if pending:
                command, first = await ctx.db.call(storage.next_command, write=True, workspace_id=ws,
                                                   process_id=process_id, now=time.time())
                if command is not None:
                    ctx.command_pending(ws, process_id, command["id"])
                    if first:
                        ctx.metrics.delivery_latency.observe(
                            max(0.0, command["delivered_at"] - command["created_at"]))
                        ctx.publish(ws, protocol.EVENT_COMMAND, {"action": "updated", "command": command})
                    return command
                ctx.command_pending(ws, process_id, None)
            remaining = deadline - loop.time()
            if ctx.stopping or remaining <= 0 or not await ctx.notifier.wait(waiter, remaining):
                return Response(status_code=204)
            woken = True
        finally:
            ctx.notifier.unregister(key, waiter)


# --- commands -------------------------------------------------------------------------------

@router.post("/commands", response_model=CommandOut, status_code=201,
             summary="Migrate, pause or resume a process")
async def create_command(body: CommandIn, auth: Auth, ctx: Ctx) -> Any:
    ws = auth.workspace_id
    try:
        command = await ctx.db.call(storage.create_command, write=True, workspace_id=ws,
                                    kind=body.kind, process_id=body.process_id, target=body.target,
                                    now=time.time(), stale_after=ctx.settings.stale_after_s)
    except ApiError as exc:
        ctx.metrics.commands_refused.labels(error=exc.code).inc()
        raise
    ctx.command_pending(ws, body.process_id, command["id"])
    ctx.notifier.notify((ws, body.process_id))
    ctx.metrics.commands_created.labels(kind=body.kind).inc()
    ctx.publish(ws, protocol.EVENT_COMMAND, {"action": "created", "command": command})
    return command


@router.get("/commands", response_model=list[CommandOut], summary="Commands, newest first")
async def list_commands(auth: Auth, ctx: Ctx,
                        process_id: Annotated[Optional[str], Query(max_length=protocol.MAX_SHORT_TEXT, pattern=_NO_NUL)] = None,
                        state: Optional[CommandState] = None,
                        limit: Annotated[int, Query(ge=1, le=1000)] = 100,
                        before_id: Annotated[Optional[int], Query(ge=1, le=2**31 - 1)] = None) -> Any:
    return await ctx.db.call(storage.list_commands, write=False, workspace_id=auth.workspace_id,
                             process_id=process_id, state=state, limit=limit, before_id=before_id)


@router.get("/commands/{command_id}", response_model=CommandOut,
            summary="One command; with ?wait=S, answers when it ends or after S seconds")
async def get_command(command_id: CommandIdPath, auth: Auth, ctx: Ctx, wait: WaitQuery = None) -> Any:
    ws = auth.workspace_id
    key = ("cmd", ws, command_id)
    loop = asyncio.get_running_loop()
    deadline = loop.time() + (wait or 0.0)
    while True:
        waiter = ctx.notifier.register(key)
        try:
            command = await ctx.db.call(storage.get_command, write=False, workspace_id=ws,
                                        command_id=command_id)
            remaining = deadline - loop.time()
            if (command["state"] in protocol.FINAL_COMMAND_STATES or ctx.stopping or remaining <= 0
                    or not await ctx.notifier.wait(waiter, remaining)):
                return command
        finally:
            ctx.notifier.unregister(key, waiter)


@router.post("/commands/{command_id}/report", response_model=CommandOut,
             summary="The process reports: running, then succeeded or failed (with its result)")
async def report_command(command_id: CommandIdPath, body: CommandReportIn, auth: Auth, ctx: Ctx) -> Any:
    ws = auth.workspace_id
    command, process, changed = await ctx.db.call(
        storage.report_command, write=True, workspace_id=ws, command_id=command_id,
        report=body.model_dump(exclude_unset=True), now=time.time(),
        stale_after=ctx.settings.stale_after_s)
    if changed:
        ctx.command_settled(ws, command["process_id"], command_id)
        ctx.snapshots.pop((ws, command["process_id"]), None)
        ctx.publish(ws, protocol.EVENT_COMMAND, {"action": "updated", "command": command})
        if process is not None:
            ctx.publish(ws, protocol.EVENT_PROCESS, {"action": "updated", "process": process})
        ctx.notifier.notify(("cmd", ws, command_id))
        if command["state"] in protocol.FINAL_COMMAND_STATES:
            ctx.metrics.commands_finished.labels(kind=command["kind"], outcome=command["state"]).inc()
            seconds = (command.get("result") or {}).get("seconds")
            if not isinstance(seconds, (int, float)) or isinstance(seconds, bool) or seconds < 0:
                seconds = command["finished_at"] - (command["started_at"] or command["finished_at"])
            ctx.metrics.migration_duration.labels(kind=command["kind"], outcome=command["state"]).observe(seconds)
    return command


# --- devices, tokens, events ----------------------------------------------------------------

@router.get("/devices", response_model=DevicesOut, summary="GPUs by host, as processes report them")
async def list_devices(auth: Auth, ctx: Ctx,
                       host: Annotated[Optional[str], Query(max_length=protocol.MAX_HOST_LEN, pattern=_NO_NUL)] = None) -> Any:
    return await ctx.db.call(storage.list_devices, write=False, workspace_id=auth.workspace_id,
                             now=time.time(), stale_after=ctx.settings.stale_after_s, host=host)


@router.get("/tokens", response_model=list[TokenOut], summary="Tokens of this workspace (no secrets)")
async def list_tokens(auth: Auth, ctx: Ctx) -> Any:
    return await ctx.db.call(storage.list_tokens, write=False, workspace_id=auth.workspace_id)


@router.post("/tokens", response_model=TokenCreatedOut, status_code=201, summary="Issue a token")
async def issue_token(body: TokenIn, auth: Auth, ctx: Ctx) -> Any:
    info, token = await ctx.db.call(storage.issue_token, write=True, workspace_id=auth.workspace_id,
                                    name=body.name, now=time.time())
    return {**info, "token": token}


@router.delete("/tokens/{token_id}", response_model=TokenOut, summary="Revoke a token")
async def revoke_token(token_id: Annotated[int, Path(ge=1, le=2**31 - 1)], auth: Auth, ctx: Ctx) -> Any:
    info = await ctx.db.call(storage.revoke_token, write=True, workspace_id=auth.workspace_id,
                             token_id=token_id, now=time.time())
    ctx.tokens.forget(token_id)
    return info


@router.get("/events", response_class=StreamingResponse,
            responses={200: {"content": {"text/event-stream": {}}}},
            summary="Live events (server-sent events); resumes after Last-Event-ID")
async def events(request: Request, auth: Auth, ctx: Ctx,
                 last_event_id: Annotated[Optional[str], Header(max_length=32)] = None) -> StreamingResponse:
    resume_from = int(last_event_id) if last_event_id and last_event_id.isdigit() else None
    sub, backlog = ctx.bus.subscribe(auth.workspace_id, last_event_id=resume_from)
    keepalive = ctx.settings.sse_keepalive_s
    hello = ctx.bus.frame(ctx.bus.last_id, protocol.EVENT_HELLO,
                          {"workspace": auth.workspace, "last_event_id": ctx.bus.last_id})

    async def stream() -> Any:
        try:
            yield "retry: 2000\n\n" + hello
            for text in backlog:
                yield text
            while not ctx.stopping:
                if sub.overflowed:
                    while not sub.queue.empty():
                        sub.queue.get_nowait()
                    sub.overflowed = False
                    yield ctx.bus.frame(ctx.bus.last_id, protocol.EVENT_RESYNC, {})
                    continue
                try:
                    frame: Optional[str] = await asyncio.wait_for(sub.queue.get(), keepalive)
                except asyncio.TimeoutError:
                    yield ": keepalive\n\n"
                    continue
                if frame is None:
                    break
                yield frame
        finally:
            ctx.bus.unsubscribe(sub)

    return StreamingResponse(stream(), media_type="text/event-stream",
                             headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"})
