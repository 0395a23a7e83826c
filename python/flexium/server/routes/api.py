"""The JSON API under ``/api/w/{workspace}``: HTTP in, one call (``flexium.server.services``
or a storage read), HTTP out. The rules live in ``flexium.server.storage``; the bodies are
the models of ``flexium.wire``. Each route's auth type names the roles it admits
(``flexium.server.auth``: Admin, Reader, Worker, Member); a job token is held to its own
processes by ``require_own_*``."""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Annotated, Any

from fastapi import APIRouter, Depends, Header, Path, Query, Request, Response
from fastapi.responses import StreamingResponse

from flexium import protocol, wire
from flexium.server import drains, long_poll, placing, queue, services, storage
from flexium.server.auth import (
    Admin,
    Member,
    Reader,
    Worker,
    require_own_command,
    require_own_operation,
    require_own_process,
)
from flexium.server.connections import received_at
from flexium.server.context import Ctx
from flexium.server.fair_share import StreamReader
from flexium.server.storage import AuthInfo

_ERRORS: dict[int | str, dict[str, Any]] = {
    code: {"model": wire.ErrorBody} for code in (400, 401, 403, 404, 409, 413, 422, 503)
}

router = APIRouter(prefix=protocol.API_PREFIX + "/w/{workspace}", responses=_ERRORS)

_NO_NUL = r"^[^\x00]*$"
ProcessIdPath = Annotated[str, Path(max_length=protocol.MAX_SHORT_TEXT, pattern=protocol.PROCESS_ID_RE.pattern)]
CommandIdPath = Annotated[int, Path(ge=1, le=2**31 - 1)]
RowIdPath = Annotated[int, Path(ge=1, le=2**31 - 1)]  # an operation's, a token's, a wait's, a placement's, a drain's
WaitQuery = Annotated[
    float | None, Query(ge=0, le=protocol.MAX_POLL_TIMEOUT_S, description="seconds to wait (long-poll)")
]


@router.get("", response_model=wire.WorkspaceInfo, summary="This workspace and its counts")
async def workspace_info(auth: Reader, ctx: Ctx) -> Any:
    return await ctx.db.call(storage.workspace_summary, write=False, workspace_id=auth.workspace_id)


# --- processes ------------------------------------------------------------------------------


@router.post(
    "/processes",
    response_model=wire.RegisterResponse,
    status_code=201,
    responses={200: {"model": wire.RegisterResponse, "description": "registered again (the same process_id)"}},
    summary="Register a process (again after a restart: same process_id, 200)",
)
async def register_process(body: wire.RegisterRequest, auth: Worker, ctx: Ctx, response: Response) -> Any:
    answer, created = await services.register_process(ctx, auth=auth, body=body)
    response.status_code = 201 if created else 200
    return answer


@router.get("/processes", response_model=list[wire.ProcessInfo], summary="List processes")
async def list_processes(
    auth: Reader,
    ctx: Ctx,
    state: wire.DisplayState | None = None,
    host: Annotated[str | None, Query(max_length=protocol.MAX_HOST_LEN, pattern=_NO_NUL)] = None,
    gpu: Annotated[
        str | None, Query(max_length=protocol.MAX_SHORT_TEXT, pattern=_NO_NUL, description="GPU UUID")
    ] = None,
) -> Any:
    return await ctx.db.call(
        storage.list_processes,
        write=False,
        workspace_id=auth.workspace_id,
        now=time.time(),
        stale_after=ctx.settings.stale_after_s,
        state=state,
        host=host,
        gpu=gpu,
    )


@router.get("/processes/{process_id}", response_model=wire.ProcessInfo, summary="One process")
async def get_process(process_id: ProcessIdPath, auth: Member, ctx: Ctx) -> Any:
    await require_own_process(ctx, auth, process_id)
    return await ctx.db.call(
        storage.get_process,
        write=False,
        workspace_id=auth.workspace_id,
        process_id=process_id,
        now=time.time(),
        stale_after=ctx.settings.stale_after_s,
    )


@router.get(
    "/processes/{process_id}/targets",
    response_model=list[wire.TargetInfo],
    summary="Every GPU of the process's host, with why a migrate or resume to it would be refused",
)
async def process_targets(
    process_id: ProcessIdPath,
    auth: Member,
    ctx: Ctx,
    kind: Annotated[str, Query(pattern="^(migrate|resume)$")] = "migrate",
) -> Any:
    await require_own_process(ctx, auth, process_id)
    return await ctx.db.call(
        storage.judge_targets,
        write=False,
        workspace_id=auth.workspace_id,
        process_id=process_id,
        kind=kind,
        now=time.time(),
        stale_after=ctx.settings.stale_after_s,
    )


