"""The fast path's moves of our pool's segments, each a timed step that names itself on failure.

DESIGN.md "Fast path": at a safe point, holding the GIL, the segments are copied to the target
GPU over NVLink (or to pinned host memory for a pause) and their source memory released, so
the driver checkpoint only carries the rest (context, library workspaces, anything outside the
pool); after the restore they are mapped back at their own addresses. The engine orders these
steps around the locked section and decides what a failure means.
"""

from __future__ import annotations

import os
import time
from dataclasses import dataclass
from typing import Callable, Iterable, Optional, TypeVar

from flexium import _C
from flexium.engine.memory_pool import MemoryPool, open_file_headroom
from flexium.engine.operations import StepTiming

T = TypeVar("T")
# Files kept free besides one per segment (sockets, logs, the NVML helper's pipes).
FD_RESERVE = 256


class RelocationError(Exception):
    def __init__(self, step: str, message: str, timing: StepTiming) -> None:
        super().__init__(message)
        self.step = step
        self.timing = timing


@dataclass
class Staged:
    """Copies of the segments on the target GPU, held only by these fds until mapped back."""

    entries: list[tuple[int, int, int]]   # (address, size, fd)
    copied_bytes: int

    @property
    def segment_bytes(self) -> int:
        return sum(size for _address, size, _fd in self.entries)


def timed(step: str, work: Callable[[], T]) -> tuple[T, StepTiming]:
    started = time.perf_counter()
    try:
        value = work()
    except Exception as exc:
        timing = StepTiming(step, time.perf_counter() - started, ok=False, error=f"{type(exc).__name__}: {exc}")
        raise RelocationError(step, f"step '{step}' failed: {type(exc).__name__}: {exc}", timing) from exc
    return value, StepTiming(step, time.perf_counter() - started, ok=True)


class FastPath:
    def __init__(self, pool: MemoryPool) -> None:
        self.pool = pool

    def blocker(self, logical: int) -> Optional[str]:
        """Why the fast path cannot move this job now (None: it can)."""
        if not self.pool.active:
            return f"the memory pool is off: {self.pool.reason_off}"
        segments = _C.vmm_segments()
        elsewhere = sorted({device for _a, _s, device, _m in segments if device != logical})
        if elsewhere:
            names = ", ".join(f"cuda:{d}" for d in elsewhere)
            return f"the job also holds memory on {names}; the fast path moves one GPU's memory"
        if any(not mapped for _a, _s, _d, mapped in segments):
            return "some segments have no memory behind them (an earlier move did not finish)"
        headroom = open_file_headroom()
        if len(segments) + FD_RESERVE > headroom:
            return f"{len(segments)} segments need as many open files and only {headroom} are left (raise ulimit -n)"
        return None

    def pool_bytes(self, logical: int) -> int:
        return int(_C.vmm_bytes_on(logical))

    # ---- GPU to GPU ------------------------------------------------------------------------

    def stage_to_device(self, logical: int, target_ordinal: int) -> tuple[Staged, StepTiming]:
        def work() -> Staged:
            live = self.pool.live_ranges(logical)
            entries = _C.stage_segments_to_device(target_ordinal, logical, live)
            return Staged([(address, size, fd) for address, size, fd in entries], int(_C.last_staged_copy_bytes()))

        return timed("copy", work)

    def release(self, logical: int) -> StepTiming:
        return timed("release", lambda: _C.release_source_backing(logical))[1]

    def map_back(self, staged: Staged, logical: int) -> StepTiming:
        """Maps the copies at their addresses for `logical` (now on the target GPU)."""
        return timed("map", lambda: self._map(staged, logical))[1]

    def own(self, logical: int) -> StepTiming:
        """Replaces the memory that came in through fds with memory of our own: a driver
        checkpoint cannot restore imported memory (its restore fails, CUDA_ERROR_NOT_SUPPORTED,
        and leaves the process stuck). The engine calls it before a driver-path checkpoint."""
        return timed("own", lambda: _C.own_imported(logical, self.pool.live_ranges(logical)))[1]

    def bring_home(self, staged: Staged, logical: int) -> StepTiming:
        """Rollback after a release: the released segments' data lives only in the copies on the
        target; map them for `logical` (read over NVLink), then copy them into memory of its own
        GPU in place (own_imported). Copies of segments that kept their memory are dropped."""

        def work() -> None:
            self._map(staged, logical)
            _C.own_imported(logical, {})

        return timed("rollback_copy", work)[1]

    def _map(self, staged: Staged, logical: int) -> None:
        """Maps the copies of the segments without memory; closes the copies of the others.
        Afterwards `staged` holds only the copies still waiting (map_imported closed the fds of
        those it mapped), also when it failed half way."""
        waiting = self._unbacked()
        close_fds([e for e in staged.entries if e[0] not in waiting])
        staged.entries = [e for e in staged.entries if e[0] in waiting]
        try:
            _C.map_imported(staged.entries, logical)
        finally:
            still = self._unbacked()
            staged.entries = [e for e in staged.entries if e[0] in still]

    # ---- GPU to pinned host memory ---------------------------------------------------------

    def reserve_host(self, logical: int) -> tuple[int, float]:
        """Pins host memory for the pool's bytes before the safe point (pinning takes seconds;
        the job trains meanwhile). Returns bytes added and seconds taken."""
        started = time.perf_counter()
        added = int(_C.reserve_host_staging(self.pool_bytes(logical), logical))
        return added, time.perf_counter() - started

    def host_bytes_to_pin(self, logical: int) -> int:
        return max(0, self.pool_bytes(logical) - int(_C.host_staging_pool_bytes()))

    def stage_to_host(self) -> tuple[int, StepTiming]:
        return timed("copy", lambda: int(_C.stage_segments_to_host()))

    def restore_from_host(self, logical: int, step: str = "copy_back") -> tuple[int, StepTiming]:
        return timed(step, lambda: int(_C.restore_segments_from_host(logical)))

    def host_waiting(self) -> int:
        return int(_C.host_staged_segments())

    @staticmethod
    def _unbacked() -> set[int]:
        return {address for address, _size, _device, mapped in _C.vmm_segments() if not mapped}


def host_memory_available() -> Optional[int]:
    """MemAvailable of /proc/meminfo in bytes; None where it cannot be read."""
    try:
        with open("/proc/meminfo") as meminfo:
            for line in meminfo:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        pass
    return None


def close_fds(entries: Iterable[tuple[int, int, int]]) -> None:
    for _address, _size, fd in entries:
        try:
            os.close(fd)
        except OSError:
            pass
