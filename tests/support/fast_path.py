"""The job the fast path's tests (test_fast_*.py) run over the fake driver: segments from the real
allocator functions (flexium_vmm_alloc/free through ctypes, as PyTorch calls them), which the fake
backs with host memory, so that their bytes are read and compared; a stand-in for flexium's
MemoryPool, which CPU torch cannot install, with the attributes FastPath reads (active, reason_off,
live_ranges); a real CPU torch training thread, whose optimizer.step() hook gives the safe points.
Every test gives back all it made: no segment, host stash, pinned pool or fd stays behind.

Test modules import what they use: ``from support.fast_path import Job, job`` beside
support.engine's ``driver, fake, make_engine, nvml_in_parent``, which the job fixture asks for."""

from __future__ import annotations

import ctypes
import os
import random
import threading
import time
from collections.abc import Callable, Iterator
from typing import Any

import pytest
import torch

from flexium import _C
from flexium.engine import EngineState
from flexium.engine.fast.device_moves import Staged
from flexium.engine.fast.path import FastPath
from flexium.errors import OperationFailedError
from support.engine import wait_until
from support.fake_driver import FakeDriver, ProcessState

FAST_MIGRATION = ["prepare", "checksum", "copy", "verify", "release", "lock", "checkpoint", "restore", "unlock", "map"]
OWNING_NOTE = "the moved memory becomes the job's own over the next optimizer steps (4.00 GiB each)"
FAST_PAUSE = ["prepare", "checksum", "copy", "release", "lock", "checkpoint", "copier_sleep"]
FAST_RESUME = ["restore", "unlock", "copy_back", "verify"]
CUDA_ERROR_UNKNOWN = 999
# A restore refused for its arguments: the one failure measured to leave the process restorable (fact
# `failed-restore-stays-checkpointed`); the simulated driver takes any other as real ones were (lost).
CUDA_ERROR_INVALID_VALUE = 1


class StandInPool:
    """What FastPath reads of a MemoryPool; `ranges` answers live_ranges ({}: whole segments)."""

    def __init__(self, ranges: dict[int, list[tuple[int, int]]] | None = None) -> None:
        self.active = True
        self.reason_off: str | None = None
        self.ranges = ranges or {}
        self.asked: list[int] = []

    def live_ranges(self, device: int) -> dict[int, list[tuple[int, int]]]:
        self.asked.append(device)
        return dict(self.ranges)


class RecordingFastPath(FastPath):
    """FastPath that keeps what it staged, so a test can see (and after a failed rollback
    recover) the copies the engine holds only by fd."""

    def __init__(self, pool: Any) -> None:
        super().__init__(pool)
        self.staged: list[Staged] = []
        self._inodes: dict[int, int] = {}

    def stage_to_device(self, logical: int, target_ordinal: int, *args: Any, **kwargs: Any) -> Any:
        staged, timing = super().stage_to_device(logical, target_ordinal, *args, **kwargs)
        self.staged.append(staged)
        self._inodes.update((s.fd, os.fstat(s.fd).st_ino) for s in staged.entries)
        return staged, timing

    def close_leftovers(self) -> None:
        """Closes staged fds still open (a test that failed before recovering them), so that
        no copy outlives the test; a number reused for another file since is left alone."""
        for fd, inode in self._inodes.items():
            try:
                if os.fstat(fd).st_ino == inode:
                    os.close(fd)
            except OSError:
                pass


class Trainer(threading.Thread):
    """A plain CPU training loop: each optimizer.step() is a safe point."""

    def __init__(self) -> None:
        super().__init__(daemon=True, name="trainer")
        self.model = torch.nn.Linear(4, 1)
        self.optimizer = torch.optim.SGD(self.model.parameters(), lr=0.01)
        self.data = torch.randn(16, 4)
        self.steps = 0
        self.error: BaseException | None = None
        self.stopping = threading.Event()
        self.tid = 0

    def run(self) -> None:
        self.tid = threading.get_native_id()
        try:
            while not self.stopping.is_set():
                loss = self.model(self.data).pow(2).mean()
                self.optimizer.zero_grad()
                loss.backward()
                self.optimizer.step()
                self.steps += 1
                time.sleep(0.001)
        except BaseException as exc:
            self.error = exc


