"""The replicas' link over PostgreSQL's LISTEN/NOTIFY (server/replica_link.py), between two links
on one real database: a message reaches the other replica and not its sender, a burst arrives
whole and in order in fewer payloads than messages, a message too large for a payload is dropped
and counted while the rest arrive, a listener whose connection the database ended reconnects,
says so, and hears what is sent after, and a sender waiting for the others to apply its message
does not wait for a replica of an older version, which never answers."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable
from typing import Any

import psycopg
import pytest

from flexium.server.replica_link import (
    CHANNEL,
    MAX_PAYLOAD_BYTES,
    Message,
    ReplicaLink,
    connection_name,
    conninfo,
    tell_replicas,
)
from flexium.server.settings import normalize_database_url

pytestmark = [pytest.mark.timeout(60), pytest.mark.parametrize("database_kind", ["postgresql"], indirect=True)]


class Replica:
    """A link with what it heard."""

    def __init__(self, url: str, loop: asyncio.AbstractEventLoop) -> None:
        self.heard: list[Message] = []
        self.reconnects = 0
        self.link = ReplicaLink(url, loop=loop, on_message=self.heard.append, on_reconnect=self._reconnected)

    def _reconnected(self) -> None:
        self.reconnects += 1


async def _until(check: Callable[[], bool], what: str, timeout: float = 10.0) -> None:
    deadline = asyncio.get_running_loop().time() + timeout
    while not check():
        assert asyncio.get_running_loop().time() < deadline, f"timed out waiting for {what}"
        await asyncio.sleep(0.01)


def _run(database_url: str, scenario: Callable[[Replica, Replica], Any]) -> None:
    url = normalize_database_url(database_url)

    async def main() -> None:
        loop = asyncio.get_running_loop()
        a, b = Replica(url, loop), Replica(url, loop)
        for replica in (a, b):
            replica.link.start()
        try:
            # The owner hears of each LISTEN through its loop, just after the link says it listens.
            await _until(lambda: all(r.link.listening.is_set() and r.reconnects >= 1 for r in (a, b)), "both to listen")
            await scenario(a, b)
        finally:
            for replica in (a, b):
                await asyncio.to_thread(replica.link.stop)

    asyncio.run(main())


def test_a_message_reaches_the_other_replica_and_not_its_sender(database_url: str) -> None:
    async def scenario(a: Replica, b: Replica) -> None:
        a.link.send({"kind": "wake", "key": [1, "gpu-1"]})
        await _until(lambda: len(b.heard) == 1, "b to hear a")
        assert b.heard == [{"kind": "wake", "key": [1, "gpu-1"]}]
        b.link.send({"kind": "revoked", "ids": [7]})
        await _until(lambda: len(a.heard) == 1, "a to hear b")
        assert a.heard == [{"kind": "revoked", "ids": [7]}] and len(b.heard) == 1  # neither hears itself

    _run(database_url, scenario)


def test_a_burst_arrives_whole_in_order_in_fewer_payloads_and_an_oversized_message_is_dropped(
    database_url: str,
) -> None:
    async def scenario(a: Replica, b: Replica) -> None:
        burst = [{"kind": "event", "n": n, "data": "x" * 80} for n in range(2000)]
        too_big = {"kind": "event", "n": -1, "data": "y" * MAX_PAYLOAD_BYTES}
        for message in burst[:1000]:
            a.link.send(message)
        a.link.send(too_big)
        for message in burst[1000:]:
            a.link.send(message)
        await _until(lambda: len(b.heard) == len(burst), "the burst")
        await asyncio.sleep(0.2)
        assert b.heard == burst
        assert a.link.dropped == 1 and a.link.sent == len(burst)
        assert b.link.received == len(burst)

    _run(database_url, scenario)


def test_a_listener_the_database_disconnected_reconnects_and_hears_what_follows(database_url: str) -> None:
    async def scenario(a: Replica, b: Replica) -> None:
        assert b.reconnects == 1  # its first LISTEN: nothing it missed yet, but its owner reads anyway
        with psycopg.connect(conninfo(normalize_database_url(database_url)), autocommit=True) as admin:
            ended = admin.execute(
                "SELECT pg_terminate_backend(pid) FROM pg_stat_activity"
                " WHERE datname = current_database() AND query = %s AND pid <> pg_backend_pid()",
                (f"LISTEN {CHANNEL}",),
            ).fetchall()
        assert len(ended) == 2, ended  # both listeners
        await _until(lambda: b.reconnects == 2 and b.link.listening.is_set(), "b to listen again")
        a.link.send({"kind": "wake", "key": [2, "gpu-2"]})
        await _until(lambda: b.heard == [{"kind": "wake", "key": [2, "gpu-2"]}], "b to hear a after reconnecting")

    _run(database_url, scenario)


def test_a_replica_that_never_answers_applied_is_not_waited_for(database_url: str) -> None:
    """In a rolling upgrade, a replica of a version before ``applied`` listens under the name it had and
    never answers: a sender waits for the replicas that do, not for its whole timeout."""
    url = normalize_database_url(database_url)

    async def scenario(a: Replica, b: Replica) -> None:
        old = connection_name("0a0a0a0a0a0a", "listen")  # the name such a replica gives its listener
        with psycopg.connect(conninfo(url), autocommit=True, application_name=old) as older:
            older.execute(f"LISTEN {CHANNEL}")
            started = time.monotonic()
            assert await a.link.send_heard({"kind": "revoked", "token": 7}, timeout=5.0)
            assert await asyncio.to_thread(tell_replicas, url, "flexium token revoke", {"kind": "revoked", "token": 8})
            assert time.monotonic() - started < 2.0  # b answered both; the older replica was not waited for
        await _until(
            lambda: {"kind": "revoked", "token": 8} in [{k: m[k] for k in ("kind", "token")} for m in b.heard], "b"
        )

    _run(database_url, scenario)


def test_a_long_revocation_reaches_the_replicas_in_notifications_that_fit(database_url: str) -> None:
    """A cascade of 1,201 tokens of ten-digit ids from the command line (one notification of them all
    passed PostgreSQL's 8000 bytes, so pg_notify refused it and no replica heard any): every id arrives."""
    from flexium.server.context import revocation_messages

    url = normalize_database_url(database_url)
    ids = list(range(10**9, 10**9 + 1201))

    async def scenario(a: Replica, b: Replica) -> None:
        messages = revocation_messages(reversed(ids))
        assert len(messages) == 3
        for message in messages:
            assert await asyncio.to_thread(tell_replicas, url, "flexium token revoke", message)

        def heard() -> list[int]:
            return sorted(t for m in b.heard if m.get("kind") == "revoked" for t in m["tokens"])

        await _until(lambda: heard() == ids, "b to hear every revoked token")

    _run(database_url, scenario)
