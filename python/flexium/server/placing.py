"""flexium run's placements as the server runs them beside the requests: a placement asked for
(the pauses that make room for it announced as any command is), asked again with its host's GPUs
as ``flexium run`` reads them, taken by its job, given up by its flexium run; each time the GPUs it
reported are stored and told as a job's are, the resume-when-free queue's pass over that host runs
first, then the placements' (a placement takes no GPU that a paused job waiting before it waits
for, nor a paused job one a placement waiting before it waits for, but as ``policies/waited_for.py``
allows). The placement pass over a host runs after each of its GPU
reports too, and over every host at every sweep (``queue.place``). Every placement a request or a
pass changed is a ``placement`` event for the dashboards (``announce.placements_changed``)."""

from __future__ import annotations

import time

from flexium import protocol, wire
from flexium.server import announce, queue, storage
from flexium.server.context import ServerContext
from flexium.server.policies.placement import PlacementOutcome, place_job, report_placement
from flexium.server.policy_pass import answering_since
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
        answering_since=answering_since(ctx),
        backfill_patience=ctx.settings.backfill_patience_s,
    )
    announce.commands_created(ctx, auth.workspace_id, outcome.pauses)
    queue.told(ctx, outcome.queued)
    ctx.publish(auth.workspace_id, protocol.EVENT_PLACEMENT, {"action": "created", "placement": outcome.placement})
    announce.placements_changed(ctx, auth.workspace_id, [p for p in outcome.changed if p.id != outcome.placement.id])
    if outcome.placement.state in protocol.LIVE_PLACEMENT_STATES:  # its host's reports place it from now on
        ctx.jobs_wait({}, (auth.workspace_id, body.host))
    if outcome.pauses:
        await queue.refresh(ctx)
    await queue.devices_stored(ctx, auth.workspace_id, body.host, now)
    return wire.PlacementCreated(placement=outcome.placement, commands=list(outcome.pauses))


async def ask_again(
    ctx: ServerContext, *, auth: AuthInfo, placement_id: int, body: wire.PlacementReport
) -> wire.PlacementInfo:
    now = time.time()
    outcome: PlacementOutcome = await ctx.db.call(
        report_placement,
        write=True,
        workspace_id=auth.workspace_id,
        actor=auth,
        placement_id=placement_id,
        report=body,
        now=now,
        stale_after=ctx.settings.stale_after_s,
        reservation_ttl=ctx.settings.reservation_ttl_s,
        answering_since=answering_since(ctx),
        backfill_patience=ctx.settings.backfill_patience_s,
    )
    queue.told(ctx, outcome.queued)
    announce.placements_changed(ctx, auth.workspace_id, outcome.changed)
    if body.devices:
        await queue.devices_stored(ctx, auth.workspace_id, outcome.placement.host, now)
    return outcome.placement


async def close_placement(ctx: ServerContext, *, auth: AuthInfo, placement_id: int) -> wire.PlacementInfo:
    """flexium run gave it up (its job ended, Ctrl-C while it waited), or an admin cancelled it."""
    placement: wire.PlacementInfo = await ctx.db.call(
        storage.close_placement,
        write=True,
        workspace_id=auth.workspace_id,
        actor=auth,
        placement_id=placement_id,
        now=time.time(),
    )
    announce.placements_changed(ctx, auth.workspace_id, [placement])
    await queue.room_changed(ctx, auth.workspace_id, placement.host)  # the room it held, free
    return placement


async def take_placement(ctx: ServerContext, *, auth: AuthInfo, placement_id: int, process_id: str) -> None:
    """A job registered with the placement flexium run handed it (``storage.take_placement``)."""
    taken: wire.PlacementInfo | None = await ctx.db.call(
        storage.take_placement,
        write=True,
        workspace_id=auth.workspace_id,
        actor=auth,
        placement_id=placement_id,
        process_id=process_id,
        now=time.time(),
    )
    if taken is not None:
        announce.placements_changed(ctx, auth.workspace_id, [taken])
