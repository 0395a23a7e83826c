"""Host memory laid out as the copier's staging is (csrc/vmm_host_staging.cpp: memfds mapped
shared, touched from several threads, registered per 256 MiB), for the pinning probes; and the
host's settings that decide how fast it pins."""

from __future__ import annotations

import ctypes
import os
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

GIB = 1 << 30
HUGE = 2 << 20
CHUNK = 256 << 20
TOUCH_THREADS = 8
# Linux (x86_64 and aarch64 share these)
PROT_READ, PROT_WRITE = 0x1, 0x2
MAP_SHARED, MAP_PRIVATE, MAP_ANONYMOUS = 0x01, 0x02, 0x20
MADV_HUGEPAGE = 14
MADV_POPULATE_WRITE = 23
MFD_HUGETLB = 0x0004


def now() -> float:
    return time.perf_counter()


def gbps(nbytes: float, seconds: float | None) -> float | None:
    return nbytes / seconds / 1e9 if seconds else None


def round_up(value: int, multiple: int) -> int:
    return (value + multiple - 1) // multiple * multiple


def fmt(value: Any, digits: int = 3) -> str:
    if value is None:
        return "-"
    if isinstance(value, (int, float)):
        return f"{value:.{digits}f}"
    return str(value)


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


def smaps_huge() -> dict[str, int]:
    """This process's huge-page counters (/proc/self/smaps_rollup), in bytes."""
    out: dict[str, int] = {}
    try:
        with open("/proc/self/smaps_rollup") as f:
            for line in f:
                name, _, rest = line.partition(":")
                if "Huge" in name or "Pmd" in name:
                    out[name] = int(rest.split()[0]) * 1024
    except (OSError, ValueError, IndexError):
        pass
    return out


class Libc:
    def __init__(self) -> None:
        lib = ctypes.CDLL("libc.so.6", use_errno=True)
        lib.mmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int, ctypes.c_int, ctypes.c_int, ctypes.c_long]
        lib.mmap.restype = ctypes.c_void_p
        lib.munmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t]
        lib.munmap.restype = ctypes.c_int
        lib.madvise.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
        lib.madvise.restype = ctypes.c_int
        lib.memset.argtypes = [ctypes.c_void_p, ctypes.c_int, ctypes.c_size_t]
        lib.memset.restype = ctypes.c_void_p
        self.lib = lib


def populate(libc: Libc, base: int, size: int, threads: int) -> None:
    """Faults [base, base+size) in from `threads` threads (ctypes lets the GIL go during madvise)."""
    slice_bytes = round_up(-(-size // threads), HUGE)

    def work(start: int, length: int) -> None:
        if libc.lib.madvise(start, length, MADV_POPULATE_WRITE) != 0:
            libc.lib.memset(start, 0, length)

    workers = [
        threading.Thread(target=work, args=(base + off, min(slice_bytes, size - off)))
        for off in range(0, size, slice_bytes)
    ]
    for w in workers:
        w.start()
    for w in workers:
        w.join()


class Staging:
    """SIZE bytes of one kind of host memory, as chunks of 256 MiB (2 MiB aligned). Kinds: memfd
    (one file), memfdN (N files, a file per touching thread, as the copier maps its staging),
    memfd_madv (memfd + MADV_HUGEPAGE: huge pages only where shmem_enabled allows them), hugetlb
    (memfd_create MFD_HUGETLB: needs huge pages reserved on the host), anon_thp (anonymous +
    MADV_HUGEPAGE: what only the copier could hold, and the staged bytes would die with it)."""

    def __init__(self, libc: Libc, kind: str, size: int) -> None:
        self.libc, self.kind, self.size = libc, kind, size
        self.maps: list[tuple[int, int]] = []
        self.fds: list[int] = []
        self.chunks: list[tuple[int, int]] = []
        files = int(kind[len("memfd") :]) if kind[len("memfd") :].isdigit() else 1
        per_file = round_up(-(-size // files), HUGE)
        for index in range(files):
            length = min(per_file, size - index * per_file)
            if length <= 0:
                break
            self.chunks += self._map(length)

    def _map(self, length: int) -> list[tuple[int, int]]:
        prot = PROT_READ | PROT_WRITE
        if self.kind == "anon_thp":
            addr = self.libc.lib.mmap(None, length + HUGE, prot, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0)
        else:
            fd = os.memfd_create("flexium-probe", MFD_HUGETLB if self.kind == "hugetlb" else 0)
            self.fds.append(fd)
            os.ftruncate(fd, length + HUGE)
            addr = self.libc.lib.mmap(None, length + HUGE, prot, MAP_SHARED, fd, 0)
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
        """Seconds to fault every page in: a thread per file, or TOUCH_THREADS over one file."""
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
        for fd in self.fds:
            os.close(fd)
        self.fds = []


def timed_each(chunks: list[tuple[int, int]], call: Callable[[int, int], None]) -> float:
    started = now()
    for a, n in chunks:
        call(a, n)
    return now() - started
