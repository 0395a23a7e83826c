"""Probes for freeing a GPU fast (a pause judged by when its GPU is free): which host memory
pins fastest here, what a staging kept pinned across pauses costs, and what a job's own mapping
of the staging costs its checkpoint.

    python bench/free_gpu_probe.py [--sizes 16,64] [--only checkpoint,kill] [--timeout 240] [--json out.json]

Needs one NVIDIA GPU (cuda:0), torch with CUDA and flexium built. Every part runs in a fresh
process (this file with --part NAME:SIZE) that prints one JSON result line; a failed part is
reported and the others still run. Sizes are GiB (2^30 bytes), bandwidths GB/s (10^9).

Parts:
  pin:KIND      Host memory of one kind, SIZE GiB, in a process with a bare driver context on
                cuda:0: touched from 8 threads (MADV_POPULATE_WRITE), registered
                (cuMemHostRegister per 256 MiB), a D2H copy of all of it from a 1 GiB device
                buffer, unregistered, registered again (a staging kept resident across pauses
                pins only), then the context reset with it still registered (how long letting
                go of a kept pinned staging takes). KIND: memfd (one file, what the copier maps
                now), memfd8 (8 files, one per touching thread), memfd_madv (memfd +
                MADV_HUGEPAGE: huge pages only where shmem_enabled allows them), hugetlb
                (memfd_create MFD_HUGETLB: needs free huge pages reserved on the host), anon_thp
                (anonymous + MADV_HUGEPAGE, what only the copier could hold).
  checkpoint:S  A torch context (cuBLAS loaded) with SIZE GiB of touched memfd, lock ->
                checkpoint -> restore -> unlock twice per state: none (no memfd), fd (the job
                holds only the file descriptor), mapped (the job maps it, as now) and pinned
                (the process itself registered it: could a copier be checkpointed with its
                staging pinned, instead of unpinning it at each pause?), with the pinned
                memory's H2D rate before and after.
  idle          A matmul loop on cuda:0 (the job) while another process (the keeper) takes a
                context on cuda:0, touches and pins SIZE GiB of memfd, then holds it: the job's
                median and longest step before, while the keeper prepares, and while it holds;
                the keeper's GPU memory (NVML).
  beside:S      Why a pause prepared at its command is slower than pin:memfd8 here: SIZE GiB of
                memfd8 touched and registered as the copier does (per 256 MiB, 2 ms between), a
                fresh staging per load running beside it in other processes: none, nvml (NVML's
                process list read every 5 ms, as bench/migrate.py does), train (a matmul loop on
                cuda:0), both; and memfd16 (16 files and threads) with none.
  threads:S     How a resume could pin a kept staging faster: SIZE GiB of memfd8 (and of memfd16)
                touched, then registered per 256 MiB from 1 thread and from one thread per file
                (8, 16), each after the context was reset (as the copier's wake finds it: its
                context let go at the pause, the pages still touched), unregistered in between.
  copy_back:S   What paces a resume's copy back (fact 19 of docs/fast-path.md: pinning), and whether
                copies from memory not yet pinned could run beside it: SIZE GiB of memfd8 touched,
                then copied to the GPU in a fresh context (into 1 GiB device buffers, over and
                over) three ways: each chunk pinned then copied (the copier's way), copied
                unpinned (the driver stages pageable memory itself), and both at once: one thread
                pinning and copying chunks from the front, another copying chunks unpinned from
                the back, until they meet.
  processes:S   Whether two copiers pinning at once (the ranks of a job resumed as a whole) share
                the host's pinning rate: SIZE GiB of memfd8 touched in each of 1, then 2 processes
                (a context of its own on cuda:0 each), registered per 256 MiB by all of them at
                once after a barrier, then again in a fresh context (as a copier's wake pins a
                kept staging); the rate of all of them together, and each one's seconds.
  kill          A keeper holding 0.25 GiB pinned with its context on cuda:0, killed (SIGKILL):
                when its /proc entry says zombie, when it can be reaped (waitpid), and when NVML
                no longer shows its memory (read every millisecond): what the allocator, short of
                GPU memory, waits for after killing the copier (csrc/gpu_memory_yield.cpp).
"""

