"""The server's open connections, counted from the moment each is accepted, and who makes room
when there are too many (used by ``connections.py``).

A connection is in one of three phases: in its TLS handshake, idle (waiting for a request, its
first or its next), or busy (inside a request, or answering one). Past the bound on all
connections, or past the bound on one client address's, the oldest connection still in its
handshake makes room first, then the oldest idle one: neither has a request the server owes an
answer to. When every candidate is busy, the new connection is closed instead. Connections from
a trusted proxy (uvicorn's ``FORWARDED_ALLOW_IPS``) are counted in the whole but not held to
the per-address bound: the proxy carries every client's requests, so the request-level bounds
(``fair_share.py``) count its clients by their forwarded addresses instead.
"""

from __future__ import annotations

import ipaddress
import logging
import time
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass, field
from enum import Enum
from typing import Any

log = logging.getLogger("flexium.server")

_WARN_EVERY_S = 10.0


class Phase(Enum):
    HANDSHAKE = "in its TLS handshake"
    IDLE = "outside a request"
    BUSY = "inside a request"


@dataclass(eq=False)
class Connection:
    """One accepted socket. ``close`` closes the socket itself (below TLS, so that no TLS
    shutdown keeps the descriptor); ``accepted_at`` is ``time.monotonic()`` at accept."""

    address: str
    close: Callable[[], None]
    accepted_at: float = field(default_factory=time.monotonic)
    phase: Phase = Phase.IDLE
    closing: bool = False  # closed by the book: it no longer waits in its lists


class TrustedProxies:
    """The addresses whose ``X-Forwarded-For`` uvicorn believes, as it reads them
    (``FORWARDED_ALLOW_IPS``: addresses or networks separated by commas, ``*`` for any)."""

    def __init__(self, spec: str | list[str]) -> None:
        items = spec.split(",") if isinstance(spec, str) else spec
        self.everyone = any(item.strip() == "*" for item in items)
        self.networks = []
        for item in items:
            try:
                self.networks.append(ipaddress.ip_network(item.strip(), strict=False))
            except ValueError:
                continue  # a Unix socket's path, or "*"

    def __contains__(self, address: str) -> bool:
        if self.everyone:
            return True
        try:
            ip = ipaddress.ip_address(address)
        except ValueError:
            return False
        return any(ip in network for network in self.networks)


class ConnectionBook:
    def __init__(self, *, max_connections: int, max_per_client: int, trusted_proxies: TrustedProxies) -> None:
        self.max_connections = max_connections
        self.max_per_client = max_per_client
        self.trusted_proxies = trusted_proxies
        self.handshaking: dict[Connection, None] = {}  # insertion-ordered: the oldest first
        self.idle: dict[Connection, None] = {}
        self.open = 0
        self.per_address: Counter[str] = Counter()
        self._last_warning = 0.0

    def accepted(self, connection: Connection) -> None:
        self.open += 1
        self.per_address[connection.address] += 1
        self._waiting(connection)[connection] = None
        if self.open > self.max_connections and not self._make_room(
            connection, None, f"{self.open} open (--max-connections {self.max_connections})"
        ):
            return
        if (
            self.per_address[connection.address] > self.max_per_client
            and connection.address not in self.trusted_proxies
        ):
            self._make_room(
                connection,
                connection.address,
                f"{self.per_address[connection.address]} open from {connection.address} "
                f"(--max-connections-per-client {self.max_per_client})",
            )

    def enter(self, connection: Connection, phase: Phase) -> None:
        """The connection moves on: its handshake done (idle), a request begun (busy), or
        answered (idle again, the youngest of the idle)."""
        self._waiting(connection).pop(connection, None)
        connection.phase = phase
        if phase is not Phase.BUSY and not connection.closing:
            self.idle[connection] = None

    def closed(self, connection: Connection) -> None:
        self._waiting(connection).pop(connection, None)
        self.open -= 1
        self.per_address[connection.address] -= 1
        if self.per_address[connection.address] <= 0:
            del self.per_address[connection.address]
        connection.phase = Phase.BUSY  # out of every list: a late close finds nothing

    def _waiting(self, connection: Connection) -> dict[Connection, None]:
        return self.handshaking if connection.phase is Phase.HANDSHAKE else self.idle

    def _make_room(self, newcomer: Connection, address: str | None, why: str) -> bool:
        """Whether the newcomer stays (another made room for it)."""
        victim = self._oldest_waiting(newcomer, address)
        if victim is None:
            self.warn("refused a connection: %s, all inside a request", why)
            self._shut(newcomer)
            return False
        self.warn("closed the oldest connection %s to make room: %s", victim.phase.value, why)
        self._shut(victim)
        return True

    def _shut(self, connection: Connection) -> None:
        """Closed to make room; counted until the event loop says it is gone (``closed``)."""
        self._waiting(connection).pop(connection, None)
        connection.closing = True
        connection.close()

    def _oldest_waiting(self, newcomer: Connection, address: str | None) -> Connection | None:
        for waiting in (self.handshaking, self.idle):
            for candidate in waiting:
                if candidate is not newcomer and (address is None or candidate.address == address):
                    return candidate
        return None

    def warn(self, message: str, *args: Any) -> None:
        """At most one warning every ``_WARN_EVERY_S``: a flood would otherwise fill the log."""
        now = time.monotonic()
        if now - self._last_warning >= _WARN_EVERY_S:
            self._last_warning = now
            log.warning(message + " (this message is shown at most every %g s)", *args, _WARN_EVERY_S)
