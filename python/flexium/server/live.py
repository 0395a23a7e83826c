"""In-process wake-ups and live events. Both live on the event loop of the one server process;
the database stays the source of truth (a missed wake-up only delays, never loses: every
long-poll reads the database before it waits).

Notifier: a long-poll registers a waiter for its key *before* reading the database, so a
command committed between the read and the wait still wakes it.

EventBus: per-workspace fan-out to server-sent-event subscribers, with a numbered history for
``Last-Event-ID`` replay. A subscriber too slow to keep up is cut off with a ``resync``. An id
names the bus that gave it (``<tag>-<number>``, the tag random per process): replicas number the
same events each in its own order, and a restarted server has an empty history, so an id of
another replica, of a server before a restart or of no server gets a ``resync`` too, never a
replay of another numbering's events.

On PostgreSQL several server processes (replicas) serve one database: both forward what they
do to the others (``Notifier.forward``, ``ServerContext.publish``; ``server/replicas.py``).
"""

from __future__ import annotations

import asyncio
import collections
import itertools
import json
import secrets
from collections.abc import Awaitable, Callable, Hashable, MutableMapping
from dataclasses import dataclass
from typing import Any

from pydantic import BaseModel

from flexium import protocol


class Notifier:
    def __init__(self) -> None:
        self._waiters: dict[Hashable, set[asyncio.Future[None]]] = {}
        self.closed = False
        # The other replicas' notifiers, woken with this one's keys (set when there are replicas).
        self.forward: Callable[[Hashable], None] | None = None

    def register(self, key: Hashable) -> asyncio.Future[None]:
        fut: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        if self.closed:
            fut.set_result(None)
        self._waiters.setdefault(key, set()).add(fut)
        return fut

    def unregister(self, key: Hashable, fut: asyncio.Future[None]) -> None:
        waiters = self._waiters.get(key)
        if waiters is not None:
            waiters.discard(fut)
            if not waiters:
                del self._waiters[key]
        if not fut.done():
            fut.cancel()

    async def wait(self, fut: asyncio.Future[None], timeout: float) -> bool:
        """True when woken, False on timeout."""
        done, _pending = await asyncio.wait({fut}, timeout=max(0.0, timeout))
        return bool(done)

    def notify(self, key: Hashable) -> int:
        """Wakes the key's waiters here and on the other replicas; how many here."""
        if self.forward is not None:
            self.forward(key)
        return self.wake(key)

    def wake(self, key: Hashable) -> int:
        """Wakes the key's waiters in this process only (a replica's wake-up, forwarded)."""
        woken = 0
        for fut in self._waiters.get(key, ()):
            if not fut.done():
                fut.set_result(None)
                woken += 1
        return woken

    def close(self) -> None:
        """Wake every waiter (the server is stopping: polls answer now, clients come back)."""
        self.closed = True
        for waiters in self._waiters.values():
            for fut in waiters:
                if not fut.done():
                    fut.set_result(None)

    @property
    def waiting(self) -> int:
        return sum(len(w) for w in self._waiters.values())

    def waited(self, kind: str) -> set[Hashable]:
        """What the waits registered as ``(kind, x)`` wait on: each ``x``."""
        return {key[1] for key in self._waiters if isinstance(key, tuple) and len(key) == 2 and key[0] == kind}


def client_gone(receive: Callable[[], Awaitable[MutableMapping[str, Any]]]) -> asyncio.Task[None]:
    """Done when the client of a request whose body was read (or that has none) goes away: the
    connection closed, for a long-poll given up by its client. Cancel it once the answer is sent."""

    async def watch() -> None:
        while (await receive())["type"] != "http.disconnect":
            pass

    return asyncio.ensure_future(watch())


@dataclass(eq=False)  # identity, so it can live in a set
class Subscriber:
    """One open event stream's queue, bounded in events and in bytes: a client too slow for
    either is cut off with a resync instead of holding the server's memory."""

    workspace_id: int
    queue: asyncio.Queue[str | None]
    max_bytes: int = 4 << 20
    overflowed: bool = False
    queued_bytes: int = 0
    # Who opened it: revoking the token, or ending the dashboard session, ends the stream.
    token_id: int | None = None
    session_id: int | None = None
    ended: bool = False

    def end(self) -> None:
        """The stream ends at its next read, whatever is queued or dropped."""
        self.ended = True
        try:
            self.queue.put_nowait(None)
        except asyncio.QueueFull:
            pass  # the reader is behind, so it reads soon and sees ``ended``

    def offer(self, text: str | None) -> None:
        """Queues `text` (None: the stream ends), or marks the subscriber overflowed."""
        size = len(text) if text else 0
        if self.overflowed or self.queued_bytes + size > self.max_bytes:
            self.overflowed = True
            return
        try:
            self.queue.put_nowait(text)
        except asyncio.QueueFull:
            self.overflowed = True
            return
        self.queued_bytes += size

    async def take(self, timeout: float) -> str | None:
        """The next queued text; asyncio.TimeoutError after `timeout` seconds without one."""
        text = await asyncio.wait_for(self.queue.get(), timeout)
        self.queued_bytes -= len(text) if text else 0
        return text

    def drop_queued(self) -> None:
        """After an overflow: what is queued goes (the client reloads after the resync)."""
        while not self.queue.empty():
            self.queue.get_nowait()
        self.queued_bytes = 0
        self.overflowed = False


