"""Where a pause that makes its host staging at its safe point (stop first, then stream) loses its
time, and which way of making it would free the GPU sooner: fact `streamed-staging-pace`, issue 39
item 2.

    python bench/probes/streamed_staging.py [--sizes 16,64] [--files 8,16]
                                            [--ways serial,same,child,driver,pageable,written]
                                            [--pin-threads 1] [--touch-grain-mib 256] [--huge-advice 0]
                                            [--make-threads 1,4,16] [--piece-mib 1024] [--bounce-mib 64]
                                            [--timeout 240] [--json out.json]

Each part is a fresh process with a bare driver context on cuda:0 that copies a 1 GiB device buffer
into SIZE GiB of host memory (D2H, queued on one stream, chunk after chunk as each is ready); it
reports the seconds from the start to the last copy's end, which is what a pause that makes its
staging at the safe point spends before the copier can let the GPU go. Ways:
  serial  FILES memfds (host_staging.Staging), touched from a thread per file, then registered
          (cuMemHostRegister per 256 MiB, in the copier's order: the files' chunks in turn) and
          copied: the rates of each alone;
  same    the touching threads run beside the registering, in this process, each chunk registered
          once touched (the copier's pipeline since issue 39 item 2);
  child   the touching threads run in a child process forked before the driver is loaded, which maps
          the same files (the job's process could touch them: it maps them too); progress comes
          through shared memory;
  driver  no memfds: MAKE threads make the host memory with the driver (cuMemCreate on the GPU's host
          NUMA node, pieces of PIECE MiB, mapped and given access for the GPU, exported as POSIX fds
          as the copier's make_host_memory does), each piece copied into once made: whether making it
          from several threads outruns touching and pinning (made from one thread it ran at 2-5 GB/s,
          fact `driver-made-host-memory`), so that a staging made at the safe point need not be memfds.
  pageable  FILES memfds, untouched, nothing pinned: a thread per file copies its chunks from the GPU
          into its file (cuMemcpyDtoHAsync to pageable memory on a stream of the thread's own, each
          chunk synchronised), the driver copying through its own pinned buffers and the thread faulting
          the pages in: whether that outruns touching and pinning once the unpinning, which the copier
          does before its context may go and the GPU is free, is counted too ("unpin s").
  written FILES memfds, untouched, nothing of them pinned: a thread per file copies each piece from
          the GPU into one of two pinned buffers of its own (BOUNCE MiB each, made when it starts and
          counted: "ready s") and writes the other, copied before, into its file with pwrite, which
          makes the file's pages as it fills them (no zeroing, no page faults: shmem skips clearing a
          page a write fills whole), so the pages are made once instead of touched, then pinned,
          then unpinned.
Knobs of the memfd ways, each a comma-separated list that multiplies the parts:
  --pin-threads N      threads registering the chunks (each takes the next chunk in the copier's
                       order and waits for it to be touched); the copies still run in order;
  --touch-grain-mib M  bytes per MADV_POPULATE_WRITE call of a touching thread (the copier touches
                       a whole 256 MiB chunk per call, holding the process's mmap lock for reading
                       meanwhile, which a registration may wait for);
  --huge-advice 0|1    MADV_HUGEPAGE on the files' mappings, as the copier and the job map them
                       (shmem huge pages `never` ignores it; whether it costs anything is the question).
Prints a row per part: when the memory was ready (touched, or made), when the last chunk was pinned
(or mapped), the thread-seconds inside the registering (or making) calls and of it waiting for the
touching, the copies' end, each from the start, the seconds unregistering the chunks from one thread
took after the copies (memfd ways), and the rates. Needs one NVIDIA GPU. Sizes are GiB
(2^30 bytes), bandwidths GB/s (10^9).
"""

from __future__ import annotations

import argparse
import ctypes
import json
import mmap
import os
import sys
import threading
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # tables.py in bench/

