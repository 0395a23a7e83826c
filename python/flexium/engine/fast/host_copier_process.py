"""The copier process (host_copier.py says why it exists): serves one job over the socket it was
given, one request at a time, until the job says quit or goes away.

    python -m flexium.engine.fast.host_copier_process --socket FD [--trace]

(--trace: each request and reply on stderr, the job's; the job asks for it when its log is at DEBUG.)

Requests: hello (loads the driver); attach (the staging's extents as fds, sizes, chunks; which extents
are driver-made host memory; which memfds the first copy to host writes rather than the copier touching
them); extend (the extents and chunks the job added to its staging since);
make_host (bytes, piece: awake, host memory made by the driver, its fds and sizes sent with the reply,
the job's to add to its staging); wake (uuid, wait, pause_ms; says what
it found pinned and how the background pinning before it ended); pinning (how far the background
pinning is: bytes pinned, whether it still runs, how the last one ended); copy
(to_host, the segments as fds, sizes, pieces, then_sleep: a second reply follows once asleep;
pin_rest_pause_ms: then pins the chunks the copies did not use); fill (sizes, pieces,
then_sleep, pin_rest_pause_ms: new memory made and filled from the staging while the job restores,
its fds sent with the reply, refused while FLEXIUM_RESUME_OVERLAP is false); sleep; detach (unmaps
the staging); quit. Each gets {"ok": true, ...}
or {"ok": false, "error": "..."}. Only flexium._C is loaded: no torch.
"""

from __future__ import annotations

import argparse
import socket
import sys
import time
import traceback
from collections.abc import Callable, Sequence
from typing import Any

from flexium import _C
from flexium.engine.fast.host_copier import (
    CHUNK_FIELDS,
    OVERLAP_ENV,
    PIECE_FIELDS,
    close_all,
    overlap_enabled,
    receive,
    send,
    write_buffer_bytes,
)

HANDED_FDS = "handed_fds"  # a reply's fds to send with it (not a field of the reply)


