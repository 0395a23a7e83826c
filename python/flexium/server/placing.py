"""flexium run's placements as the server runs them beside the requests: a placement asked for
(the pauses that make room for it announced as any command is), asked again with its host's GPUs
as ``flexium run`` reads them; each time the GPUs it reported are stored and told as a job's are,
and the resume-when-free queue's pass over that host follows (a placement takes no GPU that a
paused job waiting before it waits for: ``policies/placement.py``). At every sweep, the placement
pass over every host, for room that a job's report showed between two of flexium run's asks."""

from __future__ import annotations

import functools
import time

from flexium import protocol, wire
from flexium.server import queue
from flexium.server.context import ServerContext
from flexium.server.policies.placement import PlacementOutcome, place_job, report_placement, run_placement_pass
from flexium.server.policy_pass import run_policy_pass
from flexium.server.storage import AuthInfo


async def create_placement(ctx: ServerContext, *, auth: AuthInfo, body: wire.PlacementRequest) -> wire.PlacementCreated:
    now = time.time()
    outcome: PlacementOutcome = await ctx.db.call(
        place_job,
        write=True,
        workspace_id=auth.workspace_id,
        actor=auth,
        request=body,
        now=now,
        stale_after=ctx.settings.stale_after_s,
        reservation_ttl=ctx.settings.reservation_ttl_s,
    )
    queue.announce_commands(ctx, auth.workspace_id, outcome.pauses)
    if outcome.pauses:
        await queue.refresh(ctx)
    await _devices_stored(ctx, auth.workspace_id, body.host, now)
    return wire.PlacementCreated(placement=outcome.placement, commands=list(outcome.pauses))


async def ask_again(
    ctx: ServerContext, *, auth: AuthInfo, placement_id: int, body: wire.PlacementReport
) -> wire.PlacementInfo:
    now = time.time()
    placement: wire.PlacementInfo = await ctx.db.call(
        report_placement,
        write=True,
        workspace_id=auth.workspace_id,
        actor=auth,
        placement_id=placement_id,
        report=body,
        now=now,
        stale_after=ctx.settings.stale_after_s,
        reservation_ttl=ctx.settings.reservation_ttl_s,
    )
    if body.devices:
        await _devices_stored(ctx, auth.workspace_id, placement.host, now)
    return placement


async def _devices_stored(ctx: ServerContext, workspace_id: int, host: str, now: float) -> None:
    ctx.devices_written(workspace_id, host, now)
    ctx.publish(workspace_id, protocol.EVENT_DEVICES, {"host": host})
    await queue.room_changed(ctx, workspace_id, host)


async def run(ctx: ServerContext) -> None:
    """The sweep's placement pass over every host; never raises (a failed pass is retried at the
    next sweep)."""
    place = functools.partial(run_placement_pass, reservation_ttl=ctx.settings.reservation_ttl_s)
    await run_policy_pass(ctx, place, what="the placements'", workspace_id=None, host=None)
