"""Messages between the server processes (replicas) on one PostgreSQL database, through
PostgreSQL's own ``LISTEN``/``NOTIFY``: no broker to run, and a message sent after a commit
reaches every replica connected then within a millisecond or two on a local network.

The database stays the source of truth. A message only says "look again now" sooner than a
replica would on its own (a long-poll's wake-up, a live event for the dashboards, a token
revoked); a message lost (a replica reconnecting, a payload that does not fit) only delays what
the periodic sweep then finds, and ``on_reconnect`` tells the owner to re-read what it keeps.

One thread listens on a connection of its own and hands each message to the event loop; one
thread sends, batching what was queued while it sent the last batch into as few ``NOTIFY``
payloads as fit PostgreSQL's 8000-byte limit (thousands of heartbeats a second must not be
thousands of round trips). A replica skips its own messages, but for hearing them back when its
sender asked (``send_heard``). Delivered to a listener's socket is not yet applied by its replica:
a replica that applied a message its sender waits for says so (``applied``, to that sender), and
the sender waits for every replica that listened when it sent (their listen connections, named in
``pg_stat_activity``), so a revocation that returned is in force on every replica."""

from __future__ import annotations

import asyncio
import itertools
import json
import logging
import queue
import threading
import time
import uuid
from collections.abc import Callable
from typing import Any

import psycopg
from sqlalchemy.engine import make_url

log = logging.getLogger("flexium.server")

CHANNEL = "flexium_replicas"
# PostgreSQL refuses a NOTIFY payload of 8000 bytes or more; room is left for the envelope.
MAX_PAYLOAD_BYTES = 7900
RECONNECT_S = (0.1, 0.5, 1.0, 2.0)  # the waits between tries to reconnect, the last repeated
LISTEN_TICK_S = 0.5  # how often the listener looks whether it should stop
ECHO = "echo"  # the key of a message whose sender waits to hear it back (``send_heard``)
APPLIED = "applied"  # a replica's word to a sender that it applied the message of that echo

Message = dict[str, Any]


def conninfo(database_url: str) -> str:
    """The libpq connection string of the server's SQLAlchemy URL (``postgresql+psycopg://``)."""
    return make_url(database_url).set(drivername="postgresql").render_as_string(hide_password=False)


# The listen connection's role in its name: it also says the replica answers ``applied``, so that a sender
# waits only for those that do (a replica of a version before them, met in a rolling upgrade, listens as
# "listen" and is not waited for: it would never answer, and each revocation would wait its whole timeout).
LISTEN = "listen (answers applied)"
SEND = "send"


def connection_name(replica_id: str, role: str) -> str:
    """A replica's connection as pg_stat_activity names it; ``role``: LISTEN or SEND."""
    return f"flexium replica {replica_id} {role}"


def listening_replicas(conn: psycopg.Connection[Any]) -> set[str]:
    """The ids of the replicas listening on this database now that answer ``applied``."""
    prefix, suffix = connection_name("\0", LISTEN).split("\0")
    rows = conn.execute(
        "SELECT application_name FROM pg_stat_activity WHERE datname = current_database() AND application_name LIKE %s",
        (f"{prefix}%{suffix}",),
    ).fetchall()
    return {name[len(prefix) : len(name) - len(suffix)] for (name,) in rows}


def applied_by(payload: str, sender: str) -> set[str]:
    """The replicas whose ``payload`` says they applied a message of ``sender``'s."""
    try:
        by, messages = json.loads(payload)
    except ValueError:
        return set()
    return {by for m in messages if m.get("kind") == APPLIED and m.get("to") == sender}


def tell_replicas(database_url: str, sender: str, message: Message, timeout: float = 1.0) -> bool:
    """One message to every replica listening, from outside them (the command line's revocations);
    returns once every replica listening when it was sent has applied it, or False after
    ``timeout``."""
    sender = f"{sender} {uuid.uuid4().hex[:12]}"  # the replicas' answers are addressed to this call
    payload = f'["{sender}",[{json.dumps({**message, ECHO: 1}, separators=(",", ":"))}]]'
    with psycopg.connect(conninfo(database_url), autocommit=True, connect_timeout=5) as conn:
        conn.execute(f"LISTEN {CHANNEL}")
        waiting = listening_replicas(conn)
        conn.execute("SELECT pg_notify(%s, %s)", (CHANNEL, payload))
        deadline = time.monotonic() + timeout
        while waiting and (left := deadline - time.monotonic()) > 0:
            for note in conn.notifies(timeout=left, stop_after=1):
                waiting -= applied_by(note.payload, sender)
    return not waiting


