"""What a request does beside its storage call: the in-memory views the server keeps
(process hosts, heartbeat snapshots, pending commands, device write times), live events to
dashboards, wake-ups of long-polls and waits, and metrics. Each route calls one function
here (or one storage function through ``ctx.db.call`` when there is nothing beside it), so
routes stay HTTP in, one call, HTTP out. The long-polls (a process's next command, the command
line's waits for a command or a job operation) are in ``long_poll``."""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import AsyncIterator
from typing import Any

from flexium import protocol, wire
from flexium.server import announce, drains, placing, queue, storage
from flexium.server.context import ReportedProgress, ServerContext, progress_event
from flexium.server.db import DatabaseUnavailable
from flexium.server.errors import ApiError
from flexium.server.policies.migrate_auto import migrate_auto
from flexium.server.storage import AuthInfo

log = logging.getLogger("flexium.server")


# --- processes ------------------------------------------------------------------------------


async def register_process(
    ctx: ServerContext, *, auth: AuthInfo, body: wire.RegisterRequest
) -> tuple[wire.RegisterResponse, bool]:
    """(the answer, whether the process is new). The registering token owns a new process; a
    job token may register again only a process it owns."""
    settings = ctx.settings
    now = time.time()
    workspace_id = auth.workspace_id
    process, created, snapshot = await ctx.db.call(
        storage.register_process_snapshot,
        write=True,
        workspace_id=workspace_id,
        report=body,
        now=now,
        stale_after=settings.stale_after_s,
        token_id=auth.token_id,
        own_only=auth.role == protocol.ROLE_JOB,
    )
    if body.placement_id is not None:
        await placing.take_placement(ctx, auth=auth, placement_id=body.placement_id, process_id=body.process_id)
    ctx.process_seen(workspace_id, body.process_id, snapshot)
    ctx.publish(
        workspace_id, protocol.EVENT_PROCESS, {"action": "registered" if created else "updated", "process": process}
    )
    if body.devices:
        await queue.devices_stored(ctx, workspace_id, process.host, now)
    return wire.RegisterResponse(
        process=process,
        heartbeat_interval_s=settings.heartbeat_interval_s,
        poll_timeout_s=settings.poll_timeout_s,
        stale_after_s=settings.stale_after_s,
        server_time=now,
        watch=queue.watch_of(ctx, workspace_id, body.process_id),
    ), created


async def unregister_process(ctx: ServerContext, *, auth: AuthInfo, process_id: str) -> None:
    workspace_id = auth.workspace_id
    ended = await ctx.db.call(
        storage.unregister_process,
        write=True,
        workspace_id=workspace_id,
        process_id=process_id,
        now=time.time(),
        actor=auth,
    )
    for command in ended:  # what a person waiting for it learns
        announce.command_changed(ctx, workspace_id, command)
    host = ctx.process_hosts.get((workspace_id, process_id))
    ctx.forget_process(workspace_id, process_id)
    ctx.publish(workspace_id, protocol.EVENT_PROCESS, {"action": "removed", "process": {"process_id": process_id}})
    ctx.notifier.notify((workspace_id, process_id))
    await queue.room_changed(ctx, workspace_id, host)


def heartbeat_from_memory(
    ctx: ServerContext, *, workspace_id: int, process_id: str, body: wire.HeartbeatRequest, now: float
) -> wire.HeartbeatResponse | None:
    """The answer to a plain heartbeat (nothing changed but the time, no devices due for a
    write), from memory; None when it must go to the database (``heartbeat``): a job that saw
    room it waits for goes there at once, unless its host's last report stored showed that room."""
    if _devices_to_write(ctx, workspace_id, process_id, body, now) or (body.room_seen and not body.devices):
        return None
    if not ctx.beat(workspace_id, process_id, body, now):
        return None
    ctx.metrics.heartbeats.inc()
    return wire.HeartbeatResponse(
        ok=True,
        pending_command=ctx.pending.get((workspace_id, process_id)),
        heartbeat_interval_s=ctx.settings.heartbeat_interval_s,
        server_time=now,
        watch=queue.watch_of(ctx, workspace_id, process_id),
    )