@router.delete(
    "/processes/{process_id}", status_code=204, summary="Unregister (the process exits) or forget a stale entry"
)
async def unregister_process(process_id: ProcessIdPath, auth: Worker, ctx: Ctx) -> Response:
    await require_own_process(ctx, auth, process_id)
    await services.unregister_process(ctx, auth=auth, process_id=process_id)
    return Response(status_code=204)


@router.post(
    "/processes/{process_id}/heartbeat",
    response_model=wire.HeartbeatResponse,
    summary="Liveness, memory and state; 404 means: register again",
)
async def heartbeat(process_id: ProcessIdPath, body: wire.HeartbeatRequest, auth: Worker, ctx: Ctx) -> Any:
    await require_own_process(ctx, auth, process_id)
    return await services.heartbeat(
        ctx, workspace_id=auth.workspace_id, process_id=process_id, body=body, reporter=auth.token_id
    )


@router.get(
    "/processes/{process_id}/commands/next",
    response_model=wire.CommandInfo,
    responses={204: {"description": "nothing to do within the wait; poll again"}},
    summary="Long-poll: the next command for this process",
)
async def next_command(
    process_id: ProcessIdPath, auth: Worker, ctx: Ctx, request: Request, wait: WaitQuery = None
) -> Any:
    await require_own_process(ctx, auth, process_id)
    command = await long_poll.next_command(
        ctx,
        auth=auth,
        process_id=process_id,
        wait=wait,
        receive=request.receive,
        received_at=received_at(request.scope),
    )
    return Response(status_code=204) if command is None else command


# --- commands -------------------------------------------------------------------------------


@router.post(
    "/commands",
    response_model=wire.CommandInfo,
    status_code=201,
    summary=(
        "Migrate, pause or resume a process; for a rank of a job of several, the whole job: every rank's "
        "command is created (this answer is the addressed rank's; its job.operation_id names the operation)"
    ),
)
async def create_command(body: wire.CommandRequest, auth: Admin, ctx: Ctx) -> Any:
    return await services.create_command(ctx, auth=auth, body=body)


@router.get("/commands", response_model=list[wire.CommandInfo], summary="Commands, newest first")
async def list_commands(
    auth: Reader,
    ctx: Ctx,
    process_id: Annotated[str | None, Query(max_length=protocol.MAX_SHORT_TEXT, pattern=_NO_NUL)] = None,
    state: wire.CommandState | None = None,
    limit: Annotated[int, Query(ge=1, le=1000)] = 100,
    before_id: Annotated[int | None, Query(ge=1, le=2**31 - 1)] = None,
) -> Any:
    return await ctx.db.call(
        storage.list_commands,
        write=False,
        workspace_id=auth.workspace_id,
        process_id=process_id,
        state=state,
        limit=limit,
        before_id=before_id,
    )


@router.get(
    "/commands/{command_id}",
    response_model=wire.CommandInfo,
    summary="One command; with ?wait=S, answers when it ends or after S seconds",
)
async def get_command(command_id: CommandIdPath, auth: Member, ctx: Ctx, wait: WaitQuery = None) -> Any:
    await require_own_command(ctx, auth, command_id)
    return await long_poll.wait_command(ctx, auth=auth, command_id=command_id, wait=wait)


@router.post(
    "/commands/{command_id}/report",
    response_model=wire.CommandInfo,
    summary="The process reports: running, then succeeded or failed (with its result)",
)
async def report_command(command_id: CommandIdPath, body: wire.CommandReport, auth: Worker, ctx: Ctx) -> Any:
    await require_own_command(ctx, auth, command_id)
    return await services.report_command(ctx, auth=auth, command_id=command_id, body=body)


# --- jobs of several ranks -------------------------------------------------------------------


@router.get(
    "/operations/{operation_id}",
    response_model=wire.JobOperationInfo,
    summary="One job operation (every rank's command); with ?wait=S, answers when all ended or after S seconds",
)
async def get_operation(operation_id: RowIdPath, auth: Member, ctx: Ctx, wait: WaitQuery = None) -> Any:
    await require_own_operation(ctx, auth, operation_id)
    return await long_poll.wait_operation(ctx, auth=auth, operation_id=operation_id, wait=wait)


@router.get("/jobs", response_model=list[wire.JobSummary], summary="Jobs of several ranks, each with its ranks")
async def list_jobs(auth: Reader, ctx: Ctx) -> Any:
    return await ctx.db.call(
        storage.list_jobs,
        write=False,
        workspace_id=auth.workspace_id,
        now=time.time(),
        stale_after=ctx.settings.stale_after_s,
    )


# --- the resume-when-free queue, priorities ----------------------------------------------------

HostQuery = Annotated[str | None, Query(max_length=protocol.MAX_HOST_LEN, pattern=_NO_NUL)]


