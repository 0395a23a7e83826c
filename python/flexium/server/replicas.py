"""Several server processes (replicas) on one PostgreSQL database, behind a load balancer, act as
one service: each keeps its own ``ServerContext``, and what one changes there that the others keep
too travels through the replica link (``replica_link.py``: PostgreSQL's LISTEN/NOTIFY, no broker).
A replica tells (``ServerContext``'s methods and ``Notifier.forward``) and this module applies what
it hears, through the ``*_here`` methods, which tell no one.

The database stays the source of truth: a message only spares a replica a wait or a read. What a
replica could not hear (its link was down) it reads again when the link is back (``reread``);
dashboards it serves get a ``resync`` then, since the events of that time are lost to them.
SQLite takes one server (``sole_server.py``) and has no link."""

from __future__ import annotations

import asyncio
import functools
import itertools
import logging
import time
from collections.abc import Callable, Hashable
from typing import TYPE_CHECKING, Any

from flexium import protocol, wire
from flexium.server import drains, queue, services, storage
from flexium.server.context import ServerContext
from flexium.server.storage import ProcessSnapshot
from flexium.server.storage.processes import Progress

if TYPE_CHECKING:
    from flexium.server.replica_link import Message

log = logging.getLogger("flexium.server")

LISTEN_FIRST_S = 10.0
# A token revoked this long before this replica started may still have been in a cache it filled.
REVOKED_CLOCK_SKEW_S = 60.0


async def start_link(ctx: ServerContext) -> None:
    """The link to the other replicas, started; every wake-up and event here is told to them from
    now on. Waits (``LISTEN_FIRST_S`` at most) until it listens and has read what it keeps of the
    others' (``reread``): a replica that serves before it hears the others would hand a command created
    on one of them to its polls only at its sweep, and one that serves before that read ends would see
    what it did meanwhile undone by it (a GPU report written, then forgotten)."""
    from flexium.server.replica_link import ReplicaLink  # psycopg: imported by PostgreSQL's servers only

    loop = asyncio.get_running_loop()
    connects = itertools.count()  # the first: no dashboard was served before it, none missed an event
    first_read: asyncio.Future[None] = loop.create_future()

    def on_reconnect() -> None:
        first = next(connects) == 0
        reading = ctx.spawn(reread(ctx, dashboards=not first))
        if first:
            reading.add_done_callback(read_first)

    def read_first(_reading: asyncio.Task[None]) -> None:
        if not first_read.done():
            first_read.set_result(None)

    link = ReplicaLink(ctx.db.url, loop=loop, on_message=functools.partial(take, ctx), on_reconnect=on_reconnect)
    ctx.link = link
    ctx.notifier.forward = lambda key: link.send({"kind": "wake", "key": list(_tuple(key))})
    link.start()
    started = time.monotonic()
    if not await asyncio.to_thread(link.listening.wait, LISTEN_FIRST_S):
        log.warning("replica link: not listening %g s after start; serving, and listening when it can", LISTEN_FIRST_S)
        return
    try:
        await asyncio.wait_for(asyncio.shield(first_read), max(0.0, LISTEN_FIRST_S - (time.monotonic() - started)))
    except asyncio.TimeoutError:
        log.warning(
            "replica link: still reading what it keeps of the others' %g s after start; serving", LISTEN_FIRST_S
        )


def stop_link(ctx: ServerContext) -> None:
    link, ctx.link = ctx.link, None
    ctx.notifier.forward = None
    if link is not None:
        link.stop()


def _tuple(key: Hashable) -> tuple[Any, ...]:
    assert isinstance(key, tuple), f"a notifier key travels as a tuple, not {key!r}"
    return key


def take(ctx: ServerContext, message: Message) -> None:
    """Applies what another replica told (on the event loop)."""
    apply = _APPLY.get(message.get("kind", ""))
    if apply is None:  # a newer replica's, during a rolling upgrade: the sweep finds what it said
        log.debug("replica link: a message of unknown kind %r, ignored", message.get("kind"))
        return
    apply(ctx, message)


def _wake(ctx: ServerContext, m: Message) -> None:
    ctx.notifier.wake(tuple(m["key"]))


def _event(ctx: ServerContext, m: Message) -> None:
    ctx.bus.publish_payload(m["workspace"], m["event"], m["payload"])


