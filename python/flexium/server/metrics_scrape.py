"""What a scrape of ``/metrics`` answers: the server's totals, then, for a viewer's or an admin's
token, the GPUs and jobs of that token's workspace alone (another workspace's job names, hosts
and process ids are not its to read). Without a token, where ``--public-metrics`` allows it: the
totals alone.

Each part is read from the database and rendered at most once every ``metrics_refresh_s`` on a
worker thread, and answered from memory between: a scrape of a workspace at its quotas' limits
is thousands of series, and rendered on the event loop for each scrape it held heartbeats up
for seconds."""

from __future__ import annotations

import asyncio
import time

from flexium.server import storage
from flexium.server.context import ServerContext
from flexium.server.metrics import render_workspace
from flexium.server.storage import AuthInfo

_TOTALS = "totals"


async def scrape(ctx: ServerContext, auth: AuthInfo | None) -> bytes:
    now = time.time()
    fresh_for = ctx.settings.metrics_refresh_s
    totals = await ctx.metrics.pages.page(_TOTALS, lambda: _totals(ctx), now=now, fresh_for=fresh_for)
    if auth is None:
        return totals
    series = await ctx.metrics.pages.page(
        ("workspace", auth.workspace_id), lambda: _workspace(ctx, auth), now=now, fresh_for=fresh_for
    )
    return totals + series


async def _totals(ctx: ServerContext) -> bytes:
    processes = await ctx.db.call(
        storage.count_processes, write=False, now=time.time(), stale_after=ctx.settings.stale_after_s
    )
    commands = await ctx.db.call(storage.count_commands, write=False)
    return ctx.metrics.render(
        processes=processes,
        commands=commands,
        long_polls=ctx.notifier.waiting,
        sse_subscribers=ctx.bus.subscribers,
        db_waiting=ctx.db.calls_waiting,
    )


async def _workspace(ctx: ServerContext, auth: AuthInfo) -> bytes:
    series = await ctx.db.call(
        storage.workspace_series,
        write=False,
        workspace_id=auth.workspace_id,
        workspace=auth.workspace,
        now=time.time(),
        stale_after=ctx.settings.stale_after_s,
    )
    return await asyncio.to_thread(render_workspace, series)