@dataclass(frozen=True)
class Listing:
    """The query of a list of waits, placements or drains: the live ones, or every one (``all``)."""

    live: bool
    limit: int


def _listing(
    all: Annotated[bool, Query(description="ended ones too, newest first")] = False,
    limit: Annotated[int, Query(ge=1, le=1000)] = 100,
) -> Listing:
    return Listing(live=not all, limit=limit)


ListingQuery = Annotated[Listing, Depends(_listing)]


async def _read(ctx: Ctx, auth: AuthInfo, read: Callable[..., Any], **query: Any) -> Any:
    """A storage read of the waits, placements or drains of the caller's workspace, as of now."""
    return await ctx.db.call(read, write=False, workspace_id=auth.workspace_id, now=time.time(), **query)


@router.post(
    "/waits",
    response_model=wire.WaitCreated,
    status_code=201,
    summary=(
        "Queue a paused job to be resumed when room appears on its host (make_room: pause jobs of lower priority "
        "for it now); resumed at once when it fits"
    ),
)
async def create_wait(body: wire.WaitRequest, auth: Admin, ctx: Ctx) -> Any:
    return await queue.create_wait(ctx, auth=auth, body=body)


@router.get(
    "/waits",
    response_model=list[wire.WaitInfo],
    summary="The queue: live waits by host in queue order; with all=true every wait, newest first",
)
async def list_waits(
    auth: Reader,
    ctx: Ctx,
    listing: ListingQuery,
    process_id: Annotated[str | None, Query(max_length=protocol.MAX_SHORT_TEXT, pattern=_NO_NUL)] = None,
) -> Any:
    return await _read(ctx, auth, storage.list_waits, process_id=process_id, live=listing.live, limit=listing.limit)


@router.get("/waits/{wait_id}", response_model=wire.WaitInfo, summary="One wait")
async def get_wait(wait_id: RowIdPath, auth: Reader, ctx: Ctx) -> Any:
    return await _read(ctx, auth, storage.get_wait, wait_id=wait_id)


@router.delete(
    "/waits/{wait_id}",
    response_model=wire.WaitInfo,
    summary="Cancel a waiting job's wait (a plain pause or resume of the job cancels it too)",
)
async def cancel_wait(wait_id: RowIdPath, auth: Admin, ctx: Ctx) -> Any:
    return await queue.cancel_wait(ctx, auth=auth, wait_id=wait_id)


@router.put(
    "/processes/{process_id}/priority",
    response_model=wire.ProcessInfo,
    summary="Set a job's priority (every rank of a job of several); the queue and make-room follow it",
)
async def set_priority(process_id: ProcessIdPath, body: wire.PriorityRequest, auth: Admin, ctx: Ctx) -> Any:
    return await queue.set_priority(ctx, auth=auth, process_id=process_id, body=body)


# --- flexium run's placements ------------------------------------------------------------------


@router.post(
    "/placements",
    response_model=wire.PlacementCreated,
    status_code=201,
    summary=(
        "Place a job not started yet (flexium run) on the GPU of its host with the most room, or wait for room "
        "(make_room, admin: pause jobs of lower priority for it now); placed at once when it fits"
    ),
)
async def create_placement(body: wire.PlacementRequest, auth: Worker, ctx: Ctx) -> Any:
    return await placing.create_placement(ctx, auth=auth, body=body)


@router.get(
    "/placements",
    response_model=list[wire.PlacementInfo],
    summary="Placements: live ones by host in queue order; with all=true every one, newest first",
)
async def list_placements(auth: Member, ctx: Ctx, listing: ListingQuery, host: HostQuery = None) -> Any:
    return await _read(
        ctx, auth, storage.list_placements, actor=auth, host=host, live=listing.live, limit=listing.limit
    )


@router.get("/placements/{placement_id}", response_model=wire.PlacementInfo, summary="One placement")
async def get_placement(placement_id: RowIdPath, auth: Member, ctx: Ctx) -> Any:
    return await _read(ctx, auth, storage.get_placement, actor=auth, placement_id=placement_id)


@router.post(
    "/placements/{placement_id}/report",
    response_model=wire.PlacementInfo,
    summary="flexium run asks again with its host's GPUs now; placed when it fits",
)
async def report_placement(placement_id: RowIdPath, body: wire.PlacementReport, auth: Worker, ctx: Ctx) -> Any:
    return await placing.ask_again(ctx, auth=auth, placement_id=placement_id, body=body)


@router.delete(
    "/placements/{placement_id}",
    response_model=wire.PlacementInfo,
    summary="flexium run is done with it: a waiting one is cancelled, a placed one ends and its room goes",
)
async def close_placement(placement_id: RowIdPath, auth: Worker, ctx: Ctx) -> Any:
    return await placing.close_placement(ctx, auth=auth, placement_id=placement_id)