class Job:
    """Segments, an engine with the fast path, a training thread; all given back at the end."""

    def __init__(self, fake: FakeDriver, make_engine: Callable[..., Any]) -> None:
        self.fake = fake
        self._make_engine = make_engine
        lib = ctypes.CDLL(_C.__file__)
        self._alloc = lib.flexium_vmm_alloc
        self._alloc.restype = ctypes.c_void_p
        self._alloc.argtypes = [ctypes.c_size_t, ctypes.c_int, ctypes.c_void_p]
        self._free = lib.flexium_vmm_free
        self._free.restype = None
        self._free.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int, ctypes.c_void_p]
        self.contents: dict[int, bytes] = {}
        self.engines: list[Any] = []
        self.trainers: list[Trainer] = []
        self.fast: RecordingFastPath | None = None

    def segments(self, sizes: list[int], device: int = 0) -> list[int]:
        addresses = []
        for size in sizes:
            address = self._alloc(size, device, None)
            assert address, _C.vmm_last_error()
            data = random.Random(address ^ size).randbytes(size)
            ctypes.memmove(address, data, size)
            self.contents[address] = data
            addresses.append(address)
        return addresses

    @property
    def total(self) -> int:
        return sum(len(d) for d in self.contents.values())

    def assert_contents(self) -> None:
        for address, data in self.contents.items():
            assert ctypes.string_at(address, len(data)) == data, f"segment {address:#x} changed"

    def engine(self, ranges: dict[int, list[tuple[int, int]]] | None = None, **kwargs: Any) -> Any:
        """An engine on cuda:0 with the fast path (one per test: close() recovers its copies)."""
        self.pool = StandInPool(ranges)
        self.fast = RecordingFastPath(self.pool)
        engine = self._make_engine(fast_path=self.fast, **kwargs)
        self.engines.append(engine)
        self.fast._wait_for_start()  # the copier process is up (its socket counts in open_fds())
        return engine

    def training(self, sizes: list[int]) -> Any:
        """Segments of these sizes, an engine and a training thread: the usual start of a test."""
        self.segments(sizes)
        engine = self.engine()
        self.train()
        return engine

    def train(self) -> Trainer:
        trainer = Trainer()
        trainer.start()
        self.trainers.append(trainer)
        wait_until(lambda: trainer.steps >= 2, what="training to start")
        return trainer

    def assert_home(self, physical: int, device: int = 0, held_by_fds: int = 0) -> None:
        """Every segment backed and mapped for logical `device`, its memory on `physical`, its
        bytes intact, nothing else of the VMM model alive (no copy, stream or context left) but at
        most `held_by_fds` allocations held by their fds alone (the pieces of a kept staging of
        driver-made host memory this process mapped for its own copies)."""
        n = len(self.contents)
        assert [(s.address, s.size, s.device, s.mapped) for s in _C.vmm_segments()] == [
            (a, len(d), device, True) for a, d in sorted(self.contents.items())
        ]
        on = {gpu: self.fake.vmm_bytes_on(gpu) for gpu in (physical, 1 - physical)}
        allocations = (self.fake.vmm_allocations(), self.fake.vmm_handles(), self.fake.vmm_mappings())
        assert on == {physical: self.total, 1 - physical: 0}, (
            f"VMM bytes by GPU {on}, expected {self.total} on {physical} ({n} segments); allocations, handles "
            f"and mappings {allocations}"
        )
        assert self.fake.vmm_handles() == self.fake.vmm_mappings() == n
        assert n <= self.fake.vmm_allocations() <= n + held_by_fds
        assert self.fake.vmm_reservations() == n and self.fake.live_streams() == 0
        assert self.fake.primary_ctx_refcount(0) == self.fake.primary_ctx_refcount(1) == 0
        self.assert_contents()

    def assert_copies_map_back(self, fds_before: int, physical: int) -> None:
        """After a failed rollback nothing is lost: the last fast move's copies, still held by their
        fds, map back at the segments' addresses once the driver lets them."""
        self.fake.clear_failures()
        assert self.fast is not None
        staged = self.fast.staged[-1]
        assert open_fds() - fds_before == len(staged.entries) == len(self.contents)
        _C.map_imported(staged.entries, 0)
        self.assert_home(physical=physical)
        assert open_fds() == fds_before

    def close(self) -> None:
        for engine in self.engines:
            engine.stop()  # a paused job resumes, which lets a parked trainer go
        for trainer in self.trainers:
            trainer.stopping.set()
            trainer.join(5)
        fake = self.fake
        fake.clear_failures()
        fake.reset()  # a test that failed half way may have left the process locked
        if self.fast is not None:
            self.fast._wait_for_release()
        if _C.host_staged_segments():
            _C.restore_segments_from_host()
        _C.release_host_staging()
        for segment in _C.vmm_segments():
            self._free(segment.address, 0, 0, None)
        if self.fast is not None:
            self.fast.close_leftovers()
        assert all(t.error is None for t in self.trainers), [t.error for t in self.trainers]
        assert _C.vmm_segment_count() == 0
        assert fake.vmm_allocations() == 0 and fake.pinned_bytes() == 0, fake.vmm_leaks()