def _resync(ctx: ServerContext, m: Message) -> None:
    ctx.bus.publish(m["workspace"], protocol.EVENT_RESYNC, {})


def _revoked(ctx: ServerContext, m: Message) -> None:
    ctx.tokens_ended_here(frozenset(m["tokens"]))
    if m.get("workspace") is not None:  # the command line's: no server has told the dashboards
        ctx.spawn(services.tell_registered_by(ctx, m["workspace"], m["tokens"]))


def _session_ended(ctx: ServerContext, m: Message) -> None:
    ctx.bus.end_streams(session_id=m["session"])


def _snapshot(ctx: ServerContext, m: Message) -> None:
    said = m["snapshot"]
    snapshot = None if said is None else ProcessSnapshot(**{**said, "progress": Progress(**said["progress"])})
    ctx.process_seen_here(m["workspace"], m["process"], snapshot)


def _devices(ctx: ServerContext, m: Message) -> None:
    room = None if m["room"] is None else tuple(tuple(gpu) for gpu in m["room"])
    ctx.devices_written_here(m["workspace"], m["host"], time.time(), room)


def _devices_due(ctx: ServerContext, m: Message) -> None:
    ctx.devices_due_here(m["workspace"], m["host"])


def _forget(ctx: ServerContext, m: Message) -> None:
    ctx.forget_process_here(m["workspace"], m["process"])


def _pending(ctx: ServerContext, m: Message) -> None:
    ctx.pending[(m["workspace"], m["process"])] = m["command"]


def _settled(ctx: ServerContext, m: Message) -> None:
    ctx.command_settled_here(m["workspace"], m["process"], m["command"])


def _waits(ctx: ServerContext, m: Message) -> None:
    watches = {(ws, pid): wire.RoomWatch.model_validate(watch) for ws, pid, watch in m["watches"]}
    workspace_id, host = m["host"]
    ctx.jobs_wait_here(watches, (workspace_id, host))


def _queue_changed(ctx: ServerContext, _m: Message) -> None:
    queue.refresh_soon(ctx)


def _waits_ended(ctx: ServerContext, m: Message) -> None:
    ctx.waits_ended_here(set(m["waits"]))


def _drain(ctx: ServerContext, m: Message) -> None:
    ctx.drain_hosts.add((m["workspace"], m["host"]))


_APPLY: dict[str, Callable[[ServerContext, Message], None]] = {
    "wake": _wake,
    "event": _event,
    "resync": _resync,
    "revoked": _revoked,
    "session_ended": _session_ended,
    "snapshot": _snapshot,
    "devices": _devices,
    "devices_due": _devices_due,
    "forget": _forget,
    "pending": _pending,
    "settled": _settled,
    "waits": _waits,
    "queue_changed": _queue_changed,
    "waits_ended": _waits_ended,
    "drain": _drain,
}


async def reread(ctx: ServerContext, *, dashboards: bool) -> None:
    """The link (re)connected: what this replica keeps from the others' messages, read again from
    the database, since what was sent while it did not listen is lost. Tokens revoked since it
    started end here; the token cache is emptied (read again at the next request); heartbeat views,
    pending commands, the queue's view and the live drains are read again; GPU reports are written
    at their next arrival; dashboards get a ``resync`` (``dashboards``: at a reconnect, not at the
    first connection, made before the replica served)."""
    try:
        revoked = await ctx.db.call(storage.revoked_since, write=False, since=ctx.started_at - REVOKED_CLOCK_SKEW_S)
        ctx.tokens.clear()
        ctx.tokens_ended_here(frozenset(revoked) - ctx.ended_tokens)
        for ws, process_id, snapshot in await ctx.db.call(storage.load_snapshots, write=False):
            ctx.process_seen_here(ws, process_id, snapshot)
        await ctx.reconcile_pending()
        ctx.device_writes.clear()
        ctx.device_rooms.clear()
        await queue.refresh(ctx)
        await drains.refresh(ctx)
    except Exception:  # the sweep reads most of it again; the next reconnect retries the rest
        log.exception("replica link: reading again what the link may have missed failed")
    for workspace_id in ctx.bus.workspaces if dashboards else ():
        ctx.bus.publish(workspace_id, protocol.EVENT_RESYNC, {})
    log.info("replica link: listening; what it may have missed read again")
