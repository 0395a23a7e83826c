"""The job's side of the copier process, which runs a fast pause's copies to and from host memory.

Pinned memory in the checkpointed process slows its checkpoint and restore, and unpinning it there does not overlap the
copies (facts `pinned-memory-slows-checkpoint`, `pinning-holds-job-calls` and `staging-pinned-by-copier`). So the copies
run in a second process (``host_copier_process.py``, csrc/host_copier.cpp): it maps the job's host staging (memfds the
job keeps mapped too), pins it with a context of its own and copies between it and the job's segments, passed to it as
fds. While the job is paused it holds no GPU memory (it unpins and drops its context after the copy to host); on resume
it pins again while the job's restore runs.

The copier is disposable: the staged bytes live in the job's own memfds, so when the copier fails
or dies the job kills it and runs the copies itself. Every exchange has a time limit.

Wire format: Unix seqpacket frames, each a flag byte (1: more frames follow) and a slice of one
JSON message; fds ride the frames in batches (SCM_RIGHTS carries at most 253 per message).

A process forked from the job (a DataLoader worker) would inherit the socket: the copier would
then not see the job's end when the job dies, and two processes could talk over one socket. So
the fork's copy is closed in the child, and a child's Copier refuses every request.
"""

from __future__ import annotations

import json
import logging
import os
import socket
import subprocess
import sys
import threading
import time
import weakref
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from flexium.config import switch_from_env
from flexium.errors import ConfigError
from flexium.units import gib_or_mib, read_size

if TYPE_CHECKING:
    from flexium import _C

log = logging.getLogger("flexium")

DISABLE_ENV = "FLEXIUM_HOST_COPIER"  # false: copies run in the job's process
OVERLAP_ENV = "FLEXIUM_RESUME_OVERLAP"  # false: the copy back waits for the restore (fast/resume_overlap.py)
WRITTEN_ENV = "FLEXIUM_WRITTEN_STAGING"  # false: a staging made at the safe point is touched, not written
WRITE_BUFFER_ENV = "FLEXIUM_WRITE_BUFFER"  # each pinned buffer a written staging's copies go through
FRAME_BYTES = 48 << 10
FDS_PER_FRAME = 200
START_TIMEOUT_S = 60.0
# Time limits grow with the bytes at this pace, far below the copy and pinning speeds (facts `copy-ceilings` and
# `pinning-rate`).
SLOWEST_BYTES_PER_S = 1 << 30
# The driver makes host memory at 1.9-5.3 GB/s (fact `driver-made-host-memory`).
MAKING_BYTES_PER_S = 1 << 28
EXIT_TIMEOUT_S = 10.0
PINNING_WAIT_S = 1.0  # how long asking how far the copier pinned waits for another exchange to end
# The wire carries a chunk or a piece (csrc/host_copier.h) as the list of these fields' values;
# the copier rebuilds it by name.
CHUNK_FIELDS = ("extent", "offset", "size")
PIECE_FIELDS = ("segment", "segment_offset", "chunk", "chunk_offset", "length")


class CopierError(Exception):
    """The copier failed or did not answer in time: the caller kills it and copies itself."""


class CopierRefused(CopierError):
    """The copier answered that a request failed (it still serves the next)."""


@dataclass(frozen=True)
class Filled:
    """The copier's answer to a fill: its reply (bytes, times, its clock's start and end of the fill)
    and one fd per segment of the order, the receiver's to import and close."""

    reply: dict[str, Any]
    fds: list[int]


def copier_enabled() -> bool:
    return switch_from_env(DISABLE_ENV, True, "host copier switch")


def overlap_enabled() -> bool:
    """Whether the copier makes a resume's memory while the job restores (read in the copier, whose
    environment is the job's): off, it refuses, and the copy back runs after the restore."""
    return switch_from_env(OVERLAP_ENV, True, "resume overlap switch")


def written_staging_enabled() -> bool:
    """Whether the copier writes a staging made at a pause's safe point through small pinned buffers
    (csrc/host_copier_writes.cpp) rather than touch, pin and later unpin it (docs/fast-path.md, "Written at
    the safe point")."""
    return switch_from_env(WRITTEN_ENV, True, "written staging switch")