from children import report_part, run_parts  # noqa: E402
from cuda_driver import (  # noqa: E402
    COPY_PIECE,
    CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR,
    CU_MEM_LOCATION_TYPE_HOST_NUMA,
    CU_MEMHOSTREGISTER_PORTABLE,
    Driver,
)
from host_cumem_staging import access, numa_node  # noqa: E402
from host_staging import (  # noqa: E402
    CHUNK,
    GIB,
    HUGE,
    MADV_HUGEPAGE,
    MADV_POPULATE_WRITE,
    MAP_ANONYMOUS,
    MAP_PRIVATE,
    PROT_READ,
    PROT_WRITE,
    Libc,
    Staging,
    fmt,
    gbps,
    host_settings,
    now,
    round_up,
)
from tables import print_table  # noqa: E402

MEMFD_WAYS = ("serial", "same", "child")
WAYS = (*MEMFD_WAYS, "driver", "pageable", "written")
MIB = 1 << 20


def part_name(**knobs: Any) -> str:
    return ",".join(f"{k}={v}" for k, v in knobs.items())


def parse_part(part: str) -> dict[str, str]:
    return dict(item.split("=", 1) for item in part.split(","))


def file_chunks(staging: Staging) -> list[list[tuple[int, int]]]:
    """Each file's chunks, in the order Staging laid them out."""
    out = []
    for addr, mapped in staging.maps:
        base, length = round_up(addr, HUGE), mapped - HUGE
        out.append([(base + off, min(CHUNK, length - off)) for off in range(0, length, CHUNK)])
    return out


def copier_order(per_file: list[list[tuple[int, int]]]) -> list[tuple[int, int, tuple[int, int]]]:
    """(file, index in its file, chunk): the files' chunks in turn, as the copier fills them."""
    longest = max(len(chunks) for chunks in per_file)
    return [(f, i, chunks[i]) for i in range(longest) for f, chunks in enumerate(per_file) if i < len(chunks)]


def touch_files(libc: Libc, per_file: list[list[tuple[int, int]]], progress: Any, grain: int) -> None:
    """A thread per file faults its chunks in, in order, `grain` bytes per call, counting each chunk
    in progress[file]."""

    def work(f: int) -> None:
        for addr, size in per_file[f]:
            for offset in range(0, size, grain):
                n = min(grain, size - offset)
                if libc.lib.madvise(addr + offset, n, MADV_POPULATE_WRITE) != 0:
                    libc.lib.memset(addr + offset, 0, n)
            progress[f] += 1

    threads = [threading.Thread(target=work, args=(f,)) for f in range(len(per_file))]
    for t in threads:
        t.start()
    for t in threads:
        t.join()


class Pinners:
    """`count` threads registering the chunks of `order` (each takes the next one and waits for its
    file's toucher to reach it); copies wait for `pinned(k)`."""

    def __init__(self, drv: Driver, order: list[tuple[int, int, tuple[int, int]]], progress: Any, count: int) -> None:
        self.drv, self.order, self.progress = drv, order, progress
        self.done = [False] * len(order)
        self.cv = threading.Condition()
        self.next = 0
        self.pin_s = self.wait_s = 0.0
        self.last_at = 0.0
        self.error: BaseException | None = None
        self.threads = [threading.Thread(target=self._work) for _ in range(count)]

    def start(self) -> None:
        for t in self.threads:
            t.start()

    def _work(self) -> None:
        try:
            self.drv.call("cuCtxSetCurrent", ctypes.c_void_p(self.drv.context))
            while True:
                with self.cv:
                    if self.next >= len(self.order) or self.error is not None:
                        return
                    k = self.next
                    self.next += 1
                f, index, (addr, size) = self.order[k]
                waited = now()
                while self.progress[f] <= index:
                    time.sleep(0.0002)
                pinning = now()
                self.drv.call("cuMemHostRegister", addr, size, CU_MEMHOSTREGISTER_PORTABLE)
                ended = now()
                with self.cv:
                    self.wait_s += pinning - waited
                    self.pin_s += ended - pinning
                    self.last_at = max(self.last_at, ended)
                    self.done[k] = True
                    self.cv.notify_all()
        except BaseException as exc:  # the copies' thread raises it
            with self.cv:
                self.error = exc
                self.cv.notify_all()

    def pinned(self, k: int) -> None:
        with self.cv:
            self.cv.wait_for(lambda: self.done[k] or self.error is not None)
            if self.error is not None:
                raise RuntimeError(f"a pinning thread failed: {self.error}")

    def join(self) -> None:
        for t in self.threads:
            t.join()