async def heartbeat(
    ctx: ServerContext, *, workspace_id: int, process_id: str, body: wire.HeartbeatRequest, reporter: int
) -> wire.HeartbeatResponse:
    now = time.time()
    answer = heartbeat_from_memory(ctx, workspace_id=workspace_id, process_id=process_id, body=body, now=now)
    if answer is not None:
        return answer
    ctx.metrics.heartbeats.inc()
    write_devices = _devices_to_write(ctx, workspace_id, process_id, body, now)
    outcome = await ctx.db.call(
        storage.heartbeat,
        write=True,
        workspace_id=workspace_id,
        process_id=process_id,
        report=body,
        now=now,
        stale_after=ctx.settings.stale_after_s,
        write_devices=write_devices,
        reporter=reporter,
    )
    key = (workspace_id, process_id)
    ctx.process_seen(workspace_id, process_id, outcome.snapshot)
    ctx.command_pending(workspace_id, process_id, outcome.pending_command)
    if outcome.devices_written:  # an older beat's GPUs are not stored, nor do they delay the next write
        ctx.devices_written(workspace_id, outcome.host, now, room_shown(body.devices))
        ctx.publish(workspace_id, protocol.EVENT_DEVICES, {"host": outcome.host})
    if outcome.changed is not None:
        ctx.publish(workspace_id, protocol.EVENT_PROCESS, {"action": "updated", "process": outcome.changed})
    if body.steps is not None or body.loss is not None:
        reported = ReportedProgress(workspace_id, process_id, outcome.snapshot.progress)
        ctx.publish(workspace_id, protocol.EVENT_PROGRESS, progress_event([reported]))
    pending = outcome.pending_command
    if outcome.devices_written:
        await queue.room_changed(ctx, workspace_id, outcome.host)
        pending = ctx.pending.get(key, pending)  # its own resume, if the queue sent it now
    return wire.HeartbeatResponse(
        ok=True,
        pending_command=pending,
        heartbeat_interval_s=ctx.settings.heartbeat_interval_s,
        server_time=now,
        watch=queue.watch_of(ctx, workspace_id, process_id),
    )


def _devices_to_write(
    ctx: ServerContext, workspace_id: int, process_id: str, body: wire.HeartbeatRequest, now: float
) -> bool:
    """Whether the heartbeat's GPU report is stored: when one is due for its host, or at once when the
    job saw room it waits for, unless its host's last report stored showed the same room. The jobs
    of a host report the same GPUs, each waiting one the moment it sees room: one report is stored
    and one queue pass runs for them, not one each."""
    if not body.devices:
        return False
    if ctx.should_write_devices(workspace_id, process_id, now):
        return True
    return body.room_seen and not ctx.same_room(workspace_id, process_id, room_shown(body.devices))


def room_shown(devices: list[wire.GpuReport]) -> tuple[tuple[Any, ...], ...]:
    """What a GPU report says of room (each GPU's memory and health), in one order."""
    return tuple(sorted((gpu.uuid, gpu.memory_total, gpu.memory_used, gpu.health) for gpu in devices))


# --- commands -------------------------------------------------------------------------------


async def create_command(ctx: ServerContext, *, auth: AuthInfo, body: wire.CommandRequest) -> wire.CommandInfo:
    """The addressed process's command; for a rank of a job of several, every rank gets its
    share of the job operation (``command.job.operation_id``) at once. Created or refused, it
    goes to the audit log and to dashboards (a ``command`` or ``command_refused`` event)."""
    workspace_id = auth.workspace_id
    try:
        if body.kind == "migrate" and body.target == protocol.AUTO_TARGET:
            commands = await ctx.db.call(
                migrate_auto,
                write=True,
                workspace_id=workspace_id,
                actor=auth,
                process_id=body.process_id,
                now=time.time(),
                stale_after=ctx.settings.stale_after_s,
            )
        else:
            commands = await ctx.db.call(
                storage.create_commands_audited,
                write=True,
                workspace_id=workspace_id,
                actor=auth,
                kind=body.kind,
                process_id=body.process_id,
                target=body.target,
                ranks=body.ranks,
                gpus=body.gpus,
                now=time.time(),
                stale_after=ctx.settings.stale_after_s,
                reason=body.reason or None,
            )
    except ApiError as exc:
        ctx.metrics.commands_refused.labels(error=exc.code).inc()
        try:
            await ctx.db.call(
                storage.record_command_refused,
                write=True,
                workspace_id=workspace_id,
                actor=auth,
                request=body,
                reason=exc.message,
                now=time.time(),
            )
        except Exception:  # the caller is owed the refusal, not this
            log.exception("writing the audit entry of a refused command failed")
        ctx.publish(workspace_id, protocol.EVENT_COMMAND_REFUSED, {"request": body, "reason": exc.message})
        raise
    announce.commands_created(ctx, workspace_id, commands)
    if body.kind != "migrate" and ctx.watches:  # a person's pause or resume takes its job out of the queue
        await queue.refresh(ctx)
    return commands[0]


