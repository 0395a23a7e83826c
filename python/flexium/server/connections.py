"""Bounds on the server's connections, below the ASGI app (uvicorn's HTTP protocol, subclassed,
under a TLS layer of our own when the server serves HTTPS).

uvicorn closes a keep-alive connection that stays idle between requests, but nothing closes one
that sends nothing, half of its headers, or no TLS handshake: each holds a file descriptor, and
about a thousand of them used to leave none for the jobs' heartbeats and polls. Here, as Go's
net/http and nginx do, a connection is counted and timed from the moment it is accepted:
- it must finish its TLS handshake and deliver a whole request within ``request_timeout_s`` of
  being accepted (a later request on a kept-alive connection: of its first byte), and its body
  within ``body_timeout_s`` of its headers; else it is answered 408 (when its headers are
  incomplete, so no answer is under way) and closed. Long-polls and event streams are not
  affected: their request is complete at once, only the answer takes long.
- past ``max_connections`` open connections, or a client address's bound, one that owes no
  answer makes room (``connection_book.py``), a handshake before an idle one.
- a request's header block may take at most ``max_header_bytes`` and ``max_header_lines``, as
  nginx's ``large_client_header_buffers`` and Go's ``MaxHeaderBytes`` bound it (httptools has no
  bound: it gathers a header line whole, however long): past either it is answered 431 and the
  connection closed. Bytes are counted as they are read and the parser is fed at most what is
  left of the bound, so a block is never gathered past it. The parser is fed ``_PIECE`` bytes at
  a time: where a request pipelined behind another began within a piece is not known, so it is
  charged that whole piece, at most ``_PIECE`` bytes more than its block. A refused request
  pipelined behind others is answered after them, in its turn.
Each request is stamped with the time it began to arrive (``received_at``).

HTTPS is done by ``TlsAccepted``, asyncio's TLS protocol (``asyncio.sslproto``, which the event
loops' own ``create_server(ssl=...)`` use) wrapped around the HTTP protocol: handed to the event
loop as a plain TCP protocol, it sees each connection at accept, where the loop's own TLS would
show the HTTP protocol a connection only once its handshake is done (and keep a stalled
handshake 60 s; uvicorn does not let that be set).
"""

from __future__ import annotations

import asyncio
import json
import logging
import math
import resource
import socket
import ssl
import time
from asyncio.sslproto import SSLProtocol
from typing import Any

import httptools
from uvicorn.protocols.http.httptools_impl import HttpToolsProtocol

from flexium.server.connection_book import Connection, ConnectionBook, Phase
from flexium.server.errors import HeaderFieldsTooLarge
from flexium.server.settings import option_and_env

log = logging.getLogger("flexium.server")

_TIMEOUT_ANSWER = (
    b"HTTP/1.1 408 Request Timeout\r\ncontent-type: text/plain; charset=utf-8\r\n"
    b"content-length: 46\r\nconnection: close\r\n\r\nthe request did not arrive in time; reconnect\n"
)
_RECEIVED_AT = "flexium_received_at"
# After a 431 the client may still be sending its header block: closing with unread bytes would
# send a reset that can destroy the answer before the client reads it (RFC 9112 section 9.6), so
# what still comes is read and dropped until the client is quiet this long, or at most the second.
_LINGER_QUIET_S = 0.5
_LINGER_MAX_S = 2.0
_PIECE = 8 << 10


class _HeaderBlockTooLarge(Exception):
    """Raised from the parser's header callback, which stops the parse at once."""


def received_at(scope: Any) -> float | None:
    """When the request began to arrive (``time.monotonic()``), as stamped below; None for a request
    that came another way (tests call the app directly). A server that is behind runs a handler
    well after its request arrived, and a long-poll's wait is counted from the arrival."""
    state = scope.get("state")
    return None if state is None else state.get(_RECEIVED_AT)


def listening_socket(host: str, port: int) -> socket.socket:
    """The server's socket, bound before anything else is done (the database, the first workspace
    and its tokens): a port in use refuses the start with nothing made. OSError says why."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind((host, port))
    except OSError:
        sock.close()
        raise
    sock.set_inheritable(True)
    return sock


def raise_open_file_limit() -> int:
    """Raises this process's soft limit on open files to its hard limit (every connection is one);
    returns the limit now in force."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if hard == resource.RLIM_INFINITY:
        hard = 1 << 20
    if soft == resource.RLIM_INFINITY or soft >= hard:
        return soft if soft != resource.RLIM_INFINITY else hard
    try:
        resource.setrlimit(resource.RLIMIT_NOFILE, (hard, hard))
    except (ValueError, OSError) as exc:
        log.warning("could not raise the open file limit from %d to %d: %s", soft, hard, exc)
        return soft
    return hard