def queue_copies(drv: Driver, addr: int, size: int, device: int, device_offset: int, stream: int) -> int:
    """Queues the copies of the 1 GiB device buffer (wrapping) into [addr, addr+size); the buffer's
    offset after them."""
    offset = 0
    while offset < size:
        n = min(COPY_PIECE, size - offset, GIB - device_offset)
        drv.call("cuMemcpyDtoHAsync", addr + offset, device + device_offset, n, stream)
        offset += n
        device_offset = (device_offset + n) % GIB
    return device_offset


def measure_memfd(way: str, knobs: dict[str, str], result: dict[str, Any]) -> None:
    files, gib = int(knobs["files"]), float(knobs["gib"])
    pin_threads, grain = int(knobs["pin"]), int(float(knobs["grain"]) * MIB)
    size = round_up(int(gib * GIB), HUGE)
    libc = Libc()
    staging = Staging(libc, f"memfd{files}" if files > 1 else "memfd", size)
    if knobs["huge"] == "1":
        for addr, mapped in staging.maps:
            libc.lib.madvise(round_up(addr, HUGE), mapped - HUGE, MADV_HUGEPAGE)
    per_file = file_chunks(staging)
    if len(per_file) != files:
        raise RuntimeError(f"asked for {files} files, Staging made {len(per_file)}")
    shared = mmap.mmap(-1, 8 * files + 8)  # MAP_SHARED | MAP_ANONYMOUS: the child's counts reach us
    progress = (ctypes.c_int64 * files).from_buffer(shared)
    child_touched = ctypes.c_double.from_buffer(shared, 8 * files)  # perf_counter is CLOCK_MONOTONIC: one clock
    go_read, go_write = os.pipe()
    child = 0
    if way == "child":
        child = os.fork()  # before the driver is loaded: the child only faults pages in
        if child == 0:
            os.close(go_write)
            os.read(go_read, 1)
            touch_files(libc, per_file, progress, grain)
            child_touched.value = now()
            os._exit(0)
    drv = Driver()
    drv.primary_context(0)
    device = ctypes.c_uint64()
    drv.call("cuMemAlloc", ctypes.byref(device), GIB)
    stream = drv.stream()
    order = copier_order(per_file)
    pinners = Pinners(drv, order, progress, pin_threads)
    started = now()
    touched_at: list[float] = []
    if way == "child":
        os.write(go_write, b"g")
    elif way == "same":

        def touch_here() -> None:
            touch_files(libc, per_file, progress, grain)
            touched_at.append(now())

        toucher = threading.Thread(target=touch_here)
        toucher.start()
    else:
        touch_files(libc, per_file, progress, grain)
        touched_at.append(now())
    pinners.start()
    device_offset = 0
    try:
        for k, (_f, _index, (addr, chunk)) in enumerate(order):
            pinners.pinned(k)
            device_offset = queue_copies(drv, addr, chunk, device.value, device_offset, stream)
    finally:
        pinners.join()
    drv.stream_sync(stream)
    copied_at = now()
    if way == "child":
        _, status = os.waitpid(child, 0)
        touched_at.append(child_touched.value)
        if status != 0:
            raise RuntimeError(f"the touching child ended with status {status}")
    elif way == "same":
        toucher.join()
    result.update(
        ready_s=touched_at[0] - started,
        pinned_s=pinners.last_at - started,
        pin_s=pinners.pin_s,
        wait_s=pinners.wait_s,
        done_s=copied_at - started,
        bytes=size,
    )
    unpinning = now()
    for _f, _index, (addr, _size) in order:
        drv.call("cuMemHostUnregister", addr)
    result["unpin_s"] = now() - unpinning
    staging.unmap()
    result["ok"] = True


def untouched_files(knobs: dict[str, str]) -> tuple[Libc, Staging, list[list[tuple[int, int]]], Driver, int]:
    """FILES memfds of GIB, untouched, their chunks, and a context on cuda:0 with a 1 GiB device buffer."""
    files, gib = int(knobs["files"]), float(knobs["gib"])
    libc = Libc()
    staging = Staging(libc, f"memfd{files}" if files > 1 else "memfd", round_up(int(gib * GIB), HUGE))
    drv = Driver()
    drv.primary_context(0)
    device = ctypes.c_uint64()
    drv.call("cuMemAlloc", ctypes.byref(device), GIB)
    return libc, staging, file_chunks(staging), drv, device.value