class EventBus:
    def __init__(
        self,
        *,
        history: int = 2000,
        history_bytes: int = 4 << 20,
        queue_size: int = 1000,
        queue_bytes: int = 4 << 20,
        first_id: int = 1,
    ) -> None:
        self.tag = secrets.token_hex(4)
        start = first_id - 1
        self._ids = itertools.count(first_id)
        self._subs: dict[int, set[Subscriber]] = {}
        # Per workspace: the last events, at most `history` of them and `history_bytes` of text
        # (a command's result rides in its event: a count alone let one client grow the server
        # by gigabytes).
        self._history: dict[int, collections.deque[tuple[int, str]]] = {}
        self._history_size: dict[int, int] = {}
        self._history_len = history
        self._history_bytes = history_bytes
        self._queue_size = queue_size
        self._queue_bytes = queue_bytes
        self.last_id = start
        self.closed = False

    @staticmethod
    def payload(data: Any) -> str:
        """An event's data as it is sent (and forwarded to the other replicas)."""
        return json.dumps(data, separators=(",", ":"), allow_nan=False, default=_jsonable)

    def event_id(self, number: int) -> str:
        return f"{self.tag}-{number}"

    @property
    def last_event_id(self) -> str:
        return self.event_id(self.last_id)

    def resume_point(self, event_id: str) -> int:
        """The number after which a stream resumes from ``event_id``, the Last-Event-ID a client
        sent: its number when this bus gave it; for any other text (another replica's id, a server's
        before a restart, not an id at all) one past the last, which ``subscribe`` answers with a
        ``resync``."""
        tag, _, number = event_id.partition("-")
        given = protocol.ascii_number(number) if tag == self.tag else None
        return self.last_id + 1 if given is None else given

    def frame(self, number: int, event: str, data: Any) -> str:
        return self.frame_of_payload(number, event, self.payload(data))

    def frame_of_payload(self, number: int, event: str, payload: str) -> str:
        return f"id: {self.event_id(number)}\nevent: {event}\ndata: {payload}\n\n"

    def publish(self, workspace_id: int, event: str, data: Any) -> None:
        self.publish_payload(workspace_id, event, self.payload(data))

    def publish_payload(self, workspace_id: int, event: str, payload: str) -> None:
        event_id = next(self._ids)
        self.last_id = event_id
        text = self.frame_of_payload(event_id, event, payload)
        self._remember(workspace_id, event_id, text)
        for sub in list(self._subs.get(workspace_id, ())):
            sub.offer(text)

    def _remember(self, workspace_id: int, event_id: int, text: str) -> None:
        history = self._history.setdefault(workspace_id, collections.deque())
        history.append((event_id, text))
        size = self._history_size.get(workspace_id, 0) + len(text)
        while history and (len(history) > self._history_len or size > self._history_bytes):
            size -= len(history.popleft()[1])
        self._history_size[workspace_id] = size

    def history_bytes(self, workspace_id: int) -> int:
        return self._history_size.get(workspace_id, 0)

    def subscribe(
        self,
        workspace_id: int,
        *,
        last_event_id: int | None = None,
        token_id: int | None = None,
        session_id: int | None = None,
    ) -> tuple[Subscriber, list[str]]:
        """A new subscriber and what it missed since ``last_event_id`` (a single ``resync``
        event when that is no longer in the history, or is not one of this bus's: larger than
        its last, see ``resume_point``)."""
        sub = Subscriber(
            workspace_id,
            asyncio.Queue(self._queue_size),
            max_bytes=self._queue_bytes,
            token_id=token_id,
            session_id=session_id,
        )
        self._subs.setdefault(workspace_id, set()).add(sub)
        backlog: list[str] = []
        if last_event_id is not None:
            history = self._history.get(workspace_id, ())
            oldest = history[0][0] if history else self.last_id + 1
            if last_event_id > self.last_id or (last_event_id < self.last_id and last_event_id + 1 < oldest):
                backlog.append(self.frame(self.last_id, protocol.EVENT_RESYNC, {}))
            else:
                backlog.extend(text for eid, text in history if eid > last_event_id)
        return sub, backlog

    def unsubscribe(self, sub: Subscriber) -> None:
        subs = self._subs.get(sub.workspace_id)
        if subs is not None:
            subs.discard(sub)
            if not subs:
                del self._subs[sub.workspace_id]

    def close(self) -> None:
        self.closed = True
        for subs in self._subs.values():
            for sub in subs:
                sub.offer(None)

    def end_streams(self, *, token_ids: frozenset[int] = frozenset(), session_id: int | None = None) -> int:
        """Ends the streams opened with these tokens (revoked) or this dashboard session
        (logged out); how many."""
        ended = 0
        for subs in self._subs.values():
            for sub in subs:
                if sub.token_id in token_ids or (session_id is not None and sub.session_id == session_id):
                    sub.end()
                    ended += 1
        return ended

    @property
    def workspaces(self) -> list[int]:
        """The workspaces with an open stream here."""
        return list(self._subs)

    @property
    def openers(self) -> tuple[set[int], set[int]]:
        """The tokens and the dashboard sessions that opened a stream here."""
        subs = [sub for subs in self._subs.values() for sub in subs if not sub.ended]
        tokens = {sub.token_id for sub in subs if sub.token_id is not None}
        return tokens, {sub.session_id for sub in subs if sub.session_id is not None}

    @property
    def subscribers(self) -> int:
        return sum(len(s) for s in self._subs.values())


def _jsonable(value: Any) -> Any:
    """Events carry the API's models (``flexium.wire``) as the API sends them."""
    if isinstance(value, BaseModel):
        return value.model_dump(mode="json")
    raise TypeError(f"{type(value).__name__} is not JSON serializable")