def write_buffer_bytes() -> int:
    """Bytes of each of the two pinned buffers a thread writing a staging copies through (read in the
    copier, whose environment is the job's): an amount such as 1MiB, which the copier's rule admits
    (``_C.write_buffer_refusal``); unset, the copier's default (csrc/host_copier.h says why)."""
    from flexium import _C

    default = _C.default_write_buffer_bytes()
    text = os.environ.get(WRITE_BUFFER_ENV, "").strip()
    if not text:
        return default
    try:
        size = read_size(text)
    except ValueError as exc:
        size, refusal = 0, str(exc)
    else:  # an amount past what the copier can even be given is refused without asking it
        refusal = _C.write_buffer_refusal(size) if size < 1 << 63 else "more memory than any host has"
    if refusal:
        raise ConfigError(
            f"{WRITE_BUFFER_ENV}={text!r} is not valid: give the size of each write buffer, such as 1MiB or 512KiB "
            f"({refusal}; default {gib_or_mib(default)}), or unset it"
        )
    return size


def send(sock: socket.socket, message: dict[str, Any], fds: Sequence[int] = ()) -> None:
    data = json.dumps(message, separators=(",", ":")).encode()
    frames = max(1, -(-len(data) // FRAME_BYTES), -(-len(fds) // FDS_PER_FRAME))
    for k in range(frames):
        body = bytes([1 if k + 1 < frames else 0]) + data[k * FRAME_BYTES : (k + 1) * FRAME_BYTES]
        batch = list(fds[k * FDS_PER_FRAME : (k + 1) * FDS_PER_FRAME])
        if batch:
            socket.send_fds(sock, [body], batch)
        else:
            sock.sendall(body)


def receive(sock: socket.socket) -> tuple[dict[str, Any], list[int]]:
    """One message and the fds that came with it (the caller's to close)."""
    data = bytearray()
    fds: list[int] = []
    try:
        while True:
            # Close-on-exec from the start: a child forked meanwhile must not hold the memory behind them.
            body, got, _flags, _addr = socket.recv_fds(sock, FRAME_BYTES + 1, FDS_PER_FRAME, socket.MSG_CMSG_CLOEXEC)
            fds.extend(got)
            if not body:
                raise ConnectionError("the other side closed the connection")
            data += body[1:]
            if body[0] == 0:
                return json.loads(data.decode()), fds
    except BaseException:
        close_all(fds)
        raise


def as_row(record: Any, fields: Sequence[str]) -> list[int]:
    return [int(getattr(record, name)) for name in fields]


def close_all(fds: Sequence[int]) -> None:
    for fd in fds:
        try:
            os.close(fd)
        except OSError:
            pass


class Copier:
    """One copier process; every method raises CopierError when it fails or times out."""

    def __init__(self, process: subprocess.Popen[bytes], sock: socket.socket) -> None:
        self._process = process
        self._sock = sock
        self._unread: list[str] = []  # replies owed for requests sent without waiting
        # What the copier maps: the staging's extents (inode, size) and its chunks, as sent.
        self._attached: tuple[tuple[tuple[int, int, int], ...], list[list[int]]] | None = None
        self._awake_on: str | None = None
        # The reply to the last wake sent without waiting, once read (what it found pinned).
        self.last_wake: dict[str, Any] | None = None
        self._parent_pid: int | None = None  # set in a forked child: the copier is its parent's
        # One exchange at a time: the keeper asks how far the copier pinned from its own thread, while a
        # move's orders come from the thread that runs the move.
        self._talking = threading.RLock()
        _copiers.add(self)

    @classmethod
    def start(cls) -> Copier:
        ours, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
        env = dict(os.environ)
        package_root = str(Path(__file__).resolve().parents[2])  # the copier imports this flexium
        env["PYTHONPATH"] = os.pathsep.join(p for p in (package_root, env.get("PYTHONPATH", "")) if p)
        try:
            process = subprocess.Popen(
                [sys.executable, "-m", "flexium.engine.fast.host_copier_process", "--socket", str(theirs.fileno())]
                + (["--trace"] if log.isEnabledFor(logging.DEBUG) else []),
                pass_fds=[theirs.fileno()],
                env=env,
                stdin=subprocess.DEVNULL,
                stdout=subprocess.DEVNULL,
            )
        except OSError as exc:
            ours.close()
            raise CopierError(f"could not start the copier process: {exc}") from exc
        finally:
            theirs.close()
        copier = cls(process, ours)
        copier._exchange({"op": "hello"}, timeout=START_TIMEOUT_S)
        return copier

    @property
    def pid(self) -> int:
        return self._process.pid

    @property
    def awake_on(self) -> str | None:
        """The GPU it holds a context on (woken there), None while asleep."""
        return self._awake_on

    @awake_on.setter
    def awake_on(self, uuid: str | None) -> None:
        # Awake, its context may sit on the job's GPU: should the job run out of GPU memory, the
        # allocator kills it (csrc/gpu_memory_yield.h); the staged bytes are the job's memfds.
        from flexium import _C

        self._awake_on = uuid
        if uuid is not None:
            _C.set_gpu_memory_yielder(self.pid)
        elif _C.gpu_memory_yielder() == self.pid:
            _C.set_gpu_memory_yielder(0)

    def alive(self) -> bool:
        return self._parent_pid is None and self._process.poll() is None

    def attach(self, layout: _C.HostStagingLayout, *, written: bool = False) -> None:
        """Maps the staging's extents (memfd, size) and touches their pages; again only when they
        changed. A staging the job grew (extents and chunks added after those it had) is extended:
        what the copier pinned stays pinned, so a pause after a growth pins only what is new.
        `written` (a staging made at a pause's safe point): the new memfds are not touched, their
        pages made by the copy to host writing them (``written_staging_enabled``)."""
        extents = layout.extents
        # The fd's number too: the driver's exported fds may all share one inode.
        key = tuple((fd, os.fstat(fd).st_ino, size) for fd, size in extents)
        chunks = [as_row(chunk, CHUNK_FIELDS) for chunk in layout.chunks]
        before = self._attached
        if before is not None and before == (key, chunks):
            return
        op, first_extent, first_chunk = "attach", 0, 0
        if before is not None and key[: len(before[0])] == before[0] and chunks[: len(before[1])] == before[1]:
            op, first_extent, first_chunk = "extend", len(before[0]), len(before[1])
        added = extents[first_extent:]
        self._exchange(
            {
                "op": op,
                "sizes": [size for _fd, size in added],
                "chunks": chunks[first_chunk:],
                "driver_made": list(layout.driver_made[first_extent:]),
                "written": [written and not made for made in layout.driver_made[first_extent:]],
            },
            [fd for fd, _size in added],
            timeout=START_TIMEOUT_S + sum(size for _fd, size in added) / SLOWEST_BYTES_PER_S,  # it touches the pages
        )
        self._attached = (key, chunks)

    def make_host(self, nbytes: int, piece: int) -> list[tuple[int, int]]:
        """Host memory made by the driver in the copier, awake (fact `driver-made-host-memory`): (fd, size)
        pieces of at most `piece` bytes, the caller's fds. Raises CopierError when it cannot."""
        timeout = START_TIMEOUT_S + nbytes / MAKING_BYTES_PER_S
        with self._turn(timeout):
            self._send({"op": "make_host", "bytes": nbytes, "piece": piece})
            reply, fds = self._own_reply("make_host", timeout)
        sizes = [int(size) for size in reply.get("sizes", [])]
        if len(sizes) != len(fds):
            close_all(fds)
            raise CopierError(f"the copier sent {len(fds)} fds for {len(sizes)} pieces of host memory")
        return list(zip(fds, sizes, strict=True))

    def wake(self, uuid: str, *, wait: bool, pause_ms: int = 0, bytes_to_pin: int = 0) -> dict[str, Any]:
        """Takes a context on the GPU `uuid` and pins the staging; without `wait` returns at once
        (the pinning goes on while the caller restores) and the reply is read later."""
        message = {"op": "wake", "uuid": uuid, "wait": wait, "pause_ms": pause_ms}
        self.awake_on = uuid
        if not wait:
            with self._turn(START_TIMEOUT_S):  # its reply is owed before any other's
                self.last_wake = None
                self._send(message)
                self._unread.append("wake")
            return {}
        return self._exchange(message, timeout=START_TIMEOUT_S + bytes_to_pin / SLOWEST_BYTES_PER_S)

    def copy(
        self,
        to_host: bool,
        order: _C.HostOrder,
        *,
        then_sleep: bool = True,
        pin_rest_pause_ms: int = 0,
        write_untouched: bool = False,
    ) -> dict[str, Any]:
        """Runs one order; with `then_sleep` the copier goes to sleep right after it (its reply read
        by asleep()), else it stays awake with the staging pinned (kept for the next pause), and
        pins in the background what the copies did not use, `pin_rest_pause_ms` between chunks.
        `write_untouched`: a copy to host writes the memfd chunks not touched yet (_C.HostCopier.copy)."""
        segments = order.segments
        message = {
            "op": "copy",
            "to_host": to_host,
            "write_untouched": write_untouched,
            "sizes": [size for _fd, size in segments],
            "pieces": [as_row(piece, PIECE_FIELDS) for piece in order.pieces],
            "then_sleep": then_sleep,
            "pin_rest_pause_ms": None if then_sleep else pin_rest_pause_ms,
        }
        timeout = START_TIMEOUT_S + 2 * order.bytes / SLOWEST_BYTES_PER_S
        with self._turn(timeout):  # the reply of its sleep is owed before any other's
            reply = self._exchange(message, [fd for fd, _size in segments], timeout=timeout)
            if then_sleep:
                self._unread.append("sleep")
                self.awake_on = None
        return reply

    def fill(self, order: _C.FillOrder, *, then_sleep: bool, pin_rest_pause_ms: int = 0) -> None:
        """Orders the resume's copy back made by the copier while the job restores: new memory on the
        GPU it is awake on, filled from the staging; returns at once (filled() reads the reply).
        `then_sleep` and `pin_rest_pause_ms` as for copy()."""
        message = {
            "op": "fill",
            "sizes": [int(segment.size) for segment in order.segments],
            "pieces": [as_row(piece, PIECE_FIELDS) for piece in order.pieces],
            "then_sleep": then_sleep,
            "pin_rest_pause_ms": None if then_sleep else pin_rest_pause_ms,
        }
        with self._turn(START_TIMEOUT_S):
            self._send(message)
            self._unread.append("fill")
            if then_sleep:
                self._unread.append("sleep")

    def filled(self, order: _C.FillOrder) -> Filled:
        """The reply to the fill ordered last, with its fds (one per segment of `order`, the caller's).
        Raises CopierError when the fill failed or no answer came in time; its fds are closed then."""
        timeout = START_TIMEOUT_S + 2 * order.bytes / SLOWEST_BYTES_PER_S
        with self._turn(timeout):
            return self._filled(timeout)

    def _filled(self, timeout: float) -> Filled:
        refused = self._read_owed(timeout, stop_at="fill")  # the wake before it failed: the fill's reply still comes
        if not self._unread:
            raise refused or CopierError("no fill was ordered")
        self._unread.pop(0)
        if self._unread[:1] == ["sleep"]:
            self.awake_on = None  # it sleeps right after the fill, whether it worked or not
        try:
            reply, fds = self._reply_with_fds("fill", timeout)
        except CopierRefused as exc:
            if refused is None:
                raise
            raise refused from exc  # the first failure says why
        if refused is not None:
            close_all(fds)
            raise refused
        return Filled(reply, fds)

    def pinning(self) -> dict[str, Any] | None:
        """How far its background pinning is: "pinned" bytes, "pinning" (still under way), "pinner" (how
        the last one ended). None while another exchange holds the copier past PINNING_WAIT_S (a move's
        copies) or a resume's fill is under way (its reply, with the memory's fds, is filled()'s to read,
        not another asker's to pass over): asked again later."""
        if self._parent_pid is not None or not self._talking.acquire(timeout=PINNING_WAIT_S):
            return None
        try:
            if "fill" in self._unread:
                return None
            return self._exchange({"op": "pinning"}, timeout=START_TIMEOUT_S)
        finally:
            self._talking.release()

    def sleep(self) -> None:
        """Unpins the staging and lets go of its GPU context now (the staging stays mapped)."""
        self._exchange({"op": "sleep"}, timeout=START_TIMEOUT_S)
        self.awake_on = None

    def asleep(self, timeout: float) -> None:
        """Returns once the copier holds nothing on any GPU: the sleep owed after an order is read, or,
        awake with none owed (it stayed awake to keep the staging), it is put to sleep now."""
        with self._turn(timeout):
            if "sleep" in self._unread:
                refused = self._read_owed(timeout, stop_at="sleep")
                self._read_unread(timeout)  # the sleep's reply: its failure is the copier's
                if refused is not None:
                    raise CopierError(f"the copier failed before its sleep: {refused}") from refused
            elif self.awake_on is not None:
                self.sleep()

    def detach(self) -> None:
        """Unmaps the staging (its memory goes once the job unmaps it too); the copier stays,
        asleep, for the next pause."""
        self._exchange({"op": "detach"}, timeout=START_TIMEOUT_S)
        self._attached = None
        self.awake_on = None

    def close(self) -> None:
        """Asks the copier to exit and waits for it; kills it if it does not."""
        if self._parent_pid is not None:
            return
        self.awake_on = None
        try:
            send(self._sock, {"op": "quit"})
        except OSError:
            pass
        try:
            self._process.wait(timeout=EXIT_TIMEOUT_S)
        except subprocess.TimeoutExpired:
            self.kill()
        self._sock.close()

    def kill(self) -> None:
        if self._parent_pid is not None:
            return
        self.awake_on = None
        if self.alive():
            self._process.kill()
        try:
            self._process.wait(timeout=EXIT_TIMEOUT_S)
        except subprocess.TimeoutExpired:
            log.warning("the copier process %d did not exit after SIGKILL", self._process.pid)
        self._sock.close()

    # ---- the exchange ------------------------------------------------------------------------

    def _let_go_after_fork(self) -> None:
        from flexium import _C

        self._parent_pid = os.getppid()
        self._sock.close()
        self._awake_on = None
        _C.set_gpu_memory_yielder(0)  # the copier is the parent's to give up, never a child's

    @contextmanager
    def _turn(self, timeout: float) -> Iterator[None]:
        """Holds the socket for one exchange; another thread's must end within `timeout`."""
        if self._parent_pid is not None:
            raise CopierError(f"this process was forked from process {self._parent_pid}, whose copier this is")
        if not self._talking.acquire(timeout=timeout):
            raise CopierError(f"the copier stayed busy with another exchange for {timeout:.0f} s")
        try:
            yield
        finally:
            self._talking.release()

    def _send(self, message: dict[str, Any], fds: Sequence[int] = ()) -> None:
        """Within the caller's turn (_turn), which its reply belongs to."""
        try:
            self._sock.settimeout(START_TIMEOUT_S)
            send(self._sock, message, fds)
        except OSError as exc:
            raise CopierError(f"could not send '{message['op']}' to the copier: {exc}") from exc

    def _exchange(self, message: dict[str, Any], fds: Sequence[int] = (), *, timeout: float) -> dict[str, Any]:
        with self._turn(timeout):
            self._send(message, fds)
            reply, reply_fds = self._own_reply(str(message["op"]), timeout)
            close_all(reply_fds)
            return reply

    def _read_owed(self, timeout: float, stop_at: str | None = None) -> CopierRefused | None:
        """Reads the replies owed for requests sent without waiting (up to `stop_at`'s), all of them even
        when one was a refusal; the first refusal."""
        refused: CopierRefused | None = None
        while self._unread and self._unread[0] != stop_at:
            try:
                self._read_unread(timeout)
            except CopierRefused as exc:
                refused = refused or exc
        return refused

    def _own_reply(self, what: str, timeout: float) -> tuple[dict[str, Any], list[int]]:
        """The reply to the request just sent, read after those owed before it, so that none is left for
        the next exchange to take as its own. A refusal among those owed (a wake that took no context)
        means the copier is not in the state the request assumed: a CopierError, not a refusal of it."""
        refused = self._read_owed(timeout)
        try:
            reply, fds = self._reply_with_fds(what, timeout)
        except CopierRefused:
            if refused is None:
                raise
            reply, fds = {}, []
        if refused is not None:
            close_all(fds)
            raise CopierError(f"the copier failed before '{what}': {refused}") from refused
        return reply, fds

    def _read_unread(self, timeout: float) -> dict[str, Any]:
        if not self._unread:
            return {}
        what = self._unread.pop(0)
        try:
            reply = self._reply(what, timeout)
        except CopierRefused:
            if what == "wake":
                self.awake_on = None  # it took no context: the next need wakes it again
            raise
        if what == "wake":
            self.last_wake = reply
        return reply

    def _reply(self, what: str, timeout: float) -> dict[str, Any]:
        reply, fds = self._reply_with_fds(what, timeout)
        close_all(fds)
        return reply

    def _reply_with_fds(self, what: str, timeout: float) -> tuple[dict[str, Any], list[int]]:
        deadline = time.monotonic() + timeout
        try:
            self._sock.settimeout(max(0.001, deadline - time.monotonic()))
            reply, fds = receive(self._sock)
        except (OSError, ConnectionError, ValueError) as exc:
            code = self._process.poll()
            state = f"it exited with status {code}" if code is not None else f"no answer within {timeout:.0f} s"
            raise CopierError(f"the copier failed at '{what}': {type(exc).__name__}: {exc} ({state})") from exc
        if not reply.get("ok"):
            close_all(fds)
            raise CopierRefused(f"the copier failed at '{what}': {reply.get('error', 'no reason given')}")
        return reply, fds


_copiers: weakref.WeakSet[Copier] = weakref.WeakSet()


def _let_go_after_fork() -> None:
    for copier in list(_copiers):
        copier._let_go_after_fork()


os.register_at_fork(after_in_child=_let_go_after_fork)