def thread_per_file(files: int, work: Any) -> float:
    """work(f) in a thread per file, together; when they started. Raises the first thread's failure."""
    failed: list[BaseException] = []

    def guarded(f: int) -> None:
        try:
            work(f)
        except BaseException as exc:
            failed.append(exc)

    threads = [threading.Thread(target=guarded, args=(f,)) for f in range(files)]
    started = now()
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    if failed:
        raise RuntimeError(f"a copying thread failed: {failed[0]}")
    return started


def measure_pageable(knobs: dict[str, str], result: dict[str, Any]) -> None:
    """No pinning at all: a thread per file copies its chunks from the GPU straight into the
    untouched memfd (cuMemcpyDtoHAsync to pageable memory on a stream of its own, then synchronised:
    the driver copies through its own pinned buffers and the calling thread faults the pages in), so
    that nothing is left to unpin before the context may go."""
    _libc, staging, per_file, drv, device = untouched_files(knobs)
    ends: list[float] = []

    def work(f: int) -> None:
        drv.call("cuCtxSetCurrent", ctypes.c_void_p(drv.context))
        stream = drv.stream()
        device_offset = (f * COPY_PIECE) % GIB
        for addr, chunk in per_file[f]:
            device_offset = queue_copies(drv, addr, chunk, device, device_offset, stream)
            drv.stream_sync(stream)
        ends.append(now())

    started = thread_per_file(len(per_file), work)
    done = max(ends) - started
    result.update(ready_s=done, pinned_s=0.0, pin_s=0.0, wait_s=0.0, done_s=done, unpin_s=0.0, bytes=staging.size)
    staging.unmap()
    result["ok"] = True


def measure_written(knobs: dict[str, str], result: dict[str, Any]) -> None:
    """Nothing of the files pinned: a thread per file copies from the GPU into two pinned buffers of
    its own in turn and writes each into its file (pwrite) while the next copy runs, so each page of
    the file is made by the write that fills it."""
    libc, staging, per_file, drv, device = untouched_files(knobs)
    bounce = int(float(knobs["bounce"]) * MIB)
    ready: list[float] = []
    ends: list[float] = []
    unpin: list[float] = []

    def work(f: int) -> None:
        drv.call("cuCtxSetCurrent", ctypes.c_void_p(drv.context))
        stream = drv.stream()
        prot, flags = PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS
        buffers = [int(libc.lib.mmap(None, bounce, prot, flags, -1, 0)) for _ in range(2)]
        for buffer in buffers:
            libc.lib.memset(buffer, 0, bounce)
            drv.call("cuMemHostRegister", buffer, bounce, CU_MEMHOSTREGISTER_PORTABLE)
        ready.append(now())
        mapped_at = staging.maps[f][0]
        device_offset = (f * COPY_PIECE) % GIB
        pending: tuple[int, int, int] | None = None  # (buffer, bytes, file offset) copied, not written
        turn = 0
        for addr, chunk in per_file[f]:
            for offset in range(0, chunk, bounce):
                n = min(bounce, chunk - offset)
                buffer = buffers[turn]
                device_offset = queue_copies(drv, buffer, n, device, device_offset, stream)
                if pending is not None:
                    written, length, at = pending
                    os.pwrite(staging.fds[f], (ctypes.c_char * length).from_address(written), at)
                drv.stream_sync(stream)
                pending = (buffer, n, addr + offset - mapped_at)
                turn ^= 1
        if pending is not None:
            written, length, at = pending
            os.pwrite(staging.fds[f], (ctypes.c_char * length).from_address(written), at)
        ends.append(now())
        unpinning = now()
        for buffer in buffers:
            drv.call("cuMemHostUnregister", buffer)
            libc.lib.munmap(buffer, bounce)
        unpin.append(now() - unpinning)

    started = thread_per_file(len(per_file), work)
    result.update(
        ready_s=max(ready) - started,
        pinned_s=0.0,
        pin_s=0.0,
        wait_s=0.0,
        done_s=max(ends) - started,
        unpin_s=max(unpin),
        bytes=staging.size,
    )
    staging.unmap()
    result["ok"] = True


