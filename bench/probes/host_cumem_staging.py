"""Whether a pause's staging could be host memory the driver allocates (cuMemCreate on the host NUMA
node, exported as POSIX fds), which stays pinned with no CUDA context alive, so that a resume need not
pin again (issue 39 item 1: fact `resume-paced-by-pinning` says pinning memfds paces it).

    python bench/probes/host_cumem_staging.py [--sizes 16,64] [--piece-gib 2] [--timeout 300]

Per size, three processes in turn, the fds passed between them (SCM_RIGHTS); this process holds the
fds in between and uses no CUDA:
- maker: a context on cuda:0; SIZE GiB as host allocations of PIECE GiB (create, map, access for the
  GPU and the CPU: each timed); copies GPU -> host into it (the pause's direction) and back; fills
  each piece with a byte of its own; exports the fds, sends them and exits (its context gone).
- job: holds the fds only (no import) beside a context with 1 GiB of its own, checkpoints and
  restores itself through the driver, then uses its context again: does a process holding such fds
  survive the checkpoint (fact `cumem-host-memory-unrestorable` is about such memory *mapped*)?
- copier: a fresh context (as the copier's wake takes one), imports and maps the fds (timed: what a
  resume would pay instead of pinning), copies host -> GPU at what rate, checks every piece's byte,
  then does it all a second time.
Between them it reads NVML's memory used on GPU 0 (what a pause must leave free) and the host's
MemAvailable. Sizes are GiB (2^30 bytes), bandwidths GB/s (10^9).
"""

from __future__ import annotations

import argparse
import ctypes
import json
import os
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # tables.py in bench/

from children import report_part  # noqa: E402
from cuda_driver import (  # noqa: E402
    CU_DEVICE_ATTRIBUTE_HOST_NUMA_ID,
    CU_MEM_ACCESS_FLAGS_PROT_READWRITE,
    CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR,
    CU_MEM_LOCATION_TYPE_HOST_NUMA,
    CUmemAccessDesc,
    Driver,
)
from host_staging import GIB, fmt, gbps, host_settings, now  # noqa: E402
from tables import print_table  # noqa: E402

PIECE_COPY = 256 << 20
THREADS = 8


def numa_node(drv: Driver) -> int:
    value = ctypes.c_int(-1)
    drv.call("cuDeviceGetAttribute", ctypes.byref(value), CU_DEVICE_ATTRIBUTE_HOST_NUMA_ID, drv.device)
    return max(value.value, 0)


def access(drv: Driver, va: int, size: int, numa: int, cpu: bool = True) -> str:
    """Access for the GPU and the CPU (`cpu`), else for the GPU alone; which it got, and why not the CPU."""
    descs = (CUmemAccessDesc * 2)()
    descs[0].location.type, descs[0].location.id = 1, drv.device  # the GPU
    descs[1].location.type, descs[1].location.id = CU_MEM_LOCATION_TYPE_HOST_NUMA, numa  # the CPU
    for d in descs:
        d.flags = CU_MEM_ACCESS_FLAGS_PROT_READWRITE
    if not cpu:
        drv.call("cuMemSetAccess", va, size, descs, 1)
        return "gpu"
    try:
        drv.call("cuMemSetAccess", va, size, descs, 2)
        return "gpu+cpu"
    except RuntimeError as exc:
        drv.call("cuMemSetAccess", va, size, descs, 1)
        return f"gpu ({exc})"


def access_pieces(drv: Driver, va: int, piece: int, count: int, numa: int, k: int) -> None:
    drv.call("cuCtxSetCurrent", ctypes.c_void_p(drv.context))
    for i in range(k, count, THREADS):
        access(drv, va + i * piece, piece, numa, cpu=False)


def unmap_pieces(drv: Driver, va: int, piece: int, count: int, k: int) -> None:
    drv.call("cuCtxSetCurrent", ctypes.c_void_p(drv.context))
    for i in range(k, count, THREADS):
        drv.call("cuMemUnmap", va + i * piece, piece)


def copy_all(
    drv: Driver, dst: int, src: int, size: int, device: int, to_device: bool, stream: int, call: str = "cuMemcpyAsync"
) -> float:
    """Copies between the host range and a 1 GiB device buffer (wrapping), per 256 MiB, with `call`
    (cuMemcpyAsync, cuMemcpyDtoDAsync: the host range as a device address, or cuMemcpyHtoDAsync: as a
    host pointer); seconds."""
    started = now()
    for offset in range(0, size, PIECE_COPY):
        n = min(PIECE_COPY, size - offset)
        dev = device + offset % GIB
        if to_device:
            drv.call(call, dev, src + offset, n, stream)
        else:
            drv.call(call, dst + offset, dev, n, stream)
    drv.stream_sync(stream)
    return now() - started