from __future__ import annotations

import argparse
import ctypes
import json
import os
import statistics
import subprocess
import sys
import threading
import time
import traceback
from pathlib import Path
from typing import Any, Callable

sys.path.insert(0, str(Path(__file__).resolve().parent))

from children import run_child  # noqa: E402
from staging_probe import (  # noqa: E402
    CHUNK,
    CU_MEMHOSTREGISTER_PORTABLE,
    GIB,
    HUGE,
    MADV_HUGEPAGE,
    MAP_SHARED,
    PROT_READ,
    PROT_WRITE,
    Driver,
    Libc,
    Rounds,
    copy_host_device,
    fmt,
    gbps,
    in_threads,
    now,
    nvml_used_mib,
    populate,
    round_up,
    smaps_huge,
    torch_context,
)
from tables import print_table  # noqa: E402

THIS = Path(__file__).resolve()
KINDS = ("memfd", "memfd8", "memfd_madv", "hugetlb", "anon_thp")
TOUCH_THREADS = 8
MAP_PRIVATE, MAP_ANONYMOUS = 0x02, 0x20
MFD_HUGETLB = 0x0004


def host_settings() -> dict[str, Any]:
    out: dict[str, Any] = {"cpus": os.cpu_count()}
    for name in ("enabled", "defrag", "shmem_enabled"):
        try:
            out[f"thp_{name}"] = Path(f"/sys/kernel/mm/transparent_hugepage/{name}").read_text().strip()
        except OSError:
            out[f"thp_{name}"] = "?"
    try:
        for line in Path("/proc/meminfo").read_text().splitlines():
            key, _, value = line.partition(":")
            if key in ("MemTotal", "MemAvailable", "HugePages_Total", "HugePages_Free", "Hugepagesize"):
                out[key] = value.strip()
    except OSError:
        pass
    return out