def measure_driver(knobs: dict[str, str], result: dict[str, Any]) -> None:
    threads, gib, piece_mib = int(knobs["make"]), float(knobs["gib"]), float(knobs["piece"])
    drv = Driver()
    drv.primary_context(0)
    numa = numa_node(drv)
    prop = drv.prop(drv.device)
    prop.location.type, prop.location.id = CU_MEM_LOCATION_TYPE_HOST_NUMA, numa
    granularity = drv.granularity(prop)
    piece = round_up(int(piece_mib * MIB), granularity)
    count = -(-int(gib * GIB) // piece)
    size = piece * count
    va = drv.reserve(size)
    device = ctypes.c_uint64()
    drv.call("cuMemAlloc", ctypes.byref(device), GIB)
    stream = drv.stream()
    handles: list[int] = [0] * count
    fds: list[int] = []
    made = [False] * count
    cv = threading.Condition()
    times = {"make_s": 0.0, "last_at": 0.0}
    failed: list[BaseException] = []

    def work(k: int) -> None:
        try:
            drv.call("cuCtxSetCurrent", ctypes.c_void_p(drv.context))
            for i in range(k, count, threads):
                making = now()
                handle = drv.create(piece, prop)
                handles[i] = handle
                drv.map(va + i * piece, piece, handle)
                access(drv, va + i * piece, piece, numa, cpu=False)
                exported = ctypes.c_int(-1)
                drv.call(
                    "cuMemExportToShareableHandle",
                    ctypes.byref(exported),
                    handle,
                    CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR,
                    0,
                )
                ended = now()
                with cv:
                    fds.append(exported.value)
                    times["make_s"] += ended - making
                    times["last_at"] = max(times["last_at"], ended)
                    made[i] = True
                    cv.notify_all()
        except BaseException as exc:  # the copies' thread raises it
            with cv:
                failed.append(exc)
                cv.notify_all()

    makers = [threading.Thread(target=work, args=(k,)) for k in range(threads)]
    started = now()
    for t in makers:
        t.start()
    device_offset = 0
    try:
        for i in range(count):
            with cv:
                while not (made[i] or failed):
                    cv.wait()
                if failed:
                    raise RuntimeError(f"a making thread failed: {failed[0]}")
            device_offset = queue_copies(drv, va + i * piece, piece, device.value, device_offset, stream)
    finally:
        for t in makers:
            t.join()
    drv.stream_sync(stream)
    copied_at = now()
    result.update(
        ready_s=times["last_at"] - started,
        pinned_s=times["last_at"] - started,
        pin_s=times["make_s"],
        wait_s=0.0,
        done_s=copied_at - started,
        bytes=size,
        piece=piece,
    )
    for fd in fds:
        os.close(fd)
    for i, handle in enumerate(handles):
        if handle:
            drv.call("cuMemUnmap", va + i * piece, piece)
            drv.call("cuMemRelease", handle)
    drv.call("cuMemAddressFree", va, size)
    result["ok"] = True


def measure(part: str, result: dict[str, Any]) -> None:
    knobs = parse_part(part)
    if knobs["way"] == "driver":
        measure_driver(knobs, result)
    elif knobs["way"] == "pageable":
        measure_pageable(knobs, result)
    elif knobs["way"] == "written":
        measure_written(knobs, result)
    else:
        measure_memfd(knobs["way"], knobs, result)


def row(r: dict[str, Any]) -> tuple[str, ...]:
    knobs = parse_part(r["part"])
    way = knobs["way"]
    if way == "driver":
        threads, detail = f"{knobs['make']} making", f"pieces {knobs['piece']} MiB"
    elif way == "pageable":
        threads, detail = f"{knobs['files']} files, a copying thread each", "nothing pinned"
    elif way == "written":
        threads, detail = f"{knobs['files']} files, a copying thread each", f"2 x {knobs['bounce']} MiB pinned each"
    else:
        threads = f"{knobs['files']} files, {knobs['pin']} pinning"
        detail = f"grain {knobs['grain']} MiB, huge advice {knobs['huge']}"
    head = (way, threads, detail, knobs["gib"])
    if not r.get("ok"):
        return (*head, *["-"] * 8, f"FAILED: {r.get('error')}"[:60])
    size = r["bytes"]
    pinning = way not in ("pageable", "written")
    return (
        *head,
        fmt(r["ready_s"], 2),
        fmt(r["pinned_s"] if pinning else None, 2),
        fmt(r["pin_s"] if pinning else None, 2),
        fmt(r["wait_s"] if pinning else None, 2),
        fmt(r["done_s"], 2),
        fmt(r.get("unpin_s"), 2),
        fmt(gbps(size, r["pinned_s"]), 1),
        fmt(gbps(size, r["done_s"]), 1),
        "",
    )


def listed(text: str) -> list[str]:
    return [item for item in text.split(",") if item]


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--sizes", default="16,64", help="GiB per part, comma-separated (default 16,64)")
    parser.add_argument("--files", default="8,16", help="memfds, each touched by a thread (default 8,16)")
    parser.add_argument(
        "--ways", default=",".join(MEMFD_WAYS), help=f"of {','.join(WAYS)} (default {','.join(MEMFD_WAYS)})"
    )
    parser.add_argument("--pin-threads", default="1", help="memfd ways: threads registering (default 1)")
    parser.add_argument("--touch-grain-mib", default="256", help="memfd ways: MiB per touching call (default 256)")
    parser.add_argument("--huge-advice", default="0", help="memfd ways: MADV_HUGEPAGE on the files, 0 or 1 (default 0)")
    parser.add_argument("--make-threads", default="1,4,16", help="way driver: threads making (default 1,4,16)")
    parser.add_argument("--piece-mib", default="1024", help="way driver: MiB per piece made (default 1024)")
    parser.add_argument("--bounce-mib", default="64", help="way written: MiB per pinned buffer (default 64)")
    parser.add_argument("--timeout", type=float, default=240.0, help="seconds per part (default 240)")
    parser.add_argument("--json", help="write every part's result here")
    parser.add_argument("--part", help=argparse.SUPPRESS)  # way=...,gib=...: in the part's own process
    args = parser.parse_args()
    if args.part:
        return report_part(args.part, lambda result: measure(args.part, result))
    ways = listed(args.ways)
    unknown = set(ways) - set(WAYS)
    if unknown:
        parser.error(f"unknown ways {', '.join(sorted(unknown))}: choose from {', '.join(WAYS)}")
    if not set(listed(args.huge_advice)) <= {"0", "1"}:
        parser.error("--huge-advice takes 0, 1 or both")
    print("host:", json.dumps(host_settings()), flush=True)
    parts = []
    for gib in listed(args.sizes):
        for way in ways:
            if way == "driver":
                parts += [
                    part_name(way=way, gib=gib, make=threads, piece=piece)
                    for threads in listed(args.make_threads)
                    for piece in listed(args.piece_mib)
                ]
                continue
            if way in ("pageable", "written"):  # a copying thread per file; written: its buffers' size
                bounces: list[dict[str, str]] = (
                    [{"bounce": b} for b in listed(args.bounce_mib)] if way == "written" else [{}]
                )
                parts += [
                    part_name(way=way, gib=gib, files=files, **bounce)
                    for files in listed(args.files)
                    for bounce in bounces
                ]
                continue
            parts += [
                part_name(way=way, gib=gib, files=files, pin=pin, grain=grain, huge=huge)
                for files in listed(args.files)
                for pin in listed(args.pin_threads)
                for grain in listed(args.touch_grain_mib)
                for huge in listed(args.huge_advice)
            ]
    results = run_parts(__file__, parts, args.timeout)
    if args.json:
        Path(args.json).write_text(json.dumps(results, indent=1, default=str))
    print()
    columns = (
        "way",
        "threads",
        "how",
        "GiB",
        "ready s",
        "pinned s",
        "in calls s",
        "of it waiting",
        "copied s",
        "unpin s",
    )
    print_table((*columns, "pinned GB/s", "overall GB/s", "note"), [row(r) for r in results])
    return 0 if all(r.get("ok") for r in results) else 1


if __name__ == "__main__":
    sys.exit(main())
