"""Drains as the server runs them, beside the requests (``routes`` and ``services`` call in here):
a person's drain and undrain, and the drain policy's pass (``policies/drain.py``) after each event
that can let it act (a command of a drained host ended) and at every sweep as a backstop, with
what it set going told as a person's command is (long-polls woken, dashboards told). The hosts
with a live drain (``ServerContext.drain_hosts``) follow each change made here and are re-read at
each sweep, for another server's drains."""

from __future__ import annotations

import logging
import time

from flexium import protocol, wire
from flexium.server import announce, queue
from flexium.server.context import ServerContext
from flexium.server.policies.drain import DrainOutcome, run_drains, start_drain
from flexium.server.policy_pass import run_policy_pass
from flexium.server.storage import AuthInfo
from flexium.server.storage.drains import end_drain, live_drains

log = logging.getLogger("flexium.server")


async def create_drain(ctx: ServerContext, *, auth: AuthInfo, body: wire.DrainRequest) -> wire.DrainInfo:
    drain: wire.DrainInfo
    outcome: DrainOutcome
    drain, outcome = await ctx.db.call(
        start_drain,
        write=True,
        workspace_id=auth.workspace_id,
        actor=auth,
        request=body,
        now=time.time(),
        stale_after=ctx.settings.stale_after_s,
    )
    ctx.drain_started(auth.workspace_id, drain.host)
    ctx.publish(auth.workspace_id, protocol.EVENT_DRAIN, {"action": "created", "drain": drain})
    await _told(ctx, outcome)
    return drain


async def undrain(ctx: ServerContext, *, auth: AuthInfo, drain_id: int) -> wire.DrainInfo:
    """The drain ended; the queue's pass over its host (its GPUs have room for waiting jobs again)."""
    drain: wire.DrainInfo = await ctx.db.call(
        end_drain,
        write=True,
        workspace_id=auth.workspace_id,
        actor=auth,
        drain_id=drain_id,
        now=time.time(),
        stale_after=ctx.settings.stale_after_s,
    )
    ctx.publish(auth.workspace_id, protocol.EVENT_DRAIN, {"action": "ended", "drain": drain})
    await refresh(ctx)
    await queue.run(ctx, workspace_id=auth.workspace_id, host=drain.host)
    return drain


async def command_ended(ctx: ServerContext, workspace_id: int, command: wire.CommandInfo) -> None:
    """A command ended: a drain of its host may act on the job now (its move ended, or it is free)."""
    host = ctx.process_hosts.get((workspace_id, command.process_id))
    if host is not None and (workspace_id, host) in ctx.drain_hosts:
        await run(ctx, workspace_id=workspace_id, host=host)


async def run(ctx: ServerContext, *, workspace_id: int | None = None, host: str | None = None) -> None:
    """One pass of the live drains (of one host, or all); never raises: a failed pass is retried at
    the next event or sweep."""
    outcome = await run_policy_pass(ctx, run_drains, what="the drains'", workspace_id=workspace_id, host=host)
    if outcome is None:
        return
    await _told(ctx, outcome)


async def _told(ctx: ServerContext, outcome: DrainOutcome) -> None:
    for workspace_id, command in outcome.commands:
        announce.commands_created(ctx, workspace_id, [command])
    for workspace_id, drain in outcome.drains:
        ctx.publish(workspace_id, protocol.EVENT_DRAIN, {"action": "updated", "drain": drain})
    if outcome.commands:
        await queue.refresh(ctx)  # the jobs it paused wait in the queue


async def refresh(ctx: ServerContext) -> None:
    """The hosts with a live drain read again."""
    try:
        drains = await ctx.db.call(live_drains, write=False)
    except Exception:  # the sweep reads them again
        log.debug("reading the live drains failed", exc_info=True)
        return
    ctx.drain_hosts = {(d.workspace_id, d.host) for d in drains}
