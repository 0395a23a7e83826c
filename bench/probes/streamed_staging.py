"""Where a pause that makes its host staging at its safe point (stop first, then stream) loses its
time: fact `streamed-staging-pace`, issue 39 item 2.

    python bench/probes/streamed_staging.py [--sizes 16,64] [--files 8,16] [--ways serial,same,child]
                                            [--timeout 240] [--json out.json]

Each way, file count and size is a fresh process with a bare driver context on cuda:0 that maps
SIZE GiB as FILES memfds (host_staging.Staging), touches each file from a thread of its own, chunk by
chunk (MADV_POPULATE_WRITE per 256 MiB), registers every chunk (cuMemHostRegister) in the copier's
order (the files' chunks in turn) and copies a 1 GiB device buffer into it (D2H, queued on one
stream after each chunk's registration). Ways:
  serial  touch everything, then register and copy (the rates of each alone);
  same    the touching threads run in this process beside the registering thread, which waits for
          each chunk to be touched (the copier's pipeline since issue 39 item 2);
  child   the touching threads run in a child process forked before the driver is loaded, which
          maps the same files (the job's process could touch them: it maps them too); progress
          comes through shared memory.
Prints a row per part: touching's end, registering (and of it waiting for the touching), the copies'
end, each from the start, and the rates. Needs one NVIDIA GPU. Sizes are GiB (2^30 bytes),
bandwidths GB/s (10^9).
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
from cuda_driver import COPY_PIECE, CU_MEMHOSTREGISTER_PORTABLE, Driver  # noqa: E402
from host_staging import CHUNK, GIB, HUGE, MADV_POPULATE_WRITE, Libc, Staging, fmt, gbps, host_settings, now, round_up  # noqa: E402
from tables import print_table  # noqa: E402

WAYS = ("serial", "same", "child")


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


def touch_files(libc: Libc, per_file: list[list[tuple[int, int]]], progress: Any) -> None:
    """A thread per file faults its chunks in, in order, counting each in progress[file]."""

    def work(f: int) -> None:
        for addr, size in per_file[f]:
            if libc.lib.madvise(addr, size, MADV_POPULATE_WRITE) != 0:
                libc.lib.memset(addr, 0, size)
            progress[f] += 1

    threads = [threading.Thread(target=work, args=(f,)) for f in range(len(per_file))]
    for t in threads:
        t.start()
    for t in threads:
        t.join()


def measure(way: str, files: int, gib: float, result: dict[str, Any]) -> None:
    size = round_up(int(gib * GIB), HUGE)
    libc = Libc()
    staging = Staging(libc, f"memfd{files}" if files > 1 else "memfd", size)
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
            touch_files(libc, per_file, progress)
            child_touched.value = now()
            os._exit(0)
    drv = Driver()
    drv.primary_context(0)
    device = ctypes.c_uint64()
    drv.call("cuMemAlloc", ctypes.byref(device), GIB)
    stream = drv.stream()
    started = now()
    touched_at: list[float] = []
    if way == "child":
        os.write(go_write, b"g")
    elif way == "same":

        def touch_here() -> None:
            touch_files(libc, per_file, progress)
            touched_at.append(now())

        toucher = threading.Thread(target=touch_here)
        toucher.start()
    else:
        touch_files(libc, per_file, progress)
        touched_at.append(now())
    pin_s = wait_s = 0.0
    device_offset = 0
    for f, index, (addr, chunk) in copier_order(per_file):
        waited = now()
        while progress[f] <= index:
            time.sleep(0.0002)
        pinning = now()
        wait_s += pinning - waited
        drv.call("cuMemHostRegister", addr, chunk, CU_MEMHOSTREGISTER_PORTABLE)
        pin_s += now() - pinning
        offset = 0
        while offset < chunk:
            n = min(COPY_PIECE, chunk - offset, GIB - device_offset)
            drv.call("cuMemcpyDtoHAsync", addr + offset, int(device.value) + device_offset, n, stream)
            offset += n
            device_offset = (device_offset + n) % GIB
    pinned_at = now()
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
        ok=True,
        touched_s=touched_at[0] - started,
        pinned_s=pinned_at - started,
        pin_s=pin_s,
        wait_s=wait_s,
        done_s=copied_at - started,
        bytes=size,
    )
    for addr, _ in staging.chunks:
        drv.call("cuMemHostUnregister", addr)
    staging.unmap()


def row(r: dict[str, Any]) -> tuple[str, ...]:
    way, files, gib = r["part"].split(":")
    if not r.get("ok"):
        return (way, files, gib, *["-"] * 7, f"FAILED: {r.get('error')}"[:60])
    size = r["bytes"]
    return (
        way,
        files,
        gib,
        fmt(r["touched_s"], 2),
        fmt(r["pin_s"], 2),
        fmt(r["wait_s"], 2),
        fmt(r["done_s"], 2),
        fmt(gbps(size, r["touched_s"]), 1),
        fmt(gbps(size, r["pin_s"]), 1),
        fmt(gbps(size, r["done_s"]), 1),
        "",
    )


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--sizes", default="16,64", help="GiB per part, comma-separated (default 16,64)")
    parser.add_argument("--files", default="8,16", help="memfds, each touched by a thread (default 8,16)")
    parser.add_argument("--ways", default=",".join(WAYS), help=f"default {','.join(WAYS)}")
    parser.add_argument("--timeout", type=float, default=240.0, help="seconds per part (default 240)")
    parser.add_argument("--json", help="write every part's result here")
    parser.add_argument("--part", help=argparse.SUPPRESS)  # WAY:FILES:GIB, in the part's own process
    args = parser.parse_args()
    if args.part:
        way, files, gib = args.part.split(":")
        return report_part(args.part, lambda result: measure(way, int(files), float(gib), result))
    ways = [w for w in args.ways.split(",") if w]
    unknown = set(ways) - set(WAYS)
    if unknown:
        parser.error(f"unknown ways {', '.join(sorted(unknown))}: choose from {', '.join(WAYS)}")
    print("host:", json.dumps(host_settings()), flush=True)
    parts = [
        f"{way}:{files}:{gib}"
        for gib in (s for s in args.sizes.split(",") if s)
        for files in (f for f in args.files.split(",") if f)
        for way in ways
    ]
    results = run_parts(__file__, parts, args.timeout)
    if args.json:
        Path(args.json).write_text(json.dumps(results, indent=1, default=str))
    print()
    columns = ("way", "files", "GiB", "touched s", "pin s", "of it waiting", "copied s", "touch GB/s", "pin GB/s")
    print_table((*columns, "overall GB/s", "note"), [row(r) for r in results])
    return 0 if all(r.get("ok") for r in results) else 1


if __name__ == "__main__":
    sys.exit(main())