class ReplicaLink:
    """This replica's end: ``send`` from any thread; ``on_message`` and ``on_reconnect`` are
    called on ``loop``."""

    def __init__(
        self,
        database_url: str,
        *,
        loop: asyncio.AbstractEventLoop,
        on_message: Callable[[Message], None],
        on_reconnect: Callable[[], None],
    ) -> None:
        self.replica_id = uuid.uuid4().hex[:12]
        self._conninfo = conninfo(database_url)
        self._loop = loop
        self._on_message = on_message
        self._on_reconnect = on_reconnect
        self._outbox: queue.SimpleQueue[Message | None] = queue.SimpleQueue()
        self._stopping = threading.Event()
        self.listening = threading.Event()  # set while the listener is connected
        self.sent = 0
        self.received = 0
        self.dropped = 0  # messages too large for one payload: the sweep finds what they said
        self._echoes = itertools.count(1)
        self._awaited: dict[int, _Awaited] = {}  # echo number -> its sender's wait (on loop)
        self._threads = [
            threading.Thread(target=self._listen, name="flexium-replica-listen", daemon=True),
            threading.Thread(target=self._send_forever, name="flexium-replica-send", daemon=True),
        ]

    def start(self) -> None:
        for thread in self._threads:
            thread.start()

    def stop(self, timeout: float = 2.0) -> None:
        self._stopping.set()
        self._outbox.put(None)
        for thread in self._threads:
            thread.join(timeout)

    def send(self, message: Message) -> None:
        self._outbox.put(message)

    def fits(self, message: Message) -> bool:
        """Whether ``message`` fits one payload (one that does not is dropped)."""
        return len(self._payload([json.dumps(message, separators=(",", ":"))]).encode()) <= MAX_PAYLOAD_BYTES

    async def send_heard(self, message: Message, timeout: float) -> bool:
        """Sends ``message`` and waits (on ``loop``) until this replica hears it back and every other
        replica listening when it was sent has applied it; False when that took longer than
        ``timeout`` (the link is down: the others re-read at their reconnect)."""
        deadline = time.monotonic() + timeout
        try:
            others = await asyncio.wait_for(asyncio.to_thread(self._other_listeners), timeout)
        except (psycopg.Error, asyncio.TimeoutError):
            others = set()  # unknown: hearing it back says it was delivered, as before
        echo = next(self._echoes)
        awaited = _Awaited(others, self._loop.create_future())
        self._awaited[echo] = awaited
        self.send({**message, ECHO: echo})
        try:
            await asyncio.wait_for(awaited.done, max(0.0, deadline - time.monotonic()))
            return True
        except asyncio.TimeoutError:
            return False
        finally:
            self._awaited.pop(echo, None)

    def _other_listeners(self) -> set[str]:
        with psycopg.connect(self._conninfo, autocommit=True, connect_timeout=5) as conn:
            return listening_replicas(conn) - {self.replica_id}

    def _connect(self, role: str) -> psycopg.Connection[Any]:
        """Named in pg_stat_activity, so an operator sees each replica's two connections."""
        return psycopg.connect(
            self._conninfo, autocommit=True, connect_timeout=5, application_name=self.connection_name(role)
        )

    def connection_name(self, role: str) -> str:
        """``role``: LISTEN or SEND."""
        return connection_name(self.replica_id, role)

    # --- listening ----------------------------------------------------------------------------

    def _listen(self) -> None:
        tries = 0
        while not self._stopping.is_set():
            try:
                with self._connect(LISTEN) as conn:
                    conn.execute(f"LISTEN {CHANNEL}")
                    self.listening.set()
                    if tries:
                        log.info("replica link: listening again")
                    tries = 0
                    # What was sent while this replica did not listen is lost: its owner re-reads.
                    self._loop.call_soon_threadsafe(self._on_reconnect)
                    while not self._stopping.is_set():
                        for note in conn.notifies(timeout=LISTEN_TICK_S):
                            self._take(note.payload)
            except psycopg.Error as exc:
                self.listening.clear()
                if self._stopping.is_set():
                    return
                if tries == 0:
                    log.warning("replica link: lost the database (%s); reconnecting", str(exc).strip())
                time.sleep(RECONNECT_S[min(tries, len(RECONNECT_S) - 1)])
                tries += 1
        self.listening.clear()

    def _take(self, payload: str) -> None:
        try:
            sender, messages = json.loads(payload)
        except ValueError:
            log.warning("replica link: a payload that is not ours on %s, ignored", CHANNEL)
            return
        if sender == self.replica_id:
            for message in messages:
                if ECHO in message:
                    self._loop.call_soon_threadsafe(self._heard, message[ECHO], None)
            return
        for message in messages:
            if message.get("kind") == APPLIED:
                if message.get("to") == self.replica_id:
                    self._loop.call_soon_threadsafe(self._heard, message["echoed"], sender)
                continue
            self.received += 1
            self._loop.call_soon_threadsafe(self._deliver, sender, message)

    def _heard(self, echo: int, applied_by: str | None) -> None:
        """This replica heard its own message back (``applied_by`` None), or another applied it."""
        awaited = self._awaited.get(echo)
        if awaited is None:
            return
        if applied_by is None:
            awaited.heard = True
        else:
            awaited.waiting.discard(applied_by)
        if awaited.heard and not awaited.waiting and not awaited.done.done():
            awaited.done.set_result(None)

    def _deliver(self, sender: str, message: Message) -> None:
        try:
            self._on_message(message)
        except Exception:  # one bad message must not end the link
            log.exception("replica link: handling %r failed", message.get("kind"))
            return
        if ECHO in message:  # its sender waits until every replica applied it
            self.send({"kind": APPLIED, "to": sender, "echoed": message[ECHO]})

    # --- sending ------------------------------------------------------------------------------

    def _send_forever(self) -> None:
        conn: psycopg.Connection[Any] | None = None
        tries = 0
        while True:
            batch = self._take_batch()
            if batch is None:
                break
            payloads, count = self._payloads(batch)
            while payloads:
                try:
                    if conn is None or conn.closed:
                        conn = self._connect(SEND)
                    # Sent again whole after a failure: a message is a hint, hearing it twice is harmless.
                    for payload in payloads:
                        conn.execute("SELECT pg_notify(%s, %s)", (CHANNEL, payload))
                    self.sent += count
                    payloads = []
                    tries = 0
                except psycopg.Error as exc:
                    if conn is not None:
                        conn.close()
                    conn = None
                    if self._stopping.is_set():
                        return
                    if tries == 0:
                        log.warning("replica link: cannot send (%s); retrying", str(exc).strip())
                    time.sleep(RECONNECT_S[min(tries, len(RECONNECT_S) - 1)])
                    tries += 1
        if conn is not None:
            conn.close()

    def _take_batch(self) -> list[Message] | None:
        """The next message and every one queued behind it; None once stopped."""
        first = self._outbox.get()
        if first is None:
            return None
        batch = [first]
        while True:
            try:
                more = self._outbox.get_nowait()
            except queue.Empty:
                return batch
            if more is None:
                self._outbox.put(None)  # seen again by the next take, after this batch is sent
                return batch
            batch.append(more)

    def _payloads(self, batch: list[Message]) -> tuple[list[str], int]:
        """``batch`` as few payloads as fit, each ``[replica id, [message, ...]]``, and how many
        messages they carry; a message that does not fit alone is dropped (counted)."""
        payloads: list[str] = []
        envelope = len(self._payload([]).encode())
        current: list[str] = []
        size = envelope
        kept = 0
        for message in batch:
            text = json.dumps(message, separators=(",", ":"))
            length = len(text.encode()) + 1
            if envelope + length > MAX_PAYLOAD_BYTES:
                self.dropped += 1
                continue
            if current and size + length > MAX_PAYLOAD_BYTES:
                payloads.append(self._payload(current))
                current, size = [], envelope
            current.append(text)
            size += length
            kept += 1
        if current:
            payloads.append(self._payload(current))
        return payloads, kept

    def _payload(self, texts: list[str]) -> str:
        return f'["{self.replica_id}",[{",".join(texts)}]]'


class _Awaited:
    """A ``send_heard`` waiting: for its own message back and for the others' ``applied``."""

    def __init__(self, waiting: set[str], done: asyncio.Future[None]) -> None:
        self.heard = False
        self.waiting = waiting
        self.done = done
