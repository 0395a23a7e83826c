"""What one running server holds in memory, beside the database: settings, the database
handle, the notifier and event bus, metrics, the token cache, and the in-memory views that
spare the database most heartbeats and polls. Routes get it through ``get_context``; what a
request changes in it is done by ``flexium.server.services``.

On PostgreSQL several servers (replicas) share one database, each with its own context. What
one changes here that the others keep too is told to them through the replica link (``link``;
``server/replicas.py`` applies it there through the ``*_here`` methods); docs/design.md's table
says, field by field, what is told, what is re-read and what needs neither."""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import math
import time
from collections.abc import Callable, Coroutine, Iterable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Annotated, Any

from fastapi import Depends, Request

from flexium import protocol, wire
from flexium.server import storage
from flexium.server.db import Database, DatabaseUnavailable
from flexium.server.live import EventBus, Notifier
from flexium.server.metrics import Metrics
from flexium.server.refusals import RefusalBook
from flexium.server.settings import Settings
from flexium.server.storage import AuthInfo, ProcessSnapshot
from flexium.server.storage.processes import trained_between
from flexium.server.storage.staleness import silent

if TYPE_CHECKING:  # the link is PostgreSQL's alone: a server on SQLite never imports psycopg
    from flexium.server.replica_link import Message, ReplicaLink

# How long a revocation waits for the other replicas to have it before its request is answered.
REVOCATION_HEARD_S = 1.0
REVOKED_PER_MESSAGE = 500  # token ids in one notification (PostgreSQL's limit is 8000 bytes)
# A token's last use is written by each server at most this often: the tokens list says "in use" to
# within a minute without a write per request.
TOKEN_USE_WRITTEN_EVERY_S = 60.0

log = logging.getLogger("flexium.server")


def revocation_messages(token_ids: Iterable[int], *, announce_in: int | None = None) -> list[dict[str, Any]]:
    """What tells the replicas of revoked tokens: a long cascade, in notifications that fit.
    ``announce_in``: the workspace whose dashboards each replica tells which processes the tokens
    registered (a revocation by the command line, which no server announced)."""
    ids = sorted(token_ids)
    said: dict[str, Any] = {} if announce_in is None else {"workspace": announce_in}
    return [
        {"kind": "revoked", "tokens": ids[start : start + REVOKED_PER_MESSAGE], **said}
        for start in range(0, len(ids), REVOKED_PER_MESSAGE)
    ]


class TokenCache:
    """token hash -> auth. Only successes are cached. Past ``ttl`` an entry is looked up again, and the
    requests that need it wait for that one lookup (auth.resolve_token), but for a busy database's (past
    auth.LOOKUP_PATIENCE_S) or a failing one's: the entry is served then, up to ``max_stale`` more
    (thousands of jobs share a token: none of them should wait long for a database). So a token revoked by
    another process (the CLI on the same database) is refused from ``ttl`` seconds on, however seldom it is
    used; one revoked through this server at once."""

    def __init__(self, ttl: float, max_entries: int = 10000, max_stale: float = 60.0) -> None:
        self.ttl = ttl
        self.max_entries = max_entries
        self.max_stale = max_stale
        self._entries: dict[str, tuple[AuthInfo, float]] = {}
        self._failing: set[str] = set()  # whose last lookup failed (the database down)

    def get(self, token_hash: str, now: float) -> tuple[AuthInfo | None, bool]:
        """(auth or None, whether it needs a refresh)."""
        entry = self._entries.get(token_hash)
        if entry is None:
            return None, True
        auth, fetched = entry
        age = now - fetched
        if age > self.ttl + self.max_stale or auth.expired(now):
            return None, True
        return auth, age > self.ttl

    def lookup_failed(self, token_hash: str) -> None:
        self._failing.add(token_hash)

    def failing(self, token_hash: str) -> bool:
        return token_hash in self._failing

    def put(self, token_hash: str, auth: AuthInfo | None, now: float) -> None:
        self._failing.discard(token_hash)
        if auth is None:
            self._entries.pop(token_hash, None)
            return
        if len(self._entries) >= self.max_entries:
            self._entries.clear()
        self._entries[token_hash] = (auth, now)

    def clear(self) -> None:
        self._entries.clear()
        self._failing.clear()

    def forget(self, token_ids: frozenset[int]) -> None:
        for key in [k for k, (a, _t) in self._entries.items() if a.token_id in token_ids]:
            del self._entries[key]


@dataclass(frozen=True)
class ReportedProgress:
    """A process's training progress as its heartbeats reported it, with where it belongs."""

    workspace_id: int
    process_id: str
    progress: storage.Progress


