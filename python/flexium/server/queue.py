"""The resume-when-free queue as the server runs it, beside the requests (``services`` calls in
here): a person's waits, cancellations and priorities; the queue's pass (``policies``) after each
event that can give a waiting job room (a GPU report of its host stored, a command ended, a
process gone, a wait created, room held past its time) and at every sweep as a backstop, each
followed by the placement pass over the same host (flexium run's jobs not started yet wait in the
same queue, after the paused jobs: ``placing``); and what a pass set going, told as a person's
command is (long-polls woken, dashboards told). The in-memory view heartbeats answer with
(``ServerContext.watches``, and the hosts with a job waiting, ``queue_hosts``) follows each change
made here or told by another replica (``server/replicas.py``), and is re-read at each sweep as a
backstop."""

from __future__ import annotations

import asyncio
import functools
import logging
import time
from collections.abc import Callable, Coroutine
from typing import Any

from flexium import protocol, wire
from flexium.server import announce, storage
from flexium.server.context import ServerContext
from flexium.server.policies.placement import run_placement_pass
from flexium.server.policies.resume_when_free import Queued, QueueOutcome, queue_resume, run_queue
from flexium.server.policy_pass import answering_since, run_policy_pass
from flexium.server.storage import AuthInfo

log = logging.getLogger("flexium.server")

QUEUE_VIEW_EVERY_S = 0.25


def watch_news(workspace_id: int, process_id: str) -> tuple[str, int, str]:
    """The notifier key that ends a process's long-poll empty: what it should watch changed, and
    its heartbeat's answer says so (``long_poll.next_command``)."""
    return ("watch", workspace_id, process_id)


def watch_of(ctx: ServerContext, workspace_id: int, process_id: str) -> wire.RoomWatch | None:
    """What a heartbeat's answer tells the process to watch (it waits in the queue), from memory."""
    return ctx.watches.get((workspace_id, process_id))


async def create_wait(ctx: ServerContext, *, auth: AuthInfo, body: wire.WaitRequest) -> wire.WaitCreated:
    queued: Queued = await ctx.db.call(
        queue_resume,
        write=True,
        workspace_id=auth.workspace_id,
        actor=auth,
        request=body,
        now=time.time(),
        stale_after=ctx.settings.stale_after_s,
        reservation_ttl=ctx.settings.reservation_ttl_s,
        backfill_patience=ctx.settings.backfill_patience_s,
    )
    answer = queued.answer
    if queued.watches:  # its job watches from now on (the view read again follows)
        ctx.jobs_wait(queued.watches, (auth.workspace_id, answer.wait.host))
        for workspace_id, process_id in queued.watches:  # told at once, not at its next heartbeat
            ctx.notifier.notify(watch_news(workspace_id, process_id))
    announce.commands_created(ctx, auth.workspace_id, [c for c in answer.commands if c.kind == "pause"])
    ctx.publish(auth.workspace_id, protocol.EVENT_WAIT, {"action": "created", "wait": answer.wait})
    told(ctx, queued.outcome, queue_changed=True)
    return answer


async def cancel_wait(ctx: ServerContext, *, auth: AuthInfo, wait_id: int) -> wire.WaitInfo:
    wait: wire.WaitInfo = await ctx.db.call(
        storage.cancel_wait, write=True, workspace_id=auth.workspace_id, actor=auth, wait_id=wait_id, now=time.time()
    )
    ctx.publish(auth.workspace_id, protocol.EVENT_WAIT, {"action": "updated", "wait": wait})
    await refresh(ctx)
    return wait


async def set_priority(
    ctx: ServerContext, *, auth: AuthInfo, process_id: str, body: wire.PriorityRequest
) -> wire.ProcessInfo:
    process: wire.ProcessInfo = await ctx.db.call(
        storage.set_priority,
        write=True,
        workspace_id=auth.workspace_id,
        actor=auth,
        process_id=process_id,
        priority=body.priority,
        now=time.time(),
        stale_after=ctx.settings.stale_after_s,
    )
    ctx.publish(auth.workspace_id, protocol.EVENT_PROCESS, {"action": "updated", "process": process})
    if process.wait_id is not None:  # its place in the queue changed: it may go first now
        await run(ctx, workspace_id=auth.workspace_id, host=process.host)
    return process


async def room_changed(ctx: ServerContext, workspace_id: int, host: str | None) -> None:
    """Something that can give room on ``host`` happened: the queue's pass over it, and the
    placements' after it, when a job waits there (``ctx.queue_hosts``: a wait made through another
    replica is told to this one at once through the replica link, ``ServerContext.jobs_wait``)."""
    if host is not None and (workspace_id, host) in ctx.queue_hosts:
        await _host_pass(ctx, workspace_id, host)


async def devices_stored(ctx: ServerContext, workspace_id: int, host: str, now: float) -> None:
    """A GPU report of ``host`` stored with a job's registration or flexium run's placement (a
    heartbeat's is told as it is stored, with the room it showed): its write counted on every
    replica, dashboards told, and the passes over the host."""
    ctx.devices_written(workspace_id, host, now)
    ctx.publish(workspace_id, protocol.EVENT_DEVICES, {"host": host})
    await room_changed(ctx, workspace_id, host)