class Staging:
    """SIZE bytes of one kind of host memory, as chunks of 256 MiB (2 MiB aligned)."""

    def __init__(self, libc: Libc, kind: str, size: int) -> None:
        self.libc, self.kind, self.size = libc, kind, size
        self.maps: list[tuple[int, int]] = []
        self.fds: list[int] = []
        self.chunks: list[tuple[int, int]] = []
        files = {"memfd8": TOUCH_THREADS, "memfd16": 2 * TOUCH_THREADS}.get(kind, 1)
        per_file = round_up(-(-size // files), HUGE)
        for index in range(files):
            length = min(per_file, size - index * per_file)
            if length <= 0:
                break
            self.chunks += [(a, n) for a, n in self._map(length)]

    def _map(self, length: int) -> list[tuple[int, int]]:
        prot = PROT_READ | PROT_WRITE
        if self.kind == "anon_thp":
            addr = self.libc.lib.mmap(None, length + HUGE, prot, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0)
        else:
            fd = os.memfd_create("flexium-probe", MFD_HUGETLB if self.kind == "hugetlb" else 0)
            self.fds.append(fd)
            os.ftruncate(fd, length + HUGE)
            addr = self.libc.lib.mmap(None, length + HUGE, prot, MAP_SHARED, self.fds[-1], 0)
        if addr is None or addr == ctypes.c_void_p(-1).value:
            raise OSError(
                ctypes.get_errno(), f"mmap of {length} bytes ({self.kind}): {os.strerror(ctypes.get_errno())}"
            )
        self.maps.append((int(addr), length + HUGE))
        base = round_up(int(addr), HUGE)
        if self.kind in ("memfd_madv", "anon_thp"):
            self.libc.lib.madvise(base, length, MADV_HUGEPAGE)
        return [(base + off, min(CHUNK, length - off)) for off in range(0, length, CHUNK)]

    def touch(self) -> float:
        started = now()
        if len(self.maps) > 1:
            threads = [
                threading.Thread(target=populate, args=(self.libc, round_up(a, HUGE), n - HUGE, 1))
                for a, n in self.maps
            ]
            for t in threads:
                t.start()
            for t in threads:
                t.join()
        else:
            a, n = self.maps[0]
            populate(self.libc, round_up(a, HUGE), n - HUGE, TOUCH_THREADS)
        return now() - started

    def unmap(self) -> None:
        for a, n in self.maps:
            self.libc.lib.munmap(a, n)
        self.maps = []


def timed_each(chunks: list[tuple[int, int]], call: Callable[[int, int], None]) -> float:
    started = now()
    for a, n in chunks:
        call(a, n)
    return now() - started


def part_pin(kind: str, gib: float, result: dict[str, Any]) -> None:
    size = round_up(int(gib * GIB), HUGE)
    if kind == "hugetlb":
        info = host_settings()
        free_pages = int(str(info.get("HugePages_Free", "0")).split()[0])
        page_kib = int(str(info.get("Hugepagesize", "2048 kB")).split()[0])
        if free_pages * page_kib * 1024 < size:
            result.update(ok=True, not_possible=f"{free_pages} free huge pages of {page_kib} kB reserved on the host")
            return
    drv = Driver()
    drv.primary_context(0)
    libc = Libc()
    register = lambda a, n: drv.call("cuMemHostRegister", a, n, CU_MEMHOSTREGISTER_PORTABLE)  # noqa: E731
    unregister = lambda a, _n: drv.call("cuMemHostUnregister", a)  # noqa: E731
    staging = Staging(libc, kind, size)
    before = smaps_huge()
    result["touch_s"] = staging.touch()
    after = smaps_huge()
    result["huge_gib"] = {
        k: round((after[k] - before.get(k, 0)) / GIB, 2) for k in after if after[k] != before.get(k, 0)
    }
    result["register_s"] = timed_each(staging.chunks, register)
    device = ctypes.c_uint64()
    drv.call("cuMemAlloc", ctypes.byref(device), GIB)
    stream = drv.stream()
    copied, seconds = copy_host_device(drv, staging.chunks, int(device.value), GIB, True, stream)
    result["d2h_gbps"] = gbps(copied, seconds)
    result["unregister_s"] = timed_each(staging.chunks, unregister)
    result["register_again_s"] = timed_each(staging.chunks, register)
    started = now()
    drv.call("cuDevicePrimaryCtxReset", drv.device)
    result["ctx_reset_registered_s"] = now() - started
    started = now()
    staging.unmap()
    result["unmap_s"] = now() - started
    result["ok"] = True


def part_checkpoint(gib: float, result: dict[str, Any]) -> None:
    torch = torch_context()
    libc = Libc()
    size = round_up(int(gib * GIB), HUGE)
    probe = torch.arange(1 << 20, device="cuda:0", dtype=torch.float32)
    expected = float(probe.sum().item())
    rounds = Rounds(lambda: float(probe.sum().item()) == expected)
    result["states"] = {"none": rounds.many("none", 2, {})}
    staging = Staging(libc, "memfd", size)
    result["touch_s"] = staging.touch()
    result["states"]["mapped"] = rounds.many("mapped", 2, {})
    # Pinned by the checkpointed process itself: does the registration survive, and at what cost?
    drv = Driver()
    drv.primary_context(0)
    for a, n in staging.chunks:
        drv.call("cuMemHostRegister", a, n, CU_MEMHOSTREGISTER_PORTABLE)
    stream = drv.stream()

    def h2d_gbps() -> float | None:
        """Into a 1 GiB buffer made for it and freed after, so the checkpoint carries none."""
        device = torch.empty(GIB, dtype=torch.uint8, device="cuda:0")
        copied, seconds = copy_host_device(drv, staging.chunks, device.data_ptr(), GIB, False, stream)
        del device
        torch.cuda.empty_cache()
        return gbps(copied, seconds)

    result["pinned_h2d_gbps_before"] = h2d_gbps()
    result["states"]["pinned"] = rounds.many("pinned", 2, {})
    result["pinned_h2d_gbps_after"] = h2d_gbps()
    for a, _n in staging.chunks:
        drv.call("cuMemHostUnregister", a)
    staging.unmap()
    result["states"]["fd"] = rounds.many("fd", 2, {})
    result["ok"] = True


LOADS = {
    "nvml": "import pynvml, time\npynvml.nvmlInit()\nh = pynvml.nvmlDeviceGetHandleByIndex(0)\n"
    "print('running', flush=True)\nwhile True:\n    pynvml.nvmlDeviceGetComputeRunningProcesses(h)\n"
    "    time.sleep(0.005)\n",
    "train": "import torch\na = torch.randn(4096, 4096, device='cuda:0')\n(a @ a).sum().item()\n"
    "print('running', flush=True)\nwhile True:\n    (a @ a).sum().item()\n",
}


def part_beside(gib: float, result: dict[str, Any]) -> None:
    drv = Driver()
    drv.primary_context(0)
    libc = Libc()
    size = round_up(int(gib * GIB), HUGE)

    def register(a: int, n: int) -> None:
        drv.call("cuMemHostRegister", a, n, CU_MEMHOSTREGISTER_PORTABLE)
        time.sleep(0.002)

    result["loads"] = {}
    for kind, load in (
        ("memfd8", "none"),
        ("memfd16", "none"),
        *(("memfd8", x) for x in ("nvml", "train", "nvml+train")),
    ):
        others = []
        for name in load.split("+"):
            if name in LOADS:
                child = subprocess.Popen([sys.executable, "-c", LOADS[name]], stdout=subprocess.PIPE, text=True)
                assert child.stdout is not None
                child.stdout.readline()  # 'running'
                others.append(child)
        try:
            staging = Staging(libc, kind, size)
            touch_s = staging.touch()
            register_s = timed_each(staging.chunks, register)
            for a, _n in staging.chunks:
                drv.call("cuMemHostUnregister", a)
            staging.unmap()
            for fd in staging.fds:
                os.close(fd)
        finally:
            for child in others:
                child.kill()
                child.wait()
        result["loads"][f"{kind} {load}"] = {"touch_gbps": gbps(size, touch_s), "pin_gbps": gbps(size, register_s)}
    result["ok"] = True


def per_file(staging: Staging) -> list[list[tuple[int, int]]]:
    """The staging's chunks, grouped by the file (mapping) they are in."""
    return [[(a, n) for a, n in staging.chunks if base <= a < base + length] for base, length in staging.maps]


def part_threads(gib: float, result: dict[str, Any]) -> None:
    drv = Driver()
    libc = Libc()
    size = round_up(int(gib * GIB), HUGE)

    def register_from(groups: list[list[tuple[int, int]]]) -> float:
        """Seconds to register every group's chunks, one thread per group, in a fresh context."""
        drv.call("cuDevicePrimaryCtxReset", drv.device)
        context = ctypes.c_void_p(drv.primary_context(0))

        def pinner(chunks: list[tuple[int, int]]) -> Callable[[], None]:
            def pin() -> None:
                drv.call("cuCtxSetCurrent", context)
                for a, n in chunks:
                    drv.call("cuMemHostRegister", a, n, CU_MEMHOSTREGISTER_PORTABLE)

            return pin

        seconds = in_threads([pinner(g) for g in groups])
        for group in groups:
            for a, _n in group:
                drv.call("cuMemHostUnregister", a)
        return seconds

    drv.primary_context(0)
    result["rates"] = {}
    for kind in ("memfd8", "memfd16"):
        staging = Staging(libc, kind, size)
        staging.touch()
        files = per_file(staging)
        for label, groups in (("1 thread", [staging.chunks]), (f"{len(files)} threads", files)):
            result["rates"][f"{kind} {label}"] = gbps(size, register_from(groups))
        staging.unmap()
        for fd in staging.fds:
            os.close(fd)
    result["ok"] = True


class ChunkQueue:
    """Chunks taken from either end by threads, each once."""

    def __init__(self, chunks: list[tuple[int, int]]) -> None:
        self.chunks = list(chunks)
        self.lock = threading.Lock()

    def front(self) -> Any:
        with self.lock:
            return self.chunks.pop(0) if self.chunks else None

    def back(self) -> Any:
        with self.lock:
            return self.chunks.pop() if self.chunks else None


def part_copy_back(gib: float, result: dict[str, Any]) -> None:
    drv = Driver()
    libc = Libc()
    size = round_up(int(gib * GIB), HUGE)
    drv.primary_context(0)
    staging = Staging(libc, "memfd8", size)
    staging.touch()
    chunks = staging.chunks

    def fresh_context() -> tuple[Any, list[int], list[int]]:
        """The copier's wake: a new context, two streams and two 1 GiB device buffers."""
        drv.call("cuDevicePrimaryCtxReset", drv.device)
        context = ctypes.c_void_p(drv.primary_context(0))
        buffers = []
        for _ in range(2):
            device = ctypes.c_uint64()
            drv.call("cuMemAlloc", ctypes.byref(device), GIB)
            buffers.append(int(device.value))
        return context, [drv.stream(), drv.stream()], buffers

    def copy_in(host: int, n: int, buffer: int, stream: int, offset: list[int]) -> None:
        if offset[0] + n > GIB:
            offset[0] = 0
        drv.call("cuMemcpyHtoDAsync", buffer + offset[0], host, n, stream)
        offset[0] += n

    def pinned_way(take: Callable[[], Any], context: Any, buffer: int, stream: int, done: list[int]) -> None:
        drv.call("cuCtxSetCurrent", context)
        offset = [0]
        while (chunk := take()) is not None:
            drv.call("cuMemHostRegister", chunk[0], chunk[1], CU_MEMHOSTREGISTER_PORTABLE)
            copy_in(chunk[0], chunk[1], buffer, stream, offset)
            done.append(chunk[0])
        drv.stream_sync(stream)

    def unpinned_way(take: Callable[[], Any], context: Any, buffer: int, stream: int, done: list[int]) -> None:
        drv.call("cuCtxSetCurrent", context)
        offset = [0]
        while (chunk := take()) is not None:
            copy_in(chunk[0], chunk[1], buffer, stream, offset)
            drv.stream_sync(stream)  # pageable: the driver stages the copy; wait for it, as a copier would
            done.append(chunk[0])

    result["ways"] = {}
    sizes = dict(chunks)
    # Pinned twice, first and last: the first registration of the pages may cost more.
    for way in ("pinned", "unpinned", "both", "pinned again"):
        context, streams, buffers = fresh_context()
        queue = ChunkQueue(chunks)
        pinned: list[int] = []
        unpinned: list[int] = []
        works: list[Callable[[], None]] = []
        if way in ("pinned", "both", "pinned again"):
            works.append(lambda: pinned_way(queue.front, context, buffers[0], streams[0], pinned))  # noqa: B023
        if way in ("unpinned", "both"):
            take = queue.back if way == "both" else queue.front
            works.append(lambda: unpinned_way(take, context, buffers[1], streams[1], unpinned))  # noqa: B023
        seconds = in_threads(works)
        result["ways"][way] = {
            "gbps": gbps(size, seconds),
            "seconds": seconds,
            "pinned_gib": sum(sizes[a] for a in pinned) / GIB,
            "unpinned_gib": sum(sizes[a] for a in unpinned) / GIB,
        }
        drv.call("cuCtxSetCurrent", context)
        for a in pinned:
            drv.call("cuMemHostUnregister", a)
    staging.unmap()
    result["ok"] = True


def keeper_main(gib: float) -> int:
    """The idle part's other process: a context on cuda:0, SIZE GiB of memfd touched and pinned,
    then held until stdin closes. Says 'preparing', 'holding' on stdout."""
    drv = Driver()
    drv.primary_context(0)
    libc = Libc()
    staging = Staging(libc, "memfd", round_up(int(gib * GIB), HUGE))
    print("preparing", flush=True)
    staging.touch()
    for a, n in staging.chunks:
        drv.call("cuMemHostRegister", a, n, CU_MEMHOSTREGISTER_PORTABLE)
        time.sleep(0.002)  # the break the copier takes between chunks
    print("holding", flush=True)
    sys.stdin.read()
    return 0


def pinner_main(gib: float) -> int:
    """The processes part's other processes: a context on cuda:0 and SIZE GiB of memfd8 touched;
    then, at each 'go' on stdin, every chunk registered and one line of the seconds it took:
    first on touched pages, then, after unregistering and a fresh context, on the same pages."""
    drv = Driver()
    drv.primary_context(0)
    staging = Staging(Libc(), "memfd8", round_up(int(gib * GIB), HUGE))
    staging.touch()
    for again in (False, True):
        if again:
            for a, _n in staging.chunks:
                drv.call("cuMemHostUnregister", a)
            drv.call("cuDevicePrimaryCtxReset", drv.device)
            drv.primary_context(0)
        print("ready", flush=True)
        sys.stdin.readline()
        seconds = timed_each(
            staging.chunks, lambda a, n: drv.call("cuMemHostRegister", a, n, CU_MEMHOSTREGISTER_PORTABLE)
        )
        print(json.dumps({"seconds": seconds}), flush=True)
    return 0


def part_processes(gib: float, result: dict[str, Any]) -> None:
    size = round_up(int(gib * GIB), HUGE)
    result["counts"] = {}
    for count in (1, 2):
        pinners = [
            subprocess.Popen(
                [sys.executable, str(THIS), "--pinner", str(gib)],
                stdin=subprocess.PIPE,
                stdout=subprocess.PIPE,
                text=True,
            )
            for _ in range(count)
        ]
        rounds: dict[str, Any] = {}
        try:
            for label in ("touched", "again"):
                for p in pinners:
                    assert p.stdout is not None and p.stdout.readline().strip() == "ready", "a pinner failed"
                for p in pinners:
                    assert p.stdin is not None
                    p.stdin.write("go\n")
                    p.stdin.flush()
                each = [float(json.loads(p.stdout.readline())["seconds"]) for p in pinners if p.stdout is not None]
                rounds[label] = {"each_s": each, "gbps_all": gbps(count * size, max(each))}
        finally:
            for p in pinners:
                p.kill()
                p.wait()
        result["counts"][str(count)] = rounds
    result["ok"] = True


def part_idle(gib: float, result: dict[str, Any]) -> None:
    torch = torch_context()
    a = torch.randn(4096, 4096, device="cuda:0")
    ends: list[float] = []
    marks: dict[str, float] = {}
    stop = threading.Event()

    def train() -> None:
        while not stop.is_set():
            (a @ a).sum().item()
            ends.append(now())

    trainer = threading.Thread(target=train)
    trainer.start()
    time.sleep(4.0)
    marks["start"] = now()
    keeper = subprocess.Popen(
        [sys.executable, str(THIS), "--keeper", str(gib)], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True
    )
    assert keeper.stdout is not None and keeper.stdin is not None
    for line in keeper.stdout:
        marks[line.strip()] = now()
        if line.strip() == "holding":
            break
    time.sleep(6.0)
    result["keeper_nvml_mib"] = nvml_used_mib(keeper.pid)
    marks["end"] = now()
    stop.set()
    trainer.join()
    keeper.stdin.close()
    keeper.wait(timeout=60)

    def steps(t0: float, t1: float) -> dict[str, Any]:
        gaps = [y - x for x, y in zip(ends, ends[1:], strict=False) if x >= t0 and y <= t1]
        if not gaps:
            return {}
        return {"median_ms": statistics.median(gaps) * 1e3, "max_ms": max(gaps) * 1e3, "steps": len(gaps)}

    result["before"] = steps(ends[0], marks["start"])
    result["preparing"] = steps(marks.get("preparing", marks["start"]), marks["holding"])
    result["holding"] = steps(marks["holding"], marks["end"])
    result["prepare_s"] = marks["holding"] - marks.get("preparing", marks["start"])
    result["ok"] = keeper.returncode == 0


def part_kill(result: dict[str, Any]) -> None:
    import signal

    import pynvml

    pynvml.nvmlInit()
    handle = pynvml.nvmlDeviceGetHandleByIndex(0)

    def used(pid: int) -> int:
        return sum(p.usedGpuMemory or 0 for p in pynvml.nvmlDeviceGetComputeRunningProcesses(handle) if p.pid == pid)

    keeper = subprocess.Popen(
        [sys.executable, str(THIS), "--keeper", "0.25"], stdin=subprocess.PIPE, stdout=subprocess.PIPE
    )
    assert keeper.stdout is not None
    for line in keeper.stdout:
        if line.strip() == b"holding":
            break
    result["held_mib"] = used(keeper.pid) >> 20
    killed = now()
    keeper.kill()
    seen: dict[str, float] = {}
    while len(seen) < 3 and now() - killed < 10:
        try:
            stat = Path(f"/proc/{keeper.pid}/stat").read_text()
            zombie = stat[stat.rindex(")") + 2] == "Z"
        except (OSError, IndexError):
            zombie = True
        if zombie:
            seen.setdefault("zombie_s", now() - killed)
        if "reaped_s" not in seen and os.waitpid(keeper.pid, os.WNOHANG)[0] == keeper.pid:
            seen["reaped_s"] = now() - killed
            keeper.returncode = -signal.SIGKILL
        if used(keeper.pid) == 0:
            seen.setdefault("freed_s", now() - killed)
        time.sleep(0.001)
    result.update(seen)
    result["ok"] = len(seen) == 3


# The parts that take one argument, SIZE GiB (NAME:SIZE).
SIZED_PARTS: dict[str, Callable[[float, dict[str, Any]], None]] = {
    "checkpoint": part_checkpoint,
    "idle": part_idle,
    "beside": part_beside,
    "copy_back": part_copy_back,
    "threads": part_threads,
    "processes": part_processes,
}


def worker(part: str) -> int:
    import faulthandler

    faulthandler.enable()
    name, _, arg = part.partition(":")
    result: dict[str, Any] = {"part": part, "ok": False}
    try:
        if name == "pin":
            kind, _, gib = arg.partition("@")
            part_pin(kind, float(gib), result)
        elif name == "kill":
            part_kill(result)
        elif name in SIZED_PARTS:
            SIZED_PARTS[name](float(arg), result)
        else:
            raise ValueError(f"unknown part {part}")
    except BaseException as exc:
        result["error"] = f"{type(exc).__name__}: {exc}"
        traceback.print_exc()
    print(json.dumps({"event": "result", **result}, default=str), flush=True)
    return 0 if result.get("ok") else 1


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--sizes", default="16,64", help="GiB per part, comma-separated (default 16,64)")
    parser.add_argument("--idle-gib", type=float, default=16.0, help="GiB the idle part's keeper pins (default 16)")
    parser.add_argument("--timeout", type=float, default=240.0, help="seconds per part (default 240)")
    parser.add_argument("--json", help="write every part's result here")
    parser.add_argument("--only", default="", help="run only these parts, by name, comma-separated: checkpoint,kill")
    parser.add_argument("--part", help=argparse.SUPPRESS)
    parser.add_argument("--keeper", type=float, help=argparse.SUPPRESS)
    parser.add_argument("--pinner", type=float, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.keeper is not None:
        return keeper_main(args.keeper)
    if args.pinner is not None:
        return pinner_main(args.pinner)
    if args.part:
        return worker(args.part)
    sizes = [float(s) for s in args.sizes.split(",") if s]
    print("host:", json.dumps(host_settings()), flush=True)
    parts = [f"pin:{kind}@{gib:g}" for gib in sizes for kind in KINDS]
    parts += [f"checkpoint:{gib:g}" for gib in sizes] + [f"beside:{gib:g}" for gib in sizes]
    parts += (
        [f"threads:{gib:g}" for gib in sizes]
        + [f"copy_back:{gib:g}" for gib in sizes]
        + [f"processes:{gib:g}" for gib in sizes]
        + [f"idle:{args.idle_gib:g}", "kill"]
    )
    only = {name.strip() for name in args.only.split(",") if name.strip()}
    parts = [p for p in parts if not only or p.partition(":")[0] in only]
    results = []
    env = {**os.environ, "PYTHONUNBUFFERED": "1", "CUDA_MODULE_LOADING": "LAZY"}
    for part in parts:
        child = run_child([sys.executable, str(THIS), "--part", part], env, args.timeout)
        r = child.result(failed={"part": part}, timeout=args.timeout)
        results.append(r)
        print(json.dumps(r, default=str)[:1500], flush=True)
    if args.json:
        Path(args.json).write_text(json.dumps(results, indent=1, default=str))
    print()
    rows = []
    for r in results:
        if not r["part"].startswith("pin:") or not r.get("ok"):
            continue
        kind, _, gib_text = r["part"][4:].partition("@")
        size = float(gib_text) * GIB
        if r.get("not_possible"):
            rows.append((kind, gib_text, "-", "-", "-", "-", "-", "-", r["not_possible"][:40]))
            continue
        rows.append(
            (
                kind,
                gib_text,
                fmt(gbps(int(size), r.get("touch_s")), 2),
                fmt(gbps(int(size), r.get("register_s")), 2),
                fmt(gbps(int(size), r.get("register_again_s")), 2),
                fmt(gbps(int(size), r.get("unregister_s")), 2),
                fmt(r.get("d2h_gbps"), 2),
                fmt(r.get("ctx_reset_registered_s"), 2),
                json.dumps(r.get("huge_gib", {}))[:40],
            )
        )
    print_table(
        ("kind", "GiB", "touch GB/s", "pin GB/s", "pin again", "unpin GB/s", "D2H GB/s", "ctx reset s", "huge pages"),
        rows,
    )
    print()
    checkpoints = []
    for r in results:
        if r["part"].startswith("checkpoint:") and r.get("ok"):
            for state, s in r["states"].items():
                checkpoints.append((r["part"][11:], state, fmt(s.get("checkpoint_s"), 3), fmt(s.get("restore_s"), 3)))
    print_table(("GiB", "job's staging", "checkpoint s", "restore s"), checkpoints)
    for r in results:
        if r["part"].startswith("checkpoint:") and r.get("ok"):
            before, after = fmt(r.get("pinned_h2d_gbps_before"), 1), fmt(r.get("pinned_h2d_gbps_after"), 1)
            print(f"{r['part'][11:]} GiB pinned by the checkpointed process: H2D {before} GB/s before, {after} after")
    print()
    for r in results:
        if r["part"].startswith("idle:") and r.get("ok"):
            for phase in ("before", "preparing", "holding"):
                s = r.get(phase, {})
                median, longest = fmt(s.get("median_ms"), 2), fmt(s.get("max_ms"), 2)
                print(f"idle {r['part'][5:]} GiB {phase:9s}: median {median} ms, max {longest} ms")
            prepared, held = fmt(r.get("prepare_s"), 2), r.get("keeper_nvml_mib")
            print(f"keeper: prepared in {prepared} s, holds {held} MiB of GPU memory")
    for r in results:
        if r["part"].startswith("beside:") and r.get("ok"):
            for load, rates in r["loads"].items():
                touch, pin = fmt(rates.get("touch_gbps"), 1), fmt(rates.get("pin_gbps"), 1)
                print(f"{r['part'][7:]} GiB {load:18s}: touch {touch} GB/s, pin {pin} GB/s")
    for r in results:
        if r["part"].startswith("threads:") and r.get("ok"):
            for label, rate in r["rates"].items():
                print(f"{r['part'][8:]} GiB {label:18s}: pin again in a fresh context {fmt(rate, 1)} GB/s")
    for r in results:
        if r["part"].startswith("copy_back:") and r.get("ok"):
            for way, w in r["ways"].items():
                print(
                    f"{r['part'][10:]} GiB copy back {way:12s}: {fmt(w['gbps'], 1)} GB/s ({fmt(w['seconds'], 3)} s; "
                    f"{fmt(w['pinned_gib'], 2)} GiB pinned, {fmt(w['unpinned_gib'], 2)} GiB unpinned)"
                )
    for r in results:
        if r["part"].startswith("processes:") and r.get("ok"):
            for count, rounds in r["counts"].items():
                for label, w in rounds.items():
                    each = ", ".join(fmt(x, 3) for x in w["each_s"])
                    print(
                        f"{r['part'][10:]} GiB each, {count} process(es) pinning at once, {label:7s}: "
                        f"{fmt(w['gbps_all'], 1)} GB/s in all (each {each} s)"
                    )
    for r in results:
        if r["part"] == "kill" and r.get("ok"):
            zombie, reaped, freed = (fmt(r.get(k), 3) for k in ("zombie_s", "reaped_s", "freed_s"))
            print(
                f"killed keeper ({r.get('held_mib')} MiB): zombie after {zombie} s, reaped {reaped} s, freed {freed} s"
            )
    failed = [r["part"] for r in results if not r.get("ok")]
    if failed:
        print("FAILED:", ", ".join(failed))
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