def progress_event(reported: Iterable[ReportedProgress]) -> dict[str, Any]:
    """The data of a ``progress`` event (``protocol.EVENT_PROGRESS``), sent once it is stored:
    a job's page re-reads what it shows then."""
    return {"processes": [{"process_id": r.process_id, **dataclasses.asdict(r.progress)} for r in reported]}


@dataclass
class ServerContext:
    settings: Settings
    db: Database
    notifier: Notifier = field(default_factory=Notifier)
    bus: EventBus = field(default_factory=EventBus)
    metrics: Metrics = field(default_factory=Metrics)
    started_at: float = field(default_factory=time.time)
    tokens: TokenCache = field(init=False)
    process_hosts: dict[tuple[int, str], str] = field(default_factory=dict)
    # The token that registered each process known here, kept while its snapshot comes and goes:
    # the fair share's gate for the jobs' own requests (fair_share.py).
    process_owners: dict[tuple[int, str], int | None] = field(default_factory=dict)
    device_writes: dict[tuple[int, str], float] = field(default_factory=dict)
    device_rooms: dict[tuple[int, str], tuple[Any, ...]] = field(default_factory=dict)  # the room it stored
    # Plain heartbeats (nothing changed but the time) are answered from memory and written in
    # batches: at thousands of jobs they are most of the traffic, and one transaction each
    # would keep SQLite's single writer busy in front of the commands that matter.
    snapshots: dict[tuple[int, str], ProcessSnapshot] = field(default_factory=dict)
    beats: dict[int, float] = field(default_factory=dict)
    progress: dict[int, ReportedProgress] = field(default_factory=dict)  # process pk -> what they said of training
    # Hint for heartbeat answers only; delivery always reads the database.
    pending: dict[tuple[int, str], int] = field(default_factory=dict)
    # The queue as heartbeats answer it (what each waiting job watches) and the hosts whose GPU
    # reports it runs on: changed with each wait here, re-read at each sweep (another server's).
    watches: dict[tuple[int, str], wire.RoomWatch] = field(default_factory=dict)
    queue_hosts: set[tuple[int, str]] = field(default_factory=set)
    drain_hosts: set[tuple[int, str]] = field(default_factory=set)  # (workspace, host) with a live drain
    # The queue's passes over one host not started yet, each shared by every event that asks for it
    # meanwhile, and the queue's view read again at most every QUEUE_VIEW_EVERY_S (server/queue.py).
    queue_passes: dict[tuple[int, str], asyncio.Future[None]] = field(default_factory=dict)
    queue_view_read: asyncio.Future[None] | None = None
    queue_view_read_at: float = 0.0  # time.monotonic() of the last read's start
    # Each read of the queue's view under way, with the changes made to it here since the read began:
    # the read may have seen the database before them, so they are made again over what it found.
    queue_view_reads: list[list[Callable[[], None]]] = field(default_factory=list)
    token_lookups: dict[str, asyncio.Future[AuthInfo | None]] = field(default_factory=dict)
    # Since when the policies' passes have reached the database without a gap (its start, or the
    # end of an outage; math.inf during one): flexium run's silence counts from then (policy_pass.py).
    answering_since: float = field(default_factory=time.time)
    # Revoked through this server since it started, expired while it ran, or found ended by its sweep
    # (ids only: a few bytes each), for a request admitted just before its token's end and waiting just after it.
    ended_tokens: set[int] = field(default_factory=set)
    # token id -> when a request last came with it here, to be written (``flush_token_use``); and when
    # this server last wrote a use of it.
    token_use: dict[int, float] = field(default_factory=dict)
    token_use_written: dict[int, float] = field(default_factory=dict)
    # token id -> the timer that ends it at its expiry (services.watch_expiry), one per expiring token seen.
    expiry_timers: dict[int, asyncio.TimerHandle] = field(default_factory=dict)
    # What runs on the loop and nothing awaits (``spawn``; held here until done: the loop keeps weak references).
    loose_tasks: set[asyncio.Task[None]] = field(default_factory=set)
    refusals: RefusalBook = field(default_factory=RefusalBook)  # refused writes, on their way to the audit log
    stopping: bool = False
    loop: asyncio.AbstractEventLoop | None = None
    link: ReplicaLink | None = None  # the other replicas (PostgreSQL), from start-up to shutdown

    def __post_init__(self) -> None:
        self.tokens = TokenCache(self.settings.token_cache_s)
        self.bus = EventBus(
            history=self.settings.event_history,
            history_bytes=self.settings.event_history_bytes,
            queue_size=self.settings.sse_queue_size,
            queue_bytes=self.settings.sse_queue_bytes,
        )
        self.metrics.up_since.set(self.started_at)

    def begin_shutdown(self) -> None:
        """Answer every long-poll and end every event stream now, so a restart is quick and
        clients come back to the new server."""
        if self.stopping:
            return
        self.stopping = True
        self.notifier.close()
        self.bus.close()

    def _tell(self, message: Message) -> None:
        """Tells the other replicas (none on SQLite)."""
        if self.link is not None:
            self.link.send(message)

    async def tokens_revoked(self, token_ids: frozenset[int]) -> None:
        """Revoked through this server: no request is admitted with them from now on, here and on
        every replica (this returns once they have it, or after ``REVOCATION_HEARD_S`` when the link
        is down), and their event streams and waiting long-polls end now."""
        self.tokens_ended_here(token_ids)
        if self.link is None:
            return
        for message in revocation_messages(token_ids):
            await self.link.send_heard(message, REVOCATION_HEARD_S)

    def tokens_ended_here(self, token_ids: frozenset[int]) -> None:
        """Revoked, or expired: no request is admitted with them from now on, and their event streams
        and waiting long-polls end (``long_poll.revocation_waiter`` ends the long-polls)."""
        self.tokens.forget(token_ids)
        self.ended_tokens.update(token_ids)
        self.bus.end_streams(token_ids=token_ids)
        for token_id in token_ids:
            self.notifier.wake(("token", token_id))

    def spawn(self, work: Coroutine[Any, Any, None]) -> asyncio.Task[None]:
        """Runs ``work`` on the loop, held until done (the loop keeps a task only weakly); from the loop."""
        task = asyncio.ensure_future(work)
        self.loose_tasks.add(task)
        task.add_done_callback(self.loose_tasks.discard)
        return task

    def session_ended(self, session_id: int) -> None:
        """A dashboard session logged out: its event streams end, here and on every replica."""
        self.bus.end_streams(session_id=session_id)
        self._tell({"kind": "session_ended", "session": session_id})

    def publish(self, workspace_id: int, event: str, data: Any) -> None:
        """A live event for the workspace's dashboards, here and on every replica."""
        payload = self.bus.payload(data)
        self.bus.publish_payload(workspace_id, event, payload)
        if self.link is None:
            return
        message = {"kind": "event", "workspace": workspace_id, "event": event, "payload": payload}
        # Too large for a notification (a command's long result): the others' dashboards reload.
        self._tell(message if self.link.fits(message) else {"kind": "resync", "workspace": workspace_id})

    def publish_here(self, workspace_id: int, event: str, data: Any) -> None:
        """A live event every replica finds by itself (the sweep's), for this one's dashboards."""
        self.bus.publish(workspace_id, event, data)

    def process_seen(self, workspace_id: int, process_id: str, snapshot: ProcessSnapshot | None) -> None:
        """The process's row was written here: ``snapshot`` is what it stores now (None: not known
        without reading it). Every replica keeps it, so none answers a heartbeat from a view an
        other replica's write made stale."""
        self.process_seen_here(workspace_id, process_id, snapshot)
        self._tell(
            {
                "kind": "snapshot",
                "workspace": workspace_id,
                "process": process_id,
                "snapshot": None if snapshot is None else dataclasses.asdict(snapshot),
            }
        )

    def process_seen_here(self, workspace_id: int, process_id: str, snapshot: ProcessSnapshot | None) -> None:
        key = (workspace_id, process_id)
        if snapshot is None:
            self.snapshots.pop(key, None)
        else:
            self.snapshots[key] = snapshot
            self.process_hosts[key] = snapshot.host
            self.process_owners[key] = snapshot.token_id

    def should_write_devices(self, workspace_id: int, process_id: str, now: float) -> bool:
        host = self.process_hosts.get((workspace_id, process_id))
        if host is None:
            return True
        return now - self.device_writes.get((workspace_id, host), 0.0) >= self.settings.device_write_interval_s

    def devices_written(self, workspace_id: int, host: str, now: float, room: tuple[Any, ...] | None = None) -> None:
        """``room``: the room that report showed (``services.room_shown``), when known. Every
        replica counts the write, so a host's report is stored once per interval, not once per
        replica, and none skips a report on the word of a room another's write replaced."""
        self.devices_written_here(workspace_id, host, now, room)
        self._tell({"kind": "devices", "workspace": workspace_id, "host": host, "room": room})

    def devices_written_here(
        self, workspace_id: int, host: str, now: float, room: tuple[Any, ...] | None = None
    ) -> None:
        self.device_writes[(workspace_id, host)] = now
        if room is None:
            self.device_rooms.pop((workspace_id, host), None)
        else:
            self.device_rooms[(workspace_id, host)] = room

    def same_room(self, workspace_id: int, process_id: str, room: tuple[Any, ...]) -> bool:
        """The process's host's last report stored showed this room, and nothing since made one due."""
        host = self.process_hosts.get((workspace_id, process_id))
        return host is not None and self.device_rooms.get((workspace_id, host)) == room

    def devices_due(self, workspace_id: int, process_id: str) -> None:
        """The next GPU report of the process's host is written whenever it comes: a command just
        ended there, and the job's heartbeat right after it shows where its memory went (the GPU
        cards would otherwise show the job on the GPU it left for up to device_write_interval_s)."""
        host = self.process_hosts.get((workspace_id, process_id))
        if host is not None:
            self.devices_due_here(workspace_id, host)
            self._tell({"kind": "devices_due", "workspace": workspace_id, "host": host})

    def devices_due_here(self, workspace_id: int, host: str) -> None:
        self.device_writes.pop((workspace_id, host), None)
        self.device_rooms.pop((workspace_id, host), None)

    def forget_process(self, workspace_id: int, process_id: str) -> None:
        """The process is gone (unregistered, or removed by this replica's sweep), on every replica."""
        self.forget_process_here(workspace_id, process_id)
        self._tell({"kind": "forget", "workspace": workspace_id, "process": process_id})

    def forget_process_here(self, workspace_id: int, process_id: str) -> None:
        self.process_hosts.pop((workspace_id, process_id), None)
        self.process_owners.pop((workspace_id, process_id), None)
        self.snapshots.pop((workspace_id, process_id), None)
        self.pending.pop((workspace_id, process_id), None)

        def change() -> None:
            self.watches.pop((workspace_id, process_id), None)

        self._queue_view_changed(change)

    def beat(self, workspace_id: int, process_id: str, report: wire.HeartbeatRequest, now: float) -> bool:
        """Take a heartbeat from memory when it changes nothing but the time (its devices, if
        any, are not due for a write); False means the caller must write it through (first
        beat, a change, or stale)."""
        key = (workspace_id, process_id)
        snap = self.snapshots.get(key)
        if (
            snap is None
            or silent(snap.last_seen, now=now, stale_after=self.settings.stale_after_s)
            or not snap.unchanged_by(report)
        ):
            return False
        progress = snap.progress
        if report.steps is not None or report.loss is not None:
            training = trained_between(snap.state, report.state)
            progress = progress.after(steps=report.steps, loss=report.loss, now=now, training=training)
            self.progress[snap.pk] = ReportedProgress(workspace_id, process_id, progress)
        self.snapshots[key] = dataclasses.replace(snap, last_seen=now, progress=progress)
        self.beats[snap.pk] = now
        return True

    async def flush_beats(self) -> None:
        """Write the buffered beats, then tell dashboards the progress they carried: one event
        per workspace for the whole batch, not one per beat."""
        if not self.beats and not self.progress:
            return
        beats, self.beats = self.beats, {}
        progress, self.progress = self.progress, {}
        try:
            await self.db.call(
                storage.record_beats,
                write=True,
                beats=beats,
                progress={pk: reported.progress for pk, reported in progress.items()},
            )
        except Exception:
            for pk, seen in beats.items():  # keep them for the next try
                self.beats[pk] = max(seen, self.beats.get(pk, 0.0))
            for pk, kept in progress.items():
                self.progress.setdefault(pk, kept)
            raise
        by_workspace: dict[int, list[ReportedProgress]] = {}
        for reported in progress.values():
            by_workspace.setdefault(reported.workspace_id, []).append(reported)
        for workspace_id, written in by_workspace.items():
            self.publish(workspace_id, protocol.EVENT_PROGRESS, progress_event(written))

    def token_used(self, token_id: int, now: float) -> None:
        """A request came with the token (or a dashboard session of it): its use is written at the next
        flush, unless this server wrote one within ``TOKEN_USE_WRITTEN_EVERY_S``."""
        if now - self.token_use_written.get(token_id, -math.inf) >= TOKEN_USE_WRITTEN_EVERY_S:
            self.token_use[token_id] = max(now, self.token_use.get(token_id, now))

    async def flush_token_use(self) -> None:
        if not self.token_use:
            return
        used, self.token_use = self.token_use, {}
        try:
            await self.db.call(storage.record_token_use, write=True, used=used)
        except Exception:
            for token_id, at in used.items():  # kept for the next try
                self.token_use[token_id] = max(at, self.token_use.get(token_id, at))
            raise
        self.token_use_written.update(used)

    async def flush_forever(self) -> None:
        while not self.stopping:
            await asyncio.sleep(self.settings.beat_flush_interval_s)
            for flush, what in ((self.flush_beats, "heartbeats"), (self.flush_token_use, "tokens' last use")):
                try:
                    await flush()
                except DatabaseUnavailable as exc:  # the health check says so too; no traceback to add
                    log.warning("writing %s failed, retrying: %s", what, exc)
                except Exception:
                    log.exception("writing %s failed; retrying", what)

    def command_pending(self, workspace_id: int, process_id: str, command_id: int | None) -> None:
        """A command newly pending is told to every replica (whichever takes the process's next
        poll hands it out); that none is, only here: a replica's stale entry costs its next poll
        one read, and a clear read before a new command's commit must not erase it elsewhere."""
        key = (workspace_id, process_id)
        if command_id is None:
            self.pending.pop(key, None)
        elif self.pending.get(key) != command_id:
            self.pending[key] = command_id
            self._tell({"kind": "pending", "workspace": workspace_id, "process": process_id, "command": command_id})

    async def reconcile_pending(self) -> None:
        """Add any queued/delivered command the in-memory view lacks (it never should) and wake
        its process; entries the database no longer has are dropped where they are used."""
        for ws, process_id, command_id in await self.db.call(storage.pending_commands, write=False):
            key = (ws, process_id)
            if key not in self.pending:
                self.pending[key] = command_id
                self.notifier.wake(key)  # every replica reconciles its own

    def command_settled(self, workspace_id: int, process_id: str, command_id: int) -> None:
        """The command ended, on every replica."""
        self.command_settled_here(workspace_id, process_id, command_id)
        self._tell({"kind": "settled", "workspace": workspace_id, "process": process_id, "command": command_id})

    def command_settled_here(self, workspace_id: int, process_id: str, command_id: int) -> None:
        key = (workspace_id, process_id)
        if self.pending.get(key) == command_id:
            del self.pending[key]

    def jobs_wait(self, watches: dict[tuple[int, str], wire.RoomWatch], host: tuple[int, str]) -> None:
        """Jobs queued on ``host`` watch these (``queue.create_wait``), on every replica: a job's
        heartbeat to any answers what it watches, and a GPU report of that host to any runs the
        queue's pass."""
        self.jobs_wait_here(watches, host)
        if self.link is None:
            return
        message = {
            "kind": "waits",
            "watches": [[ws, pid, watch.model_dump(mode="json")] for (ws, pid), watch in watches.items()],
            "host": list(host),
        }
        # A job of many ranks may not fit a notification: the others read the queue's view again.
        self._tell(message if self.link.fits(message) else {"kind": "queue_changed"})

    def jobs_wait_here(self, watches: dict[tuple[int, str], wire.RoomWatch], host: tuple[int, str]) -> None:
        def change() -> None:
            self.watches.update(watches)
            self.queue_hosts.add(host)

        self._queue_view_changed(change)

    def waits_ended(self, wait_ids: set[int]) -> None:
        """Their jobs watch no more (resumed or cancelled), on every replica."""
        self.waits_ended_here(wait_ids)
        self._tell({"kind": "waits_ended", "waits": sorted(wait_ids)})

    def waits_ended_here(self, wait_ids: set[int]) -> None:
        def change() -> None:
            self.watches = {key: watch for key, watch in self.watches.items() if watch.wait_id not in wait_ids}

        self._queue_view_changed(change)

    def _queue_view_changed(self, change: Callable[[], None]) -> None:
        """``change`` made to the queue's view now, and again over what each read under way finds."""
        change()
        for changes in self.queue_view_reads:
            changes.append(change)

    def drain_started(self, workspace_id: int, host: str) -> None:
        """A drain began on ``host``: every replica runs its pass when a command there ends."""
        self.drain_hosts.add((workspace_id, host))
        self._tell({"kind": "drain", "workspace": workspace_id, "host": host})


async def get_context(request: Request) -> ServerContext:
    """A coroutine: FastAPI runs a plain function dependency on a worker thread, a thread hand-off
    for every request that a server under load spent a twentieth of its time on."""
    ctx: ServerContext = request.app.state.ctx
    return ctx


Ctx = Annotated[ServerContext, Depends(get_context)]
