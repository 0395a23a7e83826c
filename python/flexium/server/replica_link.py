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
sender asked (``send_heard``: PostgreSQL delivers a notification to every listener at once, so a
replica that hears its own has had it delivered to the others too)."""

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

Message = dict[str, Any]


def conninfo(database_url: str) -> str:
    """The libpq connection string of the server's SQLAlchemy URL (``postgresql+psycopg://``)."""
    return make_url(database_url).set(drivername="postgresql").render_as_string(hide_password=False)


def tell_replicas(database_url: str, sender: str, message: Message, timeout: float = 1.0) -> bool:
    """One message to every replica listening, from outside them (the command line's revocations);
    returns once it is heard back (delivered to every listener, as ``send_heard``), or False after
    ``timeout``."""
    payload = f'["{sender}",[{json.dumps(message, separators=(",", ":"))}]]'
    with psycopg.connect(conninfo(database_url), autocommit=True, connect_timeout=5) as conn:
        conn.execute(f"LISTEN {CHANNEL}")
        conn.execute("SELECT pg_notify(%s, %s)", (CHANNEL, payload))
        deadline = time.monotonic() + timeout
        while (left := deadline - time.monotonic()) > 0:
            if any(note.payload == payload for note in conn.notifies(timeout=left, stop_after=1)):
                return True
    return False


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
        self._awaited: dict[int, asyncio.Future[None]] = {}  # echo number -> its sender's wait (on loop)
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
        """Sends ``message`` and waits (on ``loop``) until this replica hears it back, delivered by
        PostgreSQL to every replica listening; False when that took longer than ``timeout`` (the
        link is down: the others re-read at their reconnect)."""
        echo = next(self._echoes)
        heard = self._loop.create_future()
        self._awaited[echo] = heard
        self.send({**message, ECHO: echo})
        try:
            await asyncio.wait_for(heard, timeout)
            return True
        except asyncio.TimeoutError:
            return False
        finally:
            self._awaited.pop(echo, None)

    def _connect(self, role: str) -> psycopg.Connection[Any]:
        """Named in pg_stat_activity, so an operator sees each replica's two connections."""
        return psycopg.connect(
            self._conninfo, autocommit=True, connect_timeout=5, application_name=self.connection_name(role)
        )

    def connection_name(self, role: str) -> str:
        """``role``: listen or send."""
        return f"flexium replica {self.replica_id} {role}"

    # --- listening ----------------------------------------------------------------------------

    def _listen(self) -> None:
        tries = 0
        while not self._stopping.is_set():
            try:
                with self._connect("listen") as conn:
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
                    self._loop.call_soon_threadsafe(self._heard, message[ECHO])
            return
        for message in messages:
            self.received += 1
            self._loop.call_soon_threadsafe(self._deliver, message)

    def _heard(self, echo: int) -> None:
        heard = self._awaited.get(echo)
        if heard is not None and not heard.done():
            heard.set_result(None)

    def _deliver(self, message: Message) -> None:
        try:
            self._on_message(message)
        except Exception:  # one bad message must not end the link
            log.exception("replica link: handling %r failed", message.get("kind"))

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
                        conn = self._connect("send")
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