async def command_ended(ctx: ServerContext, workspace_id: int, command: wire.CommandInfo) -> None:
    """A command ended: the wait whose resume it was (done, or waiting again) is shown anew, and
    the room a pause freed goes to the queue."""
    if command.reason is not None:  # only the queue's resumes are a wait's
        wait = await ctx.db.call(
            storage.wait_of_command, write=False, workspace_id=workspace_id, command_id=command.id, now=time.time()
        )
        if wait is not None:
            ctx.publish(workspace_id, protocol.EVENT_WAIT, {"action": "updated", "wait": wait})
    host = ctx.process_hosts.get((workspace_id, command.process_id))
    if host is not None:
        await _host_pass(ctx, workspace_id, host)
    refresh_soon(ctx)


async def run(ctx: ServerContext, *, workspace_id: int | None = None, host: str | None = None) -> None:
    """One pass of the queue (over one host, or every host); never raises: a failed pass is
    retried at the next event or sweep."""
    started = time.perf_counter()
    decide = functools.partial(run_queue, backfill_patience=ctx.settings.backfill_patience_s)
    outcome = await run_policy_pass(ctx, decide, what="the queue's", workspace_id=workspace_id, host=host)
    if outcome is None:
        return
    ctx.metrics.queue_decision.observe(time.perf_counter() - started)
    told(ctx, outcome)


async def place(ctx: ServerContext, *, workspace_id: int | None = None, host: str | None = None) -> None:
    """The placement pass over one host, or every host (the sweep's); never raises: a failed pass
    is retried at the next event or sweep."""
    decide = functools.partial(
        run_placement_pass,
        reservation_ttl=ctx.settings.reservation_ttl_s,
        answering_since=answering_since(ctx),
        backfill_patience=ctx.settings.backfill_patience_s,
    )
    changed = await run_policy_pass(ctx, decide, what="the placements'", workspace_id=workspace_id, host=host)
    for ws, placement in changed or ():
        announce.placements_changed(ctx, ws, [placement])


def _host_pass(ctx: ServerContext, workspace_id: int, host: str) -> asyncio.Future[None]:
    """A pass of the queue, and of the placements, over ``host`` that starts after this call. Every
    event that asks for one before it starts shares it: a server that is behind runs one pass for
    the many GPU reports and command ends of a host that came in meanwhile, not one each."""
    key = (workspace_id, host)
    scheduled = ctx.queue_passes.get(key)
    if scheduled is None:

        async def one_pass() -> None:
            del ctx.queue_passes[key]  # an event from here on asks for the next pass
            await run(ctx, workspace_id=workspace_id, host=host)
            await place(ctx, workspace_id=workspace_id, host=host)

        scheduled = ctx.queue_passes[key] = _in_background(one_pass())
    return asyncio.shield(scheduled)


def told(ctx: ServerContext, outcome: QueueOutcome, *, queue_changed: bool = False) -> None:
    """What a pass did, told: the resumes it sent announced, the waits it changed shown, the view
    read again soon when the queue changed (``queue_changed``: before the pass)."""
    for done in outcome.dispatched:
        announce.commands_created(ctx, done.workspace_id, done.commands)
        ctx.metrics.queue_resumes.inc()
        ctx.publish(done.workspace_id, protocol.EVENT_WAIT, {"action": "updated", "wait": done.wait})
    for workspace_id, wait in outcome.cancelled:
        ctx.publish(workspace_id, protocol.EVENT_WAIT, {"action": "updated", "wait": wait})
    ended = {done.wait.id for done in outcome.dispatched} | {wait.id for _ws, wait in outcome.cancelled}
    if ended:  # their jobs watch no more from now on (the view read again follows)
        ctx.waits_ended(ended)
    if queue_changed or ended:
        refresh_soon(ctx)


async def refresh(ctx: ServerContext) -> None:
    """The in-memory view of the queue read again (a read that starts after this call)."""
    await asyncio.shield(refresh_soon(ctx))


def refresh_soon(ctx: ServerContext) -> asyncio.Future[None]:
    """The in-memory view of the queue read again, at most every ``QUEUE_VIEW_EVERY_S``: every change
    asks for it, and a queue of hundreds of waits changes many times a second under load. A read not
    started yet is shared by every change that asks for it meanwhile."""
    scheduled = ctx.queue_view_read
    if scheduled is None:
        delay = ctx.queue_view_read_at + QUEUE_VIEW_EVERY_S - time.monotonic()
        scheduled = ctx.queue_view_read = _in_background(_read_view(ctx, delay))
    return scheduled


async def _read_view(ctx: ServerContext, delay: float) -> None:
    if delay > 0:
        await asyncio.sleep(delay)
    ctx.queue_view_read = None  # a change from here on asks for the next read
    ctx.queue_view_read_at = time.monotonic()
    changes: list[Callable[[], None]] = []
    ctx.queue_view_reads.append(changes)
    try:
        view: storage.QueueView = await ctx.db.call(storage.queue_view, write=False)
    except Exception:  # the sweep reads it again
        log.debug("reading the queue's view failed", exc_info=True)
        return
    finally:
        ctx.queue_view_reads[:] = [other for other in ctx.queue_view_reads if other is not changes]
    ctx.watches = view.watches
    ctx.queue_hosts = set(view.hosts)
    for change in changes:  # a wait made or ended here meanwhile: the read may not have seen it
        change()


_running: set[asyncio.Task[None]] = set()  # a task the loop holds only weakly is kept here until it ends


def _in_background(work: Coroutine[Any, Any, None]) -> asyncio.Task[None]:
    task = asyncio.ensure_future(work)
    _running.add(task)
    task.add_done_callback(_running.discard)
    return task