async def report_command(
    ctx: ServerContext, *, auth: AuthInfo, command_id: int, body: wire.CommandReport
) -> wire.CommandInfo:
    workspace_id = auth.workspace_id
    command, process, changed = await ctx.db.call(
        storage.report_command_audited,
        write=True,
        workspace_id=workspace_id,
        actor=auth,
        command_id=command_id,
        report=body,
        now=time.time(),
        stale_after=ctx.settings.stale_after_s,
    )
    if not changed:
        return command
    ctx.process_seen(workspace_id, command.process_id, None)
    announce.command_changed(ctx, workspace_id, command)
    if process is not None:
        ctx.publish(workspace_id, protocol.EVENT_PROCESS, {"action": "updated", "process": process})
    if command.state in protocol.FINAL_COMMAND_STATES:
        await queue.command_ended(ctx, workspace_id, command)
        await drains.command_ended(ctx, workspace_id, command)
        ctx.devices_due(workspace_id, command.process_id)
        took = command.took_s
        ctx.metrics.migration_duration.labels(kind=command.kind, outcome=command.state).observe(took or 0.0)
    return command


# --- housekeeping ---------------------------------------------------------------------------


async def sweep_forever(ctx: ServerContext) -> None:
    """Every ``sweep_interval_s``: write buffered heartbeats, re-check the pending view, and
    run ``storage.sweep``; then tell dashboards and waiters what it expired, failed, removed or
    found stale."""
    previous = time.time()
    while not ctx.stopping:
        await asyncio.sleep(ctx.settings.sweep_interval_s)
        now = time.time()
        try:
            await ctx.flush_beats()
            await ctx.reconcile_pending()
            result = await ctx.db.call(
                storage.sweep,
                write=True,
                now=now,
                alive_since=ctx.started_at,
                stale_after=ctx.settings.stale_after_s,
                remove_after=ctx.settings.remove_after_s,
                command_ttl=ctx.settings.command_ttl_s,
                stale_since=previous,
                reservation_ttl=ctx.settings.reservation_ttl_s,
            )
        except DatabaseUnavailable as exc:  # the health check says so too; no traceback to add
            log.warning("sweep failed, retrying at the next interval: %s", exc)
            continue
        except Exception:  # a database hiccup must not end housekeeping for good
            log.exception("sweep failed; retrying at the next interval")
            continue
        previous = now
        if result.expired or result.failed:
            try:
                await ctx.db.call(
                    storage.record_commands_finished, write=True, finished=[*result.expired, *result.failed], now=now
                )
            except Exception:
                log.exception("writing the audit entries of ended commands failed")
        for ws, cmd in [*result.expired, *result.failed]:
            announce.command_changed(ctx, ws, cmd)
        for ws, process_id in result.removed:
            ctx.forget_process(ws, process_id)
            ctx.publish(ws, protocol.EVENT_PROCESS, {"action": "removed", "process": {"process_id": process_id}})
        for ws, proc in result.newly_stale:  # every replica's sweep finds them
            ctx.publish_here(ws, protocol.EVENT_PROCESS, {"action": "stale", "process": proc})
        await end_what_ended_unheard(ctx, now)
        # The backstop: every waiting job judged again (what another server queued included).
        await queue.run(ctx)
        await queue.place(ctx)
        await queue.refresh(ctx)
        await drains.refresh(ctx)
        if ctx.drain_hosts:
            await drains.run(ctx)


# --- tokens, events -------------------------------------------------------------------------


async def revoke_token(ctx: ServerContext, *, auth: AuthInfo, token_id: int) -> wire.TokenRevoked:
    """Revokes the token and what it minted; their requests, event streams, long-polls and
    dashboard sessions end on this server at once. Dashboards are told at once which processes
    those tokens registered: they train on unheard, which their rows say."""
    info = await ctx.db.call(
        storage.revoke_token,
        write=True,
        workspace_id=auth.workspace_id,
        token_id=token_id,
        revoked_by=auth,
        now=time.time(),
    )
    await ctx.tokens_revoked(frozenset([info.id, *info.cascade]))
    if info.processes:
        for process in await _registered_by(ctx, auth.workspace_id, [info.id, *info.cascade]):
            ctx.publish(auth.workspace_id, protocol.EVENT_PROCESS, {"action": "updated", "process": process})
    return info


async def _registered_by(ctx: ServerContext, workspace_id: int, token_ids: list[int]) -> list[wire.ProcessInfo]:
    return await ctx.db.call(
        storage.list_processes,
        write=False,
        workspace_id=workspace_id,
        now=time.time(),
        stale_after=ctx.settings.stale_after_s,
        token_ids=token_ids,
    )