class Server:
    def __init__(self, sock: socket.socket, trace: bool = False) -> None:
        self.sock = sock
        self.copier: _C.HostCopier | None = None
        self.trace = trace  # each request and its reply on stderr (the job's log at DEBUG)

    def serve(self) -> int:
        while True:
            try:
                message, fds = receive(self.sock)
            except (ConnectionError, OSError):
                return 0  # the job is gone
            op = message.get("op")
            if self.trace:
                fields = {k: v for k, v in message.items() if k not in ("op", "pieces", "chunks", "sizes")}
                print(f"[flexium copier] {time.monotonic():.3f} {op} {fields}", file=sys.stderr, flush=True)
            if op == "quit":
                close_all(fds)
                return 0
            self.answer(lambda: self.handle(str(op), message, fds), fds)  # noqa: B023  (runs at once, in this pass)
            if op in ("copy", "fill") and message.get("then_sleep") and self.copier is not None:
                self.answer(self.sleep)

    def answer(self, work: Callable[[], dict[str, Any]], fds: Sequence[int] = ()) -> None:
        """Runs one request and sends its reply. The fds it came with are closed before the reply:
        a segment's fd kept here would keep its memory alive past the job's release. The fds a
        reply hands over (HANDED_FDS) ride it and are closed here once sent."""
        started = time.perf_counter()
        handed: list[int] = []
        try:
            reply = work()
            handed = reply.pop(HANDED_FDS, [])
            reply.update(ok=True, seconds=time.perf_counter() - started)
        except Exception as exc:
            traceback.print_exc(file=sys.stderr)
            reply = {"ok": False, "error": f"{type(exc).__name__}: {exc}"}
        finally:
            close_all(fds)
        if self.trace:
            print(f"[flexium copier] {time.monotonic():.3f} reply {reply}", file=sys.stderr, flush=True)
        try:
            send(self.sock, reply, handed)
        finally:
            close_all(handed)

    def sleep(self) -> dict[str, Any]:
        self.require_attached("sleep").sleep()
        return {}

    def handle(self, op: str, message: dict[str, Any], fds: list[int]) -> dict[str, Any]:
        if op == "hello":
            status = _C.driver_status()  # loads the driver and runs cuInit: no context, no GPU memory
            if not status.loaded or not status.vmm_api:
                raise RuntimeError(f"the copier cannot use the driver: {status}")
            return {}
        if op in ("attach", "extend"):
            extents, chunks = with_sizes(op, message, fds, "extents"), staging_chunks(message)
            driver_made = [bool(made) for made in message.get("driver_made", [])]
            written = [bool(flag) for flag in message.get("written", [])]
            if op == "extend":
                self.require_attached(op).extend(extents, chunks, driver_made, written)
                return {}
            if self.copier is not None:
                self.copier.sleep()
                self.copier = None  # unmaps the old extents
            self.copier = _C.HostCopier(extents, chunks, driver_made, written)
            self.copier.set_write_buffer_bytes(write_buffer_bytes())
            return {}
        if op == "detach":
            if self.copier is not None:
                self.copier.sleep()
                self.copier = None  # unmaps the extents
            return {}
        copier = self.require_attached(op)
        if op == "wake":
            before = copier.wake(str(message["uuid"]), bool(message["wait"]), int(message.get("pause_ms", 0)))
            return {
                "pinned": copier.pinned_bytes,
                "newly_pinned": copier.pinned_since_wake,
                "pinned_at_wake": copier.pinned_at_wake,
                "pinner_before": before,
            }
        if op == "pinning":
            return {"pinned": copier.pinned_bytes, "pinning": copier.pinning, "pinner": copier.last_pinner}
        if op == "copy":
            segments = with_sizes(op, message, fds, "segments")
            pieces = [_C.CopierPiece(**dict(zip(PIECE_FIELDS, row, strict=True))) for row in message["pieces"]]
            copied = copier.copy(
                bool(message["to_host"]), segments, pieces, bool(message.get("write_untouched", False))
            )
            times = copier.last_copy_times  # before the pinner runs again
            if message.get("pin_rest_pause_ms") is not None:
                copier.pin_rest(int(message["pin_rest_pause_ms"]))
            return {"bytes": copied, **times, "write_buffer": copier.write_buffer_bytes}
        if op == "fill":
            return self.fill(copier, message)
        if op == "make_host":
            made = copier.make_host_memory(int(message["bytes"]), int(message["piece"]))
            return {"sizes": [size for _fd, size in made], HANDED_FDS: [fd for fd, _size in made]}
        if op == "sleep":
            return self.sleep()
        raise ValueError(f"unknown request {op!r}")

    def fill(self, copier: _C.HostCopier, message: dict[str, Any]) -> dict[str, Any]:
        """New memory filled from the staging while the job restores; its fds go with the reply.
        `started` and `ended` are time.monotonic(), which the job's clock shares."""
        if not overlap_enabled():
            raise RuntimeError(f"the copy back beside the restore is off: {OVERLAP_ENV}=0")
        started = time.monotonic()
        pieces = [_C.CopierPiece(**dict(zip(PIECE_FIELDS, row, strict=True))) for row in message["pieces"]]
        fds = copier.fill([int(size) for size in message["sizes"]], pieces)
        ended = time.monotonic()
        times = copier.last_copy_times  # before the pinner runs again
        if message.get("pin_rest_pause_ms") is not None:
            try:
                copier.pin_rest(int(message["pin_rest_pause_ms"]))
            except BaseException:
                close_all(fds)  # the reply carrying them is not sent: the memory must not stay held here
                raise
        return {"bytes": sum(p.length for p in pieces), **times, "started": started, "ended": ended, HANDED_FDS: fds}

    def require_attached(self, op: str) -> _C.HostCopier:
        if self.copier is None:
            raise RuntimeError(f"'{op}' before 'attach': the copier has no staging")
        return self.copier


def with_sizes(op: str, message: dict[str, Any], fds: list[int], what: str) -> list[tuple[int, int]]:
    """The request's fds paired with its "sizes", one each."""
    sizes = [int(s) for s in message["sizes"]]
    if len(sizes) != len(fds):
        raise ValueError(f"{op} sent {len(fds)} fds for {len(sizes)} {what}")
    return list(zip(fds, sizes, strict=True))


def staging_chunks(message: dict[str, Any]) -> list[_C.CopierChunk]:
    return [_C.CopierChunk(**dict(zip(CHUNK_FIELDS, row, strict=True))) for row in message["chunks"]]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m flexium.engine.fast.host_copier_process")
    parser.add_argument("--socket", type=int, required=True, help="fd of the seqpacket socket to the job")
    parser.add_argument("--trace", action="store_true", help="each request and reply on stderr")
    args = parser.parse_args(argv)
    server = Server(socket.socket(fileno=args.socket), trace=args.trace)
    try:
        return server.serve()
    finally:
        server.copier = None  # sleeps and unmaps before the interpreter goes


if __name__ == "__main__":
    sys.exit(main())
