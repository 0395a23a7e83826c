"""The long-polls: a process's next command (``next_command``) and the command line's waits for a
command or a job operation to end (``wait_command``, ``wait_operation``). Each registers its wake-up
(``ServerContext.notifier``, woken on every replica) before it reads the database, so what commits
between the read and the wait still wakes it; a revoked token's wait ends at once."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Awaitable, Callable, Hashable, MutableMapping
from typing import Any

from flexium import protocol, wire
from flexium.server import announce, live, queue, storage
from flexium.server.context import ServerContext
from flexium.server.errors import Unauthorized
from flexium.server.storage import AuthInfo


def revocation_waiter(ctx: ServerContext, auth: AuthInfo) -> asyncio.Future[None]:
    """Done when ``auth``'s token is revoked (``ServerContext.tokens_revoked``, on any replica), or
    was since the request was admitted; unregister it with the key ("token", id)."""
    revoked = ctx.notifier.register(("token", auth.token_id))
    if auth.token_id in ctx.ended_tokens and not revoked.done():
        revoked.set_result(None)
    return revoked


async def _wait(
    ctx: ServerContext,
    waiter: asyncio.Future[None],
    revoked: asyncio.Future[None],
    timeout: float,
    *ends: asyncio.Future[None],
) -> bool:
    """True when woken, False on timeout or when one of ``ends`` is done (the client went away,
    the process has news to fetch); Unauthorized when the caller's token was revoked meanwhile: a
    revoked token's poll ends at once."""
    done, _pending = await asyncio.wait(
        {waiter, revoked, *ends}, timeout=max(0.0, timeout), return_when=asyncio.FIRST_COMPLETED
    )
    if revoked in done and not ctx.stopping:  # stopping wakes every waiter, this one too
        raise Unauthorized("token revoked or expired", error="invalid_token")
    return bool(done) and not any(end in done for end in ends)


async def next_command(
    ctx: ServerContext,
    *,
    auth: AuthInfo,
    process_id: str,
    wait: float | None,
    receive: Callable[[], Awaitable[MutableMapping[str, Any]]] | None = None,
    received_at: float | None = None,
) -> wire.CommandInfo | None:
    """The long-poll: the next command for the process, or None when there is none within
    the wait (or the server is stopping). The wait counts from the request's arrival
    (``received_at``, ``time.monotonic()``): a server that is behind answers an empty poll when its
    client stops waiting, not a wait later. A poll whose client went away (``receive`` says so: it
    gave up on a late answer) hands nothing out, and a delivery made as it went is undone, so the
    command goes to the process's next poll instead of to a closed connection. A wait created for
    the process ends its poll empty at once (``queue.watch_news``): the process then heartbeats, and the
    answer says what to watch, at once rather than a heartbeat interval later."""
    workspace_id = auth.workspace_id
    key = (workspace_id, process_id)
    loop = asyncio.get_running_loop()
    late = 0.0 if received_at is None else max(0.0, time.monotonic() - received_at)
    deadline = loop.time() + (ctx.settings.poll_timeout_s if wait is None else wait) - late
    revoked = revocation_waiter(ctx, auth)
    news = ctx.notifier.register(queue.watch_news(workspace_id, process_id))
    gone = None if receive is None else live.client_gone(receive)
    try:
        return await _next_command(ctx, key, deadline, revoked, news, gone)
    finally:
        ctx.notifier.unregister(("token", auth.token_id), revoked)
        ctx.notifier.unregister(queue.watch_news(workspace_id, process_id), news)
        if gone is not None:
            gone.cancel()