def connection_limit(wanted: int, open_files: int) -> int:
    """At most ``wanted`` connections, leaving descriptors for the database, logs and the
    listening socket."""
    return max(16, min(wanted, open_files - 64))


def tls_context(certfile: str, keyfile: str) -> ssl.SSLContext:
    """The server's side of TLS (``tls_certificate.check_certificate`` has read both files at start)."""
    context = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
    context.load_cert_chain(certfile, keyfile)
    return context


def bounded_protocol(
    *,
    request_timeout_s: float,
    body_timeout_s: float,
    max_header_bytes: int,
    max_header_lines: int,
    book: ConnectionBook,
    tls: ssl.SSLContext | None,
) -> type[asyncio.Protocol]:
    """The protocol uvicorn makes for each accepted connection (its ``http`` class): uvicorn's
    httptools protocol with the bounds above, under ``TlsAccepted`` when ``tls`` is given."""
    too_many_bytes = (
        f"the request's header block is over {max_header_bytes} bytes, this server's bound "
        f"({option_and_env('max_header_bytes')} raises it): send fewer or shorter headers or cookies"
    )
    too_many_lines = (
        f"the request has over {max_header_lines} header lines, this server's bound "
        f"({option_and_env('max_header_lines')} raises it): send fewer headers or cookies"
    )

    class BoundedHttpProtocol(HttpToolsProtocol):
        connection: Connection | None = None  # set by TlsAccepted before its handshake
        _request_timer: asyncio.TimerHandle | None = None
        # What is read next belongs to a header block (no request begun, or its headers incomplete);
        # that block's bytes read so far, and its lines.
        _in_header_block = True
        _header_bytes = 0
        _header_lines = 0
        _piece_bytes = 0  # what the parser is being fed now
        _message_ended_in_piece = False
        _refusal_due: str | None = None  # refused, its answer after those owed before it
        _lingering: asyncio.TimerHandle | None = None  # refused and answered: the client's bytes are dropped
        _refused_at = 0.0

        def connection_made(self, transport: Any) -> None:
            super().connection_made(transport)
            if self.connection is None:  # plain HTTP: accepted just now
                self.connection = Connection(address=_address(transport), close=transport.close)
                book.accepted(self.connection)
            else:
                book.enter(self.connection, Phase.IDLE)
            since_accept = time.monotonic() - self.connection.accepted_at
            self._start_timer(request_timeout_s - since_accept)

        def data_received(self, data: bytes) -> None:
            """uvicorn's, fed to the parser in pieces that keep a header block within its bound."""
            if self._lingering is not None:
                self._linger()
                return
            if self._refusal_due is not None:
                return
            self._unset_keepalive_if_required()
            unread = memoryview(data)  # pieces of it, not copies
            while unread and not self.transport.is_closing():
                size = min(_PIECE, max_header_bytes - self._header_bytes) if self._in_header_block else _PIECE
                piece, unread = unread[:size], unread[size:]
                if self._in_header_block:
                    self._header_bytes += len(piece)
                self._piece_bytes, self._message_ended_in_piece = len(piece), False
                try:
                    self.parser.feed_data(piece)
                except httptools.HttpParserCallbackError as exc:
                    if isinstance(exc.__context__, _HeaderBlockTooLarge):
                        self._refuse_header_block(too_many_lines)
                        return
                    self._invalid_request()
                    return
                except httptools.HttpParserError:
                    self._invalid_request()
                    return
                except httptools.HttpParserUpgrade:
                    if self._should_upgrade():
                        self.handle_websocket_upgrade()
                    else:
                        self._unsupported_upgrade_warning()
                    return
                if self._in_header_block and self._header_bytes >= max_header_bytes:
                    self._refuse_header_block(too_many_bytes)
                    return

        def on_message_begin(self) -> None:
            super().on_message_begin()
            self.scope["state"][_RECEIVED_AT] = time.monotonic()
            self._header_lines = 0
            if self._message_ended_in_piece:  # pipelined: it may hold any of this piece's bytes
                self._header_bytes = self._piece_bytes
            if self._request_timer is None:  # a later request on a kept-alive connection
                self._start_timer(request_timeout_s)

        def on_header(self, name: bytes, value: bytes) -> None:
            self._header_lines += 1
            if self._header_lines > max_header_lines:
                raise _HeaderBlockTooLarge
            super().on_header(name, value)

        def on_headers_complete(self) -> None:
            assert self.connection is not None
            self._in_header_block = False
            book.enter(self.connection, Phase.BUSY)  # owed an answer: not closed to make room
            if self._request_timer is not None:
                left = self._request_timer.when() - self.loop.time()
                if left > body_timeout_s:
                    self._stop_timer()
                    self._start_timer(body_timeout_s)
            super().on_headers_complete()

        def on_message_complete(self) -> None:
            self._stop_timer()
            self._in_header_block, self._header_bytes, self._message_ended_in_piece = True, 0, True
            super().on_message_complete()

        def on_response_complete(self) -> None:
            super().on_response_complete()
            if self.transport.is_closing() or self._answer_owed():
                return
            if self._refusal_due is not None:  # the answers owed before the refusal are sent
                self._unset_keepalive_if_required()
                self._answer_refusal(self._refusal_due)
            elif self.connection is not None:
                book.enter(self.connection, Phase.IDLE)  # kept alive, waiting for the next request

        def connection_lost(self, exc: Exception | None) -> None:
            if self._lingering is not None:
                self._lingering.cancel()
            self._stop_timer()
            if self.connection is not None and not tls:
                book.closed(self.connection)
            super().connection_lost(exc)

        def _invalid_request(self) -> None:
            message = "Invalid HTTP request received."  # uvicorn's words, in its log and its answer
            self.logger.warning(message)
            self.send_400_response(message)

        def _refuse_header_block(self, why: str) -> None:
            """431, after the answers still owed to requests pipelined before it; then the
            connection closed once the client has stopped sending."""
            self._stop_timer()
            book.warn("refused a request from %s: %s", self.connection.address if self.connection else "?", why)
            if self._answer_owed():
                self._refusal_due = why
                return
            self._answer_refusal(why)

        def _answer_owed(self) -> bool:
            """Whether a request read before is still to be answered (pipelined requests are
            answered in turn; ``cycle`` is the last one read)."""
            return bool(self.pipeline) or (self.cycle is not None and not self.cycle.response_complete)

        def _answer_refusal(self, why: str) -> None:
            refusal = HeaderFieldsTooLarge(why)
            body = json.dumps(refusal.body()).encode()
            self.transport.write(
                b"HTTP/1.1 %d Request Header Fields Too Large\r\ncontent-type: application/json\r\n"
                b"content-length: %d\r\nconnection: close\r\n\r\n%s" % (refusal.status, len(body), body)
            )
            if self.transport.can_write_eof():  # plain TCP: the client sees the end after the answer
                self.transport.write_eof()
            self._refused_at = self.loop.time()
            self._linger()

        def _linger(self) -> None:
            if self._lingering is not None:
                self._lingering.cancel()
            close_at = min(self.loop.time() + _LINGER_QUIET_S, self._refused_at + _LINGER_MAX_S)
            self._lingering = self.loop.call_at(close_at, self.transport.close)

        def _start_timer(self, seconds: float) -> None:
            self._request_timer = self.loop.call_later(max(seconds, 0.0), self._request_too_slow)

        def _stop_timer(self) -> None:
            if self._request_timer is not None:
                self._request_timer.cancel()
                self._request_timer = None

        def _request_too_slow(self) -> None:
            self._request_timer = None
            if self.transport.is_closing() or self.connection is None:
                return
            if self.connection.phase is not Phase.BUSY:  # headers incomplete: no answer has begun
                self.transport.write(_TIMEOUT_ANSWER)
            book.warn(
                "closed a connection from %s that sent no complete request within %g s of its start, "
                "or no body within %g s of its headers (--request-timeout, --body-timeout)",
                self.connection.address,
                request_timeout_s,
                body_timeout_s,
            )
            self.connection.close()

    if tls is None:
        return BoundedHttpProtocol
    context = tls

    class TlsAccepted(SSLProtocol):
        """TLS over an accepted socket, the HTTP protocol above inside it; the connection is in
        the book from accept, its handshake bounded by the request timeout."""

        def __init__(self, **uvicorn_arguments: Any) -> None:
            self.http = BoundedHttpProtocol(**uvicorn_arguments)
            super().__init__(
                self.http.loop,
                self.http,
                context,
                None,  # type: ignore[arg-type]  # no one awaits the handshake: asyncio takes None
                server_side=True,
                ssl_handshake_timeout=math.ceil(request_timeout_s),
            )

        def connection_made(self, transport: Any) -> None:
            super().connection_made(transport)
            self.http.connection = Connection(address=_address(transport), close=transport.close, phase=Phase.HANDSHAKE)
            book.accepted(self.http.connection)

        def connection_lost(self, exc: BaseException | None) -> None:
            if self.http.connection is not None:
                book.closed(self.http.connection)
            super().connection_lost(exc)

    return TlsAccepted


def _address(transport: Any) -> str:
    peer = transport.get_extra_info("peername")
    return str(peer[0]) if isinstance(peer, (tuple, list)) and peer else "?"