def watch_expiry(ctx: ServerContext, auth: AuthInfo) -> None:
    """An expiring token's streams and long-polls end when it expires, as a revoked one's do, and this
    server's dashboards are told which processes it registered. Every replica sees the clock (and keeps
    its own timer for each expiring token it has seen), so none is told."""
    if auth.expires_at is None or auth.token_id in ctx.expiry_timers or ctx.loop is None:
        return
    delay = max(0.0, auth.expires_at - time.time())
    ctx.expiry_timers[auth.token_id] = ctx.loop.call_later(delay, _expired, ctx, auth)


def _expired(ctx: ServerContext, auth: AuthInfo) -> None:
    ctx.tokens_ended_here(frozenset([auth.token_id]))
    ctx.spawn(tell_registered_by(ctx, auth.workspace_id, [auth.token_id]))


async def tell_registered_by(ctx: ServerContext, workspace_id: int, token_ids: list[int]) -> None:
    """This server's dashboards are told which processes these tokens, ended (revoked or expired) in a
    way every replica learns by itself, registered: their rows say so at once, not when they go STALE."""
    try:
        orphaned = await _registered_by(ctx, workspace_id, token_ids)
    except DatabaseUnavailable:  # they are told when the processes go STALE, which the sweep announces
        log.info("tokens %s ended: their processes are announced when they go STALE (database unavailable)", token_ids)
        return
    except Exception:
        log.exception("telling the dashboards which processes tokens %s registered failed", token_ids)
        return
    for process in orphaned:
        ctx.publish_here(workspace_id, protocol.EVENT_PROCESS, {"action": "updated", "process": process})


async def end_what_ended_unheard(ctx: ServerContext, now: float) -> None:
    """The event streams and long-polls held here by a token or a dashboard session that ended without
    this server being told (revoked, or its workspace deleted, by the command line on SQLite, which has
    no replica link; a session past its life; a message the link lost) end at the sweep after, and
    this server's dashboards are told which processes those tokens registered."""
    tokens, sessions = ctx.bus.openers
    tokens |= {t for t in ctx.notifier.waited("token") if isinstance(t, int)}
    tokens -= ctx.ended_tokens
    if not tokens and not sessions:
        return
    try:
        ended = await ctx.db.call(storage.ended_among, write=False, token_ids=tokens, session_ids=sessions, now=now)
    except Exception:  # the next sweep asks again
        log.exception("reading which tokens and sessions ended failed; asking again at the next sweep")
        return
    if ended.tokens:
        log.info(
            "tokens %s ended unheard (by the command line, or past their life): their streams and polls end",
            sorted(ended.tokens),
        )
        ctx.tokens_ended_here(frozenset(ended.tokens))
    for session_id in ended.sessions:
        ctx.bus.end_streams(session_id=session_id)
    for workspace_id, token_ids in ended.by_workspace.items():  # every replica's sweep finds them
        await tell_registered_by(ctx, workspace_id, token_ids)


async def log_out(ctx: ServerContext, *, secret: str) -> None:
    """Ends the dashboard session (its event streams too)."""
    auth = await ctx.db.call(storage.end_session, write=True, secret=secret, now=time.time())
    if auth is not None and auth.session_id is not None:
        ctx.session_ended(auth.session_id)


def open_event_stream(ctx: ServerContext, *, auth: AuthInfo, last_event_id: str | None) -> AsyncIterator[str]:
    """Subscribes now (so nothing published from here on is missed) and returns the
    server-sent event frames for the workspace from ``last_event_id`` on, with keepalives,
    and a resync when this subscriber fell behind."""
    resume_from = ctx.bus.resume_point(last_event_id) if last_event_id else None
    sub, backlog = ctx.bus.subscribe(
        auth.workspace_id, last_event_id=resume_from, token_id=auth.token_id, session_id=auth.session_id
    )
    if auth.token_id in ctx.ended_tokens:  # revoked between this request's admission and now
        sub.end()
    keepalive = ctx.settings.sse_keepalive_s
    hello = ctx.bus.frame(
        ctx.bus.last_id, protocol.EVENT_HELLO, {"workspace": auth.workspace, "last_event_id": ctx.bus.last_event_id}
    )

    async def stream() -> AsyncIterator[str]:
        try:
            yield "retry: 2000\n\n" + hello
            for text in backlog:
                yield text
            while not ctx.stopping and not sub.ended:
                if sub.overflowed:
                    sub.drop_queued()
                    yield ctx.bus.frame(ctx.bus.last_id, protocol.EVENT_RESYNC, {})
                    continue
                try:
                    frame: str | None = await sub.take(keepalive)
                except asyncio.TimeoutError:
                    yield ": keepalive\n\n"
                    continue
                if frame is None or sub.ended:
                    break
                yield frame
        finally:
            ctx.bus.unsubscribe(sub)

    return stream()
