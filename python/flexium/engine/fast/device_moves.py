"""The fast path's GPU-to-GPU steps (docs/fast-path.md, a fast migration): the segments copied to
the target GPU, their source memory released, the copies mapped back at their own addresses,
made our own, or, for a rollback, brought home. Each a timed step that names itself on failure."""

from __future__ import annotations

import os
import sys
from collections.abc import Iterable
from dataclasses import dataclass, replace

from flexium import _C
from flexium.engine.fast.memory_pool import LiveRanges, MemoryPool
from flexium.engine.fast.steps import timed
from flexium.engine.operations import StepTiming


@dataclass
class Staged:
    """Copies of the segments on the target GPU, held only by these fds until mapped back."""

    entries: list[_C.StagedSegment]
    copied_bytes: int
    checksum_s: float = 0.0  # spent on the copies' checksums (stage_to_device's checksum_copies)

    @property
    def segment_bytes(self) -> int:
        return sum(entry.size for entry in self.entries)


class DeviceMoves:
    """FastPath's GPU-to-GPU steps, over its pool."""

    pool: MemoryPool

    def stage_to_device(
        self, logical: int, target_ordinal: int, live: LiveRanges | None = None, checksum_copies: bool = False
    ) -> tuple[Staged, StepTiming]:
        """The `copy` step; with `checksum_copies`, each copy's checksum where it landed is in its
        entry and the seconds spent on them in `Staged.checksum_s`, left out of the step's."""

        def work() -> Staged:
            ranges = self.pool.live_ranges(logical) if live is None else live
            entries = _C.stage_segments_to_device(target_ordinal, logical, ranges, checksum_copies=checksum_copies)
            return Staged(entries, _C.last_staged_copy_bytes(), _C.last_staged_checksum_seconds())

        staged, timing = timed("copy", work)
        return staged, replace(timing, seconds=max(0.0, timing.seconds - staged.checksum_s))

    def release(self, logical: int) -> StepTiming:
        return timed("release", lambda: _C.release_source_backing(logical))[1]

    def map_back(self, staged: Staged, logical: int) -> StepTiming:
        """Maps the copies at their addresses for `logical` (now on the target GPU)."""
        return timed("map", lambda: self._map(staged, logical))[1]

    def own(self, logical: int, max_bytes: int = sys.maxsize) -> StepTiming:
        """Replaces the memory that came in through fds with memory of our own (whole segments
        until `max_bytes` are replaced): a driver checkpoint cannot restore imported memory (its
        restore fails, CUDA_ERROR_NOT_SUPPORTED, and leaves the process stuck), and NVML does not
        count it for the process."""
        return timed("own", lambda: _C.own_imported(logical, self.pool.live_ranges(logical), max_bytes))[1]

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
        close_fds([e for e in staged.entries if e.address not in waiting])
        staged.entries = [e for e in staged.entries if e.address in waiting]
        try:
            _C.map_imported(staged.entries, logical)
        finally:
            still = self._unbacked()
            staged.entries = [e for e in staged.entries if e.address in still]

    @staticmethod
    def _unbacked() -> set[int]:
        return {s.address for s in _C.vmm_segments() if not s.mapped}


def close_fds(entries: Iterable[_C.StagedSegment]) -> None:
    for entry in entries:
        try:
            os.close(entry.fd)
        except OSError:
            pass