# --- drains ------------------------------------------------------------------------------------


@router.post(
    "/drains",
    response_model=wire.DrainInfo,
    status_code=201,
    summary=(
        "Drain a GPU of a host, or all of them: each job on it migrated to the GPU of its host with the most room, "
        "or paused to resume when free; nothing placed, resumed or migrated there until it is undrained"
    ),
)
async def create_drain(body: wire.DrainRequest, auth: Admin, ctx: Ctx) -> Any:
    return await drains.create_drain(ctx, auth=auth, body=body)


@router.get(
    "/drains",
    response_model=list[wire.DrainInfo],
    summary="Live drains, oldest first (with all=true every drain, newest first), each with its moves job by job",
)
async def list_drains(auth: Reader, ctx: Ctx, listing: ListingQuery, host: HostQuery = None) -> Any:
    stale_after = ctx.settings.stale_after_s
    return await _read(
        ctx, auth, storage.list_drains, stale_after=stale_after, host=host, live=listing.live, limit=listing.limit
    )


@router.get("/drains/{drain_id}", response_model=wire.DrainInfo, summary="One drain and its progress, job by job")
async def get_drain(drain_id: RowIdPath, auth: Reader, ctx: Ctx) -> Any:
    return await _read(ctx, auth, storage.get_drain, drain_id=drain_id, stale_after=ctx.settings.stale_after_s)


@router.delete(
    "/drains/{drain_id}",
    response_model=wire.DrainInfo,
    summary="Undrain: its GPUs take jobs again (moves it sent that are under way go on)",
)
async def undrain(drain_id: RowIdPath, auth: Admin, ctx: Ctx) -> Any:
    return await drains.undrain(ctx, auth=auth, drain_id=drain_id)


# --- devices, tokens, events ----------------------------------------------------------------


@router.get("/devices", response_model=wire.DevicesResponse, summary="GPUs by host, as processes report them")
async def list_devices(
    auth: Reader,
    ctx: Ctx,
    host: Annotated[str | None, Query(max_length=protocol.MAX_HOST_LEN, pattern=_NO_NUL)] = None,
) -> Any:
    return await ctx.db.call(
        storage.list_devices,
        write=False,
        workspace_id=auth.workspace_id,
        now=time.time(),
        stale_after=ctx.settings.stale_after_s,
        host=host,
    )


@router.get("/tokens", response_model=list[wire.TokenInfo], summary="Tokens of this workspace (no secrets)")
async def list_tokens(auth: Reader, ctx: Ctx) -> Any:
    return await ctx.db.call(storage.list_tokens, write=False, workspace_id=auth.workspace_id, now=time.time())


@router.post(
    "/tokens",
    response_model=wire.TokenCreated,
    status_code=201,
    summary="Issue a token (admin); revoking the caller's token will revoke it too",
)
async def issue_token(body: wire.TokenRequest, auth: Admin, ctx: Ctx) -> Any:
    return await ctx.db.call(
        storage.issue_token,
        write=True,
        workspace_id=auth.workspace_id,
        name=body.name,
        role=body.role,
        minted_by=auth,
        expires_in_s=body.expires_in_s,
        now=time.time(),
    )


@router.delete(
    "/tokens/{token_id}",
    response_model=wire.TokenRevoked,
    summary="Revoke a token (admin), and every token it minted; their streams, polls and sessions end",
)
async def revoke_token(token_id: RowIdPath, auth: Admin, ctx: Ctx) -> Any:
    return await services.revoke_token(ctx, auth=auth, token_id=token_id)


@router.get(
    "/audit",
    response_model=list[wire.AuditEntry],
    summary="The audit log, newest first: commands, tokens, logins, refusals (changes kept a year, others 90 days)",
)
async def list_audit(
    auth: Reader,
    ctx: Ctx,
    limit: Annotated[int, Query(ge=1, le=1000)] = 100,
    before_id: Annotated[int | None, Query(ge=1, le=2**31 - 1)] = None,
) -> Any:
    return await ctx.db.call(
        storage.list_audit, write=False, workspace_id=auth.workspace_id, limit=limit, before_id=before_id
    )


@router.get(
    "/events",
    response_class=StreamingResponse,
    responses={200: {"content": {"text/event-stream": {}}}},
    summary="Live events (server-sent events); resumes after Last-Event-ID",
)
async def events(
    auth: StreamReader, ctx: Ctx, last_event_id: Annotated[str | None, Header(max_length=32)] = None
) -> StreamingResponse:
    return StreamingResponse(
        services.open_event_stream(ctx, auth=auth, last_event_id=last_event_id),
        media_type="text/event-stream",
        headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"},
    )