@pytest.fixture
def job(fake: FakeDriver, make_engine: Callable[..., Any], nvml_in_parent: Any) -> Iterator[Job]:
    job = Job(fake, make_engine)
    try:
        yield job
    finally:
        job.close()


def staging_mapped_in(pid: int) -> int:
    """Bytes of the host staging's memfds whose pages are mapped in process `pid` (its smaps' Rss of them):
    a page written through the file is in no mapping until something maps it in."""
    mapped, in_staging = 0, False
    with open(f"/proc/{pid}/smaps") as smaps:
        for line in smaps:
            first = line.split(maxsplit=1)[0]
            if "-" in first and not first.endswith(":"):  # a mapping's header line
                in_staging = "memfd:flexium-host-staging" in line
            elif in_staging and first == "Rss:":
                mapped += int(line.split()[1]) * 1024
    return mapped


def copier_processes() -> list[int]:
    """Pids of this process's children that run the copier."""
    found = []
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/stat") as stat:
                ppid = int(stat.read().rsplit(")", 1)[1].split()[1])
            with open(f"/proc/{entry}/cmdline", "rb") as cmdline:
                command = cmdline.read()
        except (OSError, ValueError, IndexError):
            continue
        if ppid == os.getpid() and b"flexium.engine.fast.host_copier_process" in command:
            found.append(int(entry))
    return found


def zombie(pid: int) -> bool:
    """Whether process `pid` has ended (a zombie, or gone)."""
    try:
        with open(f"/proc/{pid}/stat") as stat:
            return stat.read().rsplit(")", 1)[1].split()[0] == "Z"
    except OSError:
        return True


def open_fds() -> int:
    """How many files are open. The fake keeps one memfd per live allocation and the staged
    copies are fds too: with the allocations back to one per segment, an fd the engine failed
    to close shows as one more (vmm_allocations() sees the copy it keeps alive as well)."""
    return len(os.listdir("/proc/self/fd"))


def locking_threads(fake: FakeDriver) -> set[int]:
    return {c.tid for c in fake.calls("cuCheckpointProcessLock")}


def names(result: Any) -> list[str]:
    return [s.step for s in result.steps]


def failure(call: Callable[[], Any], error: type = OperationFailedError) -> Any:
    with pytest.raises(error) as caught:
        call()
    return caught.value


def rolled_back(job: Job, engine: Any, error: OperationFailedError, step: str, fds: int) -> Any:
    """The job runs on its source GPU as before, every segment home and intact, nothing leaked."""
    result = error.result
    assert error.step == step and result.failed_step == step and not result.ok and result.path == "fast"
    assert result.error.endswith("rolled back: the job runs on cuda:0 as before") or result.error.endswith(
        "nothing moved: the job runs on cuda:0 as before"
    )
    assert engine.state == EngineState.RUNNING and job.fake.state() == ProcessState.RUNNING
    assert job.fake.placement() == [0, 1] and engine.placement()[1].device == "cuda:0"
    job.assert_home(physical=0)
    # The copier's socket and the staging's memfds close in the background release.
    wait_until(lambda: open_fds() == fds, what="the copier and the staging to be given back")
    assert job.fake.pending_failures() == 0
    return result