def maker(sock: socket.socket, gib: float, piece_gib: float, result: dict[str, Any]) -> None:
    drv = Driver()
    started = now()
    drv.primary_context(0)
    result["context_s"] = now() - started
    numa = numa_node(drv)
    prop = drv.prop(drv.device)
    prop.location.type, prop.location.id = CU_MEM_LOCATION_TYPE_HOST_NUMA, numa
    result["numa"], result["granularity"] = numa, drv.granularity(prop)
    piece = int(piece_gib * GIB)
    count = int(gib / piece_gib)
    size = piece * count
    started = now()
    handles = [drv.create(piece, prop) for _ in range(count)]
    result["create_s"] = now() - started
    started = now()
    va = drv.reserve(size)
    for i, h in enumerate(handles):
        drv.map(va + i * piece, piece, h)
    result["map_s"] = now() - started
    started = now()
    result["access"] = access(drv, va, size, numa)
    result["access_s"] = now() - started
    device = ctypes.c_uint64()
    drv.call("cuMemAlloc", ctypes.byref(device), GIB)
    stream = drv.stream()
    result["d2h_first_gbps"] = gbps(size, copy_all(drv, va, 0, size, device.value, False, stream))
    result["d2h_gbps"] = gbps(size, copy_all(drv, va, 0, size, device.value, False, stream))
    result["h2d_gbps"] = gbps(size, copy_all(drv, 0, va, size, device.value, True, stream))
    for i in range(count):  # each piece's own byte, written by the GPU
        drv.call("cuMemsetD8", device.value, (i + 1) & 0xFF, GIB)
        drv.call("cuCtxSynchronize")
        copy_all(drv, va + i * piece, 0, piece, device.value, False, stream)
    if result["access"] == "gpu+cpu":
        result["cpu_reads_byte"] = ctypes.string_at(va + piece + 12345, 1)[0]  # piece 1's, by the CPU
    fds = []
    for h in handles:
        exported = ctypes.c_int(-1)
        drv.call("cuMemExportToShareableHandle", ctypes.byref(exported), h, CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR, 0)
        fds.append(exported.value)
    socket.send_fds(sock, [json.dumps({"piece": piece, "count": count}).encode()], fds)
    for fd in fds:
        os.close(fd)
    started = now()
    drv.call("cuMemUnmap", va, size)
    for h in handles:
        drv.call("cuMemRelease", h)
    drv.call("cuDevicePrimaryCtxReset", drv.device)
    result["release_and_reset_s"] = now() - started
    result["ok"] = True


def job(fds: list[int], result: dict[str, Any]) -> None:
    drv = Driver()
    drv.primary_context(0)
    mine = ctypes.c_uint64()
    drv.call("cuMemAlloc", ctypes.byref(mine), GIB)
    drv.call("cuMemsetD8", mine.value, 7, GIB)
    drv.call("cuCtxSynchronize")
    steps: list[str] = []

    def drive() -> None:
        pid = os.getpid()
        for name in ("Lock", "Checkpoint", "Restore", "Unlock"):
            started = now()
            code = drv.fns[f"cuCheckpointProcess{name}"](pid, None)
            steps.append(f"{name.lower()} {code} {now() - started:.3f}s")
            print("job:", steps[-1], file=sys.stderr, flush=True)
            if code:
                return

    thread = threading.Thread(target=drive)
    thread.start()
    thread.join()
    result["steps"] = steps
    if all(" 0 " in s for s in steps):
        out = ctypes.create_string_buffer(16)
        drv.call("cuMemsetD8", mine.value, 9, 16)
        drv.call("cuCtxSynchronize")
        drv.fns["cuMemcpyAsync"](ctypes.addressof(out), mine.value, 16, None)
        drv.call("cuCtxSynchronize")
        result["after_restore_byte"] = out.raw[0]
    result["fds_held"] = len(fds)
    result["ok"] = True