async def _next_command(
    ctx: ServerContext,
    key: tuple[int, str],
    deadline: float,
    revoked: asyncio.Future[None],
    news: asyncio.Future[None],
    gone: asyncio.Future[None] | None,
) -> wire.CommandInfo | None:
    workspace_id, process_id = key
    loop = asyncio.get_running_loop()
    woken = False
    while True:
        waiter = ctx.notifier.register(key)
        try:
            # Most polls find nothing; the in-memory view of pending commands (exact: every
            # command is created and settled in this process or told by the replica that did,
            # and the sweep re-reads the database) spares them any database work.
            if ctx.stopping or news.done() or (gone is not None and gone.done()):
                return None
            # Woken for a process forgotten meanwhile (DELETE): the read below answers 404 at once.
            pending = (woken and key in ctx.process_hosts) or key in ctx.pending
            if not pending and key not in ctx.process_hosts:
                host, command_id = await ctx.db.call(
                    storage.peek_command, write=False, workspace_id=workspace_id, process_id=process_id
                )
                ctx.process_hosts[key] = host
                pending = command_id is not None
            if pending:
                command, first = await ctx.db.call(
                    storage.next_command, write=True, workspace_id=workspace_id, process_id=process_id, now=time.time()
                )
                if command is not None and gone is not None and gone.done():
                    await ctx.db.call(storage.undo_delivery, write=True, command=command)
                    return None
                if command is not None:
                    ctx.command_pending(workspace_id, process_id, command.id)
                    if first:
                        ctx.metrics.delivery_latency.observe(
                            max(0.0, (command.delivered_at or command.created_at) - command.created_at)
                        )
                        ctx.publish(workspace_id, protocol.EVENT_COMMAND, {"action": "updated", "command": command})
                    return command
                ctx.command_pending(workspace_id, process_id, None)
            remaining = deadline - loop.time()
            ends = (news,) if gone is None else (news, gone)
            if ctx.stopping or remaining <= 0 or not await _wait(ctx, waiter, revoked, remaining, *ends):
                return None
            woken = True
        finally:
            ctx.notifier.unregister(key, waiter)


async def wait_command(ctx: ServerContext, *, auth: AuthInfo, command_id: int, wait: float | None) -> wire.CommandInfo:
    """The command, once it ends or after ``wait`` seconds, whichever comes first."""
    command: wire.CommandInfo = await _wait_until(
        ctx,
        auth,
        announce.command_news(auth.workspace_id, command_id),
        wait,
        lambda: ctx.db.call(storage.get_command, write=False, workspace_id=auth.workspace_id, command_id=command_id),
        lambda command: command.state in protocol.FINAL_COMMAND_STATES,
    )
    return command


async def wait_operation(
    ctx: ServerContext, *, auth: AuthInfo, operation_id: int, wait: float | None
) -> wire.JobOperationInfo:
    """The job operation, once every rank's command ended or after ``wait`` seconds."""
    operation: wire.JobOperationInfo = await _wait_until(
        ctx,
        auth,
        announce.operation_news(auth.workspace_id, operation_id),
        wait,
        lambda: ctx.db.call(
            storage.get_operation, write=False, workspace_id=auth.workspace_id, operation_id=operation_id
        ),
        lambda operation: operation.finished_at is not None,
    )
    return operation


async def _wait_until(
    ctx: ServerContext,
    auth: AuthInfo,
    key: Hashable,
    wait: float | None,
    read: Callable[[], Awaitable[Any]],
    ended: Callable[[Any], bool],
) -> Any:
    """``read()`` once ``ended`` says so, or after ``wait`` seconds (woken by ``key``)."""
    loop = asyncio.get_running_loop()
    deadline = loop.time() + (wait or 0.0)
    revoked = revocation_waiter(ctx, auth)
    try:
        while True:
            waiter = ctx.notifier.register(key)
            try:
                value = await read()
                remaining = deadline - loop.time()
                if ended(value) or ctx.stopping or remaining <= 0 or not await _wait(ctx, waiter, revoked, remaining):
                    return value
            finally:
                ctx.notifier.unregister(key, waiter)
    finally:
        ctx.notifier.unregister(("token", auth.token_id), revoked)