def copier(fds: list[int], meta: dict[str, int], result: dict[str, Any]) -> None:
    drv = Driver()
    started = now()
    drv.primary_context(0)
    result["context_s"] = now() - started
    numa = numa_node(drv)
    piece, count = meta["piece"], meta["count"]
    size = piece * count
    device = ctypes.c_uint64()
    drv.call("cuMemAlloc", ctypes.byref(device), GIB)
    stream = drv.stream()
    # round 1: access for the GPU alone (what a copy needs); 2: the GPU's and the CPU's; 3: the GPU's,
    # per piece from THREADS threads
    for round_ in (1, 2, 3):
        started = now()
        handles = []
        for fd in fds:
            imported_handle = ctypes.c_ulonglong()
            drv.call("cuMemImportFromShareableHandle", ctypes.byref(imported_handle), ctypes.c_void_p(fd), 1)
            handles.append(imported_handle.value)
        imported = now()
        va = drv.reserve(size)
        for i, h in enumerate(handles):
            drv.map(va + i * piece, piece, h)
        mapped = now()
        if round_ == 3:
            workers = [
                threading.Thread(target=access_pieces, args=(drv, va, piece, count, numa, k)) for k in range(THREADS)
            ]
            for w in workers:
                w.start()
            for w in workers:
                w.join()
            cpu = False
        else:
            cpu = access(drv, va, size, numa, cpu=round_ == 2) == "gpu+cpu"
        done = now()
        result[f"r{round_}_import_s"], result[f"r{round_}_map_s"] = imported - started, mapped - imported
        result[f"r{round_}_access_s"] = done - mapped
        result[f"r{round_}_h2d_gbps"] = gbps(size, copy_all(drv, 0, va, size, device.value, True, stream))
        if round_ == 1:  # the copier's calls: the range as a device address, or as a host pointer
            for call in ("cuMemcpyDtoDAsync", "cuMemcpyHtoDAsync"):
                try:
                    seconds = copy_all(drv, 0, va, size, device.value, True, stream, call)
                    result[f"{call}_gbps"] = gbps(size, seconds)
                except RuntimeError as exc:
                    result[f"{call}_gbps"] = str(exc)
            try:
                seconds = copy_all(drv, va, 0, size, device.value, False, stream, "cuMemcpyDtoDAsync")
                result["dtod_to_host_gbps"] = gbps(size, seconds)
            except RuntimeError as exc:
                result["dtod_to_host_gbps"] = str(exc)
        wrong = [i for i in range(count) if cpu and ctypes.string_at(va + i * piece + 777, 1)[0] != (i + 1) & 0xFF]
        probe = ctypes.create_string_buffer(1 << 20)
        for i in range(count):  # the GPU's view of each piece too
            drv.call("cuMemcpyAsync", device.value, va + i * piece + (piece >> 1), 1 << 20, stream)
            drv.stream_sync(stream)
            drv.call("cuMemcpyAsync", ctypes.addressof(probe), device.value, 1 << 20, stream)
            drv.stream_sync(stream)
            if probe.raw.count((i + 1) & 0xFF) != 1 << 20:
                wrong.append(i)
        result[f"r{round_}_pieces_wrong"] = sorted(set(wrong))
        started = now()
        if round_ == 3:  # per piece from THREADS threads
            workers = [threading.Thread(target=unmap_pieces, args=(drv, va, piece, count, k)) for k in range(THREADS)]
            for w in workers:
                w.start()
            for w in workers:
                w.join()
        else:
            drv.call("cuMemUnmap", va, size)
        for h in handles:
            drv.call("cuMemRelease", h)
        drv.call("cuMemAddressFree", va, size)
        result[f"r{round_}_unmap_s"] = now() - started
    result["ok"] = True


def gpu_used_mib() -> float | None:
    try:
        import pynvml

        pynvml.nvmlInit()
        used = pynvml.nvmlDeviceGetMemoryInfo(pynvml.nvmlDeviceGetHandleByIndex(0)).used
        pynvml.nvmlShutdown()
        return round(used / (1 << 20), 1)
    except Exception as exc:  # NVML missing: the row says so
        return f"nvml: {exc}"  # type: ignore[return-value]


def available_gib() -> float:
    for line in Path("/proc/meminfo").read_text().splitlines():
        if line.startswith("MemAvailable:"):
            return round(int(line.split()[1]) / (1 << 20), 2)
    return -1.0


def spawn(role: str, args: list[str], pass_fds: tuple[int, ...], timeout: float) -> dict[str, Any]:
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    proc = subprocess.run(
        [sys.executable, __file__, "--part", role, *args],
        pass_fds=pass_fds,
        env=env,
        capture_output=True,
        text=True,
        timeout=timeout,
    )
    for line in proc.stdout.splitlines():
        if line.startswith('{"event": "result"'):
            return {**json.loads(line), "returncode": proc.returncode}
    return {"part": role, "ok": False, "returncode": proc.returncode, "stderr_tail": proc.stderr[-3000:]}


def one_size(gib: float, piece_gib: float, timeout: float) -> dict[str, Any]:
    out: dict[str, Any] = {"gib": gib, "gpu_used_mib_before": gpu_used_mib(), "avail_gib_before": available_gib()}
    ours, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
    holder: dict[str, Any] = {}

    def receive() -> None:
        msg, fds, _flags, _addr = socket.recv_fds(ours, 4096, 256)
        holder.update(meta=json.loads(msg), fds=fds)

    receiver = threading.Thread(target=receive, daemon=True)
    receiver.start()
    out["maker"] = spawn("maker", [str(theirs.fileno()), str(gib), str(piece_gib)], (theirs.fileno(),), timeout)
    receiver.join(5)
    theirs.close()
    fds = holder.get("fds", [])
    out["fds"] = len(fds)
    if not fds:
        return out
    time.sleep(1.0)  # the maker's context is gone: what stays on the GPU and in the host's memory
    out["gpu_used_mib_fds_only"], out["avail_gib_fds_only"] = gpu_used_mib(), available_gib()
    fd_text = ",".join(map(str, fds))
    out["job"] = spawn("job", [fd_text], tuple(fds), timeout)
    out["copier"] = spawn("copier", [fd_text, json.dumps(holder["meta"])], tuple(fds), timeout)
    for fd in fds:
        os.close(fd)
    time.sleep(1.0)
    out["gpu_used_mib_after"], out["avail_gib_after"] = gpu_used_mib(), available_gib()
    return out


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--sizes", default="16,64", help="GiB per round, comma-separated (default 16,64)")
    parser.add_argument("--piece-gib", type=float, default=2.0, help="GiB per allocation (default 2)")
    parser.add_argument("--timeout", type=float, default=300.0, help="seconds per process (default 300)")
    parser.add_argument("--part", help=argparse.SUPPRESS)
    args, rest = parser.parse_known_args()
    if args.part == "maker":
        sock = socket.socket(fileno=int(rest[0]))
        return report_part("maker", lambda r: maker(sock, float(rest[1]), float(rest[2]), r))
    if args.part == "job":
        return report_part("job", lambda r: job([int(f) for f in rest[0].split(",")], r))
    if args.part == "copier":
        fds = [int(f) for f in rest[0].split(",")]
        return report_part("copier", lambda r: copier(fds, json.loads(rest[1]), r))
    print("host:", json.dumps(host_settings()), flush=True)
    rows, ok = [], True
    for gib in [float(s) for s in args.sizes.split(",") if s]:
        r = one_size(gib, args.piece_gib, args.timeout)
        print(json.dumps(r, default=str)[:4000], flush=True)
        m, j, c = r.get("maker", {}), r.get("job", {}), r.get("copier", {})
        ok = ok and all(x.get("ok") for x in (m, j, c))
        rows.append(
            (
                f"{gib:g}",
                fmt(m.get("create_s"), 2),
                fmt(gbps(gib * GIB, m.get("create_s")), 1),
                fmt(m.get("d2h_gbps"), 1),
                fmt(m.get("h2d_gbps"), 1),
                str(r.get("gpu_used_mib_fds_only")),
                " ".join(j.get("steps", ["-"])),
                fmt(c.get("context_s"), 3),
                f"{fmt(c.get('r1_import_s'), 3)}/{fmt(c.get('r1_map_s'), 3)}/{fmt(c.get('r1_access_s'), 3)}",
                f"{fmt(c.get('r2_access_s'), 3)}/{fmt(c.get('r3_access_s'), 3)}",
                f"{fmt(c.get('r1_h2d_gbps'), 1)}/{fmt(c.get('r2_h2d_gbps'), 1)}/{fmt(c.get('r3_h2d_gbps'), 1)}",
                str(c.get("r1_pieces_wrong", "-")),
            )
        )
    print()
    print_table(
        (
            "GiB",
            "create s",
            "create GB/s",
            "D2H GB/s",
            "H2D GB/s",
            "GPU MiB, fds only",
            "job holding fds: checkpoint steps",
            "copier ctx s",
            "import/map/access (GPU) s",
            "access: GPU+CPU / GPU from 8 threads s",
            "H2D GB/s",
            "wrong",
        ),
        rows,
    )
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
