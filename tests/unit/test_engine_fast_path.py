"""The engine's fast path over the fake driver: migrate / pause / resume moving the memory pool's
segments themselves at a safe point (flexium.engine.fast.path), and every failure's rollback.

The segments come from the real allocator functions (flexium_vmm_alloc/free through ctypes, as
PyTorch calls them); the fake backs them with host memory, so their bytes are read and compared
here. CPU torch cannot install flexium's MemoryPool, so a stand-in with the attributes FastPath
reads (active, reason_off, live_ranges) takes its place. A real CPU torch training thread gives
the safe points (its optimizer.step() hook); the test thread asks for the operations.
Every test gives back all it made: no segment, host stash, pinned pool or fd stays behind."""

from __future__ import annotations

import ctypes
import os
import random
import re
import signal
import threading
import time
from typing import Any, Callable, Iterator, Optional

import pytest

torch = pytest.importorskip("torch")

from engine_fixtures import (  # noqa: E402,F401  (fixtures)
    H200_BYTES,
    PID,
    GiB,
    HostMemory,
    MiB,
    checkpoint_ops,
    driver,
    fake,
    host_memory,
    make_engine,
    nvml_in_parent,
    step_summary,
    wait_until,
)
from fake_driver import FakeDriver, ProcessState  # noqa: E402
from flexium import _C  # noqa: E402
from flexium.engine import EngineState  # noqa: E402
from flexium.engine.fast.path import FastPath, Staged  # noqa: E402
from flexium.engine.operations import GpuIdentity  # noqa: E402
from flexium.errors import (  # noqa: E402
    CapabilityError,
    InvalidStateError,
    OperationFailedError,
    RollbackFailedError,
    TargetRefusedError,
)

FAST_MIGRATION = ["prepare", "copy", "release", "lock", "checkpoint", "restore", "unlock", "map"]
OWNING_NOTE = "the moved memory becomes the job's own over the next optimizer steps (4.00 GiB each)"
FAST_PAUSE = ["prepare", "copy", "release", "lock", "checkpoint", "copier_sleep"]


class StandInPool:
    """What FastPath reads of a MemoryPool; `ranges` answers live_ranges ({}: whole segments)."""

    def __init__(self, ranges: Optional[dict[int, list[tuple[int, int]]]] = None) -> None:
        self.active = True
        self.reason_off: Optional[str] = None
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

    def stage_to_device(self, logical: int, target_ordinal: int) -> Any:
        staged, timing = super().stage_to_device(logical, target_ordinal)
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
        self.error: Optional[BaseException] = None
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
        self.fast: Optional[RecordingFastPath] = None

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

    def engine(self, ranges: Optional[dict[int, list[tuple[int, int]]]] = None, **kwargs: Any) -> Any:
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

    def assert_home(self, physical: int, device: int = 0) -> None:
        """Every segment backed and mapped for logical `device`, its memory on `physical`, its
        bytes intact, nothing else of the VMM model alive (no copy, stream or context left)."""
        n = len(self.contents)
        assert [(s.address, s.size, s.device, s.mapped) for s in _C.vmm_segments()] == [
            (a, len(d), device, True) for a, d in sorted(self.contents.items())
        ]
        assert self.fake.vmm_bytes_on(physical) == self.total and self.fake.vmm_bytes_on(1 - physical) == 0
        assert self.fake.vmm_allocations() == self.fake.vmm_handles() == self.fake.vmm_mappings() == n
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


# ----------------------------------------------------------------------------- migrate


def test_fast_migration_there_and_back(job: Job) -> None:
    fake = job.fake
    job.segments([2 * MiB, 4 * MiB, 6 * MiB])
    fake.set_process_memory(0, GiB)  # the rest of the process (context...), carried by the checkpoint
    engine = job.engine()
    trainer = job.train()
    fds = open_fds()
    fake.clear_log()

    result = engine.migrate(engine.gpus[1])

    assert result.ok and result.path == "fast" and result.failed_step is None
    assert step_summary(result) == [(s, True, False) for s in FAST_MIGRATION]
    assert result.notes == ("fast path: copied 0.01 GiB in use of 0.01 GiB in 3 pool segments", OWNING_NOTE)
    assert job.fast is not None and job.fast.staged[0].copied_bytes == job.total
    assert checkpoint_ops(fake) == ["Lock", "Checkpoint", "Restore", "Unlock"]
    # The copies, mapped, become the job's own at the next optimizer steps, outside the downtime.
    wait_until(lambda: _C.vmm_imported_count() == 0, what="the moved memory to become the job's own")
    assert job.pool.asked[:2] == [0, 0]  # the copy and the own slices copy live ranges only
    assert locking_threads(fake) == {trainer.tid}  # at the end of an optimizer step
    assert fake.blocked_calls() == 0 and fake.deadlocks() == 0
    assert engine.state == EngineState.RUNNING and fake.state() == ProcessState.RUNNING
    assert fake.placement() == [1, 0] and engine.placement()[1].device == "cuda:1"
    job.assert_home(physical=1)  # registry: still logical device 0; memory: GPU 1
    assert fake.process_bytes_on(1) == GiB + job.total and fake.process_bytes_on(0) == 0
    assert open_fds() == fds  # every staged fd was closed when its copy was mapped

    back = engine.migrate(engine.gpus[0])
    assert back.ok and back.path == "fast" and names(back) == FAST_MIGRATION
    assert fake.placement() == [0, 1] and engine.placement()[1].device == "cuda:0"
    job.assert_home(physical=0)
    assert open_fds() == fds
    wait_until(lambda: _C.vmm_imported_count() == 0, what="the moved memory to become the job's own")

    # Nothing imported is left for a driver checkpoint to trip over.
    driver = engine.migrate(engine.gpus[1], path="driver")
    assert driver.ok and driver.path == "driver" and fake.placement() == [1, 0]
    assert names(driver) == ["prepare", "lock", "checkpoint", "room", "restore", "unlock"]
    job.assert_home(physical=1)


def fast_move_left_imported(engine: Any, job: Job, target: GpuIdentity) -> None:
    """A fast move whose first own slice fails (no memory for the job's own copies): the move
    stands and the job goes on running on the imported copies."""
    # The copy makes one allocation per segment, then the first own slice's first one fails.
    job.fake.fail("cuMemCreate", "CUDA_ERROR_OUT_OF_MEMORY", nth=len(_C.vmm_segments()) + 1)
    result = engine.migrate(target)
    assert result.ok and result.path == "fast" and result.notes[-1] == OWNING_NOTE
    wait_until(lambda: job.fake.pending_failures() == 0, what="the first own slice")
    assert _C.vmm_imported_count() == len(_C.vmm_segments())


def test_imported_memory_keeps_a_driver_checkpoint_out_until_it_is_our_own(job: Job) -> None:
    fake = job.fake
    job.segments([2 * MiB, 4 * MiB])
    engine = job.engine(safe_point_wait_seconds=0.3)
    trainer = job.train()
    fast_move_left_imported(engine, job, engine.gpus[1])

    # No optimizer step: the driver path would have to carry imported memory; refused untouched.
    trainer.stopping.set()
    trainer.join(5)
    fake.clear_log()
    with pytest.raises(OperationFailedError, match=r"no optimizer step \(safe point\) came within 0.3 s") as refused:
        engine.migrate(engine.gpus[0])
    assert refused.value.step == "validate" and checkpoint_ops(fake) == []
    assert engine.state == EngineState.RUNNING and _C.vmm_imported_count() == 2
    job.assert_home(physical=1)

    # At a safe point, making it our own fails (no memory left): still refused untouched.
    job.train()
    fake.fail("cuMemCreate", "CUDA_ERROR_OUT_OF_MEMORY", nth=1)
    with pytest.raises(OperationFailedError, match="failed at step 'own' before anything was locked") as failed:
        engine.migrate(engine.gpus[0], path="driver")
    assert failed.value.step == "own" and checkpoint_ops(fake) == []
    assert engine.state == EngineState.RUNNING
    job.assert_home(physical=1)

    # The fast path needs no own memory: it moves the imported segments like any other.
    back = engine.migrate(engine.gpus[0])
    assert back.ok and back.path == "fast" and fake.placement() == [0, 1]
    job.assert_home(physical=0)


def test_on_the_training_thread_the_driver_path_makes_the_memory_its_own_first(job: Job) -> None:
    """recoverable() moves the job from the training thread, outside an optimizer step: nothing else
    launches work meanwhile, so imported memory can be made the job's own there too."""
    fake = job.fake
    job.segments([2 * MiB, 4 * MiB])
    engine = job.engine()
    trainer = job.train()
    fast_move_left_imported(engine, job, engine.gpus[1])
    trainer.stopping.set()
    trainer.join(5)

    outcome: dict[str, Any] = {}

    def training_thread() -> None:
        model = torch.nn.Linear(2, 1)
        optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
        model(torch.ones(1, 2)).sum().backward()
        optimizer.step()  # this thread is now the training thread
        try:
            outcome["result"] = engine.migrate(engine.gpus[0])
        except Exception as exc:  # reported to the test
            outcome["error"] = exc

    thread = threading.Thread(target=training_thread)
    thread.start()
    thread.join(30)
    assert "error" not in outcome, outcome
    result = outcome["result"]
    assert result.ok and result.path == "driver" and names(result)[:2] == ["own", "prepare"]
    assert result.notes == ("driver path: called on the training thread outside an optimizer step",)
    assert _C.vmm_imported_count() == 0 and fake.placement() == [0, 1]
    job.assert_home(physical=0)


def test_the_fake_driver_cannot_restore_imported_memory_either(job: Job) -> None:
    """What the H200s showed (docs/fast-path.md), kept by the fake so the engine's guard is tested."""
    fake = job.fake
    engine = job.training([2 * MiB])
    fast_move_left_imported(engine, job, engine.gpus[1])
    outcomes = _C.run_steps(
        PID,
        [_C.Step(_C.StepKind.LOCK, timeout_ms=1000), _C.Step(_C.StepKind.CHECKPOINT), _C.Step(_C.StepKind.RESTORE)],
        [[], [], [_C.Step(_C.StepKind.RECOVER)]],
    )
    assert [(o.step, o.rollback, o.error_name) for o in outcomes] == [
        ("lock", False, ""),
        ("checkpoint", False, ""),
        ("restore", False, "CUDA_ERROR_NOT_SUPPORTED"),
        ("restore", True, "CUDA_ERROR_NOT_SUPPORTED"),
        ("unlock", True, "CUDA_ERROR_ILLEGAL_STATE"),
    ]
    assert fake.state() == ProcessState.CHECKPOINTED  # stuck, as on the real driver
    fake.reset()  # the fixture's cleanup needs a running process


def test_only_the_live_ranges_are_copied(job: Job) -> None:
    partial, whole, idle = job.segments([64 * MiB, 2 * MiB, 4 * MiB])
    live = [(0, 16 * MiB), (40 * MiB, 8 * MiB + 4096)]
    engine = job.engine(ranges={partial: live, idle: []})
    job.train()

    result = engine.migrate(engine.gpus[1])

    assert result.ok and result.path == "fast"
    copied = 24 * MiB + 4096 + 2 * MiB  # the live ranges, the unlisted segment whole, nothing of idle
    assert job.fast is not None and job.fast.staged[0].copied_bytes == copied
    assert result.notes == (
        f"fast path: copied {copied / GiB:.2f} GiB in use of {job.total / GiB:.2f} GiB in 3 pool segments",
        OWNING_NOTE,
    )
    wait_until(lambda: _C.vmm_imported_count() == 0, what="the moved memory to become the job's own")
    assert ctypes.string_at(whole, 2 * MiB) == job.contents[whole]
    data = job.contents[partial]
    for offset, length in live:
        assert ctypes.string_at(partial + offset, length) == data[offset : offset + length]
    # Fresh memory of the fake is zeroed: what lay outside the live ranges did not come along.
    assert ctypes.string_at(partial + 16 * MiB, 24 * MiB) == bytes(24 * MiB)
    assert ctypes.string_at(partial + 48 * MiB + 4096, 16 * MiB - 4096) == bytes(16 * MiB - 4096)
    assert ctypes.string_at(idle, 4 * MiB) == bytes(4 * MiB)
    assert job.fake.vmm_bytes_on(1) == job.total and job.fake.vmm_bytes_on(0) == 0


def test_a_live_range_outside_its_segment_fails_the_copy(job: Job) -> None:
    first, second = job.segments([2 * MiB, 2 * MiB])
    engine = job.engine(ranges={second: [(MiB, 2 * MiB)]})
    job.train()
    fds = open_fds()
    error = failure(lambda: engine.migrate(engine.gpus[1]))
    result = rolled_back(job, engine, error, "copy", fds)
    assert result.error == (
        f"step 'copy' failed: ValueError: live range ({MiB}, {2 * MiB}) lies outside segment {second:#x} "
        f"({2 * MiB} bytes, device 0); nothing moved: the job runs on cuda:0 as before"
    )
    assert checkpoint_ops(job.fake) == []


# ----------------------------------------------------------------------------- which path


def test_the_driver_path_when_asked_or_without_a_safe_point(job: Job) -> None:
    fake = job.fake
    job.segments([2 * MiB, 4 * MiB])
    engine = job.engine()

    # No optimizer step has been seen: "auto" takes the driver path and says why.
    result = engine.migrate(engine.gpus[1])
    assert result.ok and result.path == "driver"
    assert result.notes == ("driver path: no optimizer step has run yet (training has not started)",)
    assert names(result) == ["prepare", "lock", "checkpoint", "room", "restore", "unlock"]
    assert job.fast is not None and job.fast.staged == [] and job.pool.asked == []
    job.assert_home(physical=1)  # the checkpoint carried the segments

    # "fast" refuses without a safe point, before anything is touched.
    fake.clear_log()
    error = failure(lambda: engine.migrate(engine.gpus[0], path="fast"), CapabilityError)
    assert str(error) == "the fast path cannot run: no optimizer step has run yet (training has not started)"
    assert engine.state == EngineState.RUNNING and checkpoint_ops(fake) == [] and fake.placement() == [1, 0]

    # At a safe point, "driver" still takes the driver path when asked for.
    trainer = job.train()
    fake.clear_log()
    result = engine.migrate(engine.gpus[0], path="driver")
    assert locking_threads(fake) == {trainer.tid}
    assert result.ok and result.path == "driver" and result.notes == ("driver path: asked for",)
    assert job.fast.staged == [] and fake.placement() == [0, 1]
    job.assert_home(physical=0)


def test_memory_on_two_devices_takes_the_driver_path(job: Job) -> None:
    fake = job.fake
    job.segments([2 * MiB, 2 * MiB], device=0)
    job.segments([4 * MiB], device=1)
    engine = job.engine()
    job.train()
    blocker = "the job also holds memory on cuda:1; the fast path moves one GPU's memory"
    assert engine.fast_path_blocker() == blocker

    error = failure(lambda: engine.migrate(engine.gpus[1], path="fast"), CapabilityError)
    assert str(error) == f"the fast path cannot run: {blocker}"
    assert fake.placement() == [0, 1] and engine.state == EngineState.RUNNING

    result = engine.migrate(engine.gpus[1])
    assert result.ok and result.path == "driver" and result.notes == (f"driver path: {blocker}",)
    assert job.fast is not None and job.fast.staged == []
    assert fake.placement() == [1, 0]
    assert fake.vmm_bytes_on(1) == 4 * MiB and fake.vmm_bytes_on(0) == 4 * MiB  # swapped by the checkpoint
    assert sorted(s.device for s in _C.vmm_segments()) == [0, 0, 1]
    job.assert_contents()
    assert_reachable_from_both(fake)

    paused = engine.pause()
    assert paused.ok and paused.path == "driver"
    assert fake.vmm_bytes_on(0) == fake.vmm_bytes_on(1) == 0
    assert engine.resume().ok and fake.placement() == [1, 0]
    job.assert_contents()
    assert_reachable_from_both(fake)


def test_memory_of_pytorchs_own_allocator_on_another_gpu_takes_the_driver_path(job: Job) -> None:
    """The pool is on the job's own GPU only: a model split over devices or DataParallel holds
    memory on the other GPU through PyTorch's allocator, which NVML sees and the pool does not."""
    fake = job.fake
    job.segments([2 * MiB, 2 * MiB], device=0)
    engine = job.engine()
    job.train()
    assert engine.fast_path_blocker() is None
    fake.set_process_memory(1, 512 * MiB)
    blocker = "the job also holds memory on cuda:1; the fast path moves one GPU's memory"
    assert engine.fast_path_blocker() == blocker
    result = engine.pause()
    assert result.ok and result.path == "driver" and result.notes == (f"driver path: {blocker}",)
    assert job.fast is not None and job.fast.staged == []
    assert engine.resume().ok
    job.assert_contents()


def test_a_job_on_two_gpus_resumes_where_each_gpu_has_room_for_its_share(job: Job) -> None:
    """A process on two GPUs that holds 100 GiB on each comes back to them: each GPU needs its
    own share, not the 200 GiB of both. A GPU that filled up meanwhile keeps it paused, named."""
    fake = job.fake
    job.segments([2 * MiB], device=0)
    job.segments([2 * MiB], device=1)
    engine = job.engine()
    job.train()
    share = 100 * (1 << 30)
    fake.set_process_memory(0, share)
    fake.set_process_memory(1, share)
    assert engine.pause().ok
    fake.set_other_memory(1, H200_BYTES - share)  # another job took GPU 1 meanwhile
    with pytest.raises(TargetRefusedError, match=r"^cuda:1 has .* free; the paused job held 100\.00 GiB there"):
        engine.resume()
    assert engine.state == EngineState.PAUSED
    fake.set_other_memory(1, 0)
    resumed = engine.resume()
    assert resumed.ok and resumed.path == "driver" and fake.placement() == [0, 1]
    job.assert_contents()
    assert_reachable_from_both(fake)
    fake.set_process_memory(0, 0)
    fake.set_process_memory(1, 0)


def assert_reachable_from_both(fake: FakeDriver) -> None:
    """A process using two GPUs copies between their memory (DataParallel's scatter and gather)."""
    on = {s.device: s.address for s in _C.vmm_segments()}
    for device in (0, 1):
        other = on[1 - device]  # read and written in place: the contents stay
        assert fake.copy_on(device, other, other, MiB) == 0, f"cuda:{device} cannot reach cuda:{1 - device}"


# ----------------------------------------------------------------------------- failures, rolled back


@pytest.mark.parametrize("code", ["CUDA_ERROR_UNKNOWN", "CUDA_ERROR_OUT_OF_MEMORY"])
def test_a_failed_copy_moves_nothing(job: Job, code: str) -> None:
    engine = job.training([2 * MiB, 4 * MiB, 2 * MiB])
    fds = open_fds()
    job.fake.fail("cuMemcpyDtoDAsync", code, nth=2)
    error = failure(lambda: engine.migrate(engine.gpus[1]))
    result = rolled_back(job, engine, error, "copy", fds)
    assert step_summary(result) == [("prepare", True, False), ("copy", False, False)]
    assert result.error.startswith(f"step 'copy' failed: DriverError: cuMemcpyDtoDAsync failed: {code}")
    assert result.error.endswith("; nothing moved: the job runs on cuda:0 as before")
    assert checkpoint_ops(job.fake) == []
    assert engine.migrate(engine.gpus[1]).ok  # nothing left behind blocks the next try
    job.assert_home(physical=1)


# The copy unmaps and releases each of its 3 temporary copies first. Unmap #5: the release fails
# at the 2nd segment, the 1st has lost its memory (its data now only in the copy on GPU 1).
# Release #4: the 1st segment is unmapped but keeps its handle.
@pytest.mark.parametrize("call,nth", [("cuMemUnmap", 5), ("cuMemRelease", 4)])
def test_a_failed_release_brings_the_released_segments_home(job: Job, call: str, nth: int) -> None:
    engine = job.training([2 * MiB, 4 * MiB, 2 * MiB])
    fds = open_fds()
    job.fake.fail(call, "CUDA_ERROR_UNKNOWN", nth=nth)
    error = failure(lambda: engine.migrate(engine.gpus[1]))
    result = rolled_back(job, engine, error, "release", fds)
    assert step_summary(result) == [
        ("prepare", True, False),
        ("copy", True, False),
        ("release", False, False),
        ("rollback_copy", True, True),
    ]
    assert f"{call} failed: CUDA_ERROR_UNKNOWN" in result.error
    assert checkpoint_ops(job.fake) == []


def test_a_rollback_that_cannot_map_the_copies_fails_the_job(job: Job) -> None:
    fake = job.fake
    job.segments([2 * MiB, 4 * MiB])
    engine = job.engine(lock_timeout_ms=30)
    job.train()
    fds = open_fds()
    fake.set_lock_delay_ms(1000)
    fake.fail("cuMemImportFromShareableHandle", "CUDA_ERROR_UNKNOWN", nth=0)
    error = failure(lambda: engine.migrate(engine.gpus[1]), RollbackFailedError)
    result = error.result
    assert error.step == "lock" and engine.state == EngineState.FAILED
    assert step_summary(result)[-2:] == [("lock", False, False), ("rollback_copy", False, True)]
    assert "; ROLLBACK FAILED: step 'rollback_copy' failed: DriverError: cuMemImportFromShareableHandle" in result.error
    assert result.error.endswith("; restart the job")
    job.assert_copies_map_back(fds, physical=1)
    assert fake.placement() == [0, 1]


def test_a_lock_timeout_is_rolled_back(job: Job) -> None:
    job.segments([2 * MiB, 4 * MiB])
    engine = job.engine(lock_timeout_ms=30)
    job.train()
    fds = open_fds()
    job.fake.set_lock_delay_ms(1000)
    error = failure(lambda: engine.migrate(engine.gpus[1]))
    result = rolled_back(job, engine, error, "lock", fds)
    assert step_summary(result) == [
        ("prepare", True, False),
        ("copy", True, False),
        ("release", True, False),
        ("lock", False, False),
        ("rollback_copy", True, True),
    ]
    assert "cuCheckpointProcessLock returned CUDA_ERROR_TIMEOUT" in result.error
    assert "the process stayed busy in CUDA work past the lock timeout; try again" in result.error


def fail_checkpoint(job: Job, engine: Any) -> None:
    job.fake.fail("cuCheckpointProcessCheckpoint", "CUDA_ERROR_UNKNOWN")


def fail_restore(job: Job, engine: Any) -> None:
    job.fake.fail("cuCheckpointProcessRestore", "CUDA_ERROR_UNKNOWN")


def fill_target_meanwhile(job: Job, engine: Any) -> None:
    """Another process takes GPU 1's memory once the migration has started: the copies (held
    by their fds on GPU 1) still fit, the rest of the process does not."""
    done: list[bool] = []

    def taken(state: EngineState) -> None:
        if state == EngineState.MIGRATING and not done:
            done.append(True)
            job.fake.set_other_memory(1, H200_BYTES - job.total - 2 * MiB)

    engine.add_state_listener(taken)


LOCKED_FAILURES = {
    "checkpoint": (
        fail_checkpoint,
        "cuCheckpointProcessCheckpoint returned CUDA_ERROR_UNKNOWN",
        [("checkpoint", False, False), ("unlock", True, True)],
    ),
    "restore": (
        fail_restore,
        "cuCheckpointProcessRestore returned CUDA_ERROR_UNKNOWN",
        [("checkpoint", True, False), ("restore", False, False), ("restore", True, True), ("unlock", True, True)],
    ),
}


@pytest.mark.parametrize("case", LOCKED_FAILURES)
def test_a_failure_in_the_locked_section_recovers_and_brings_the_segments_home(job: Job, case: str) -> None:
    arm, message, summary = LOCKED_FAILURES[case]
    job.segments([2 * MiB, 4 * MiB, 6 * MiB])
    job.fake.set_process_memory(0, 8 * MiB)
    engine = job.engine()
    job.train()
    fds = open_fds()
    arm(job, engine)
    error = failure(lambda: engine.migrate(engine.gpus[1]))
    step = "checkpoint" if case == "checkpoint" else "restore"
    result = rolled_back(job, engine, error, step, fds)
    assert step_summary(result) == [
        ("prepare", True, False),
        ("copy", True, False),
        ("release", True, False),
        ("lock", True, False),
        *summary,
        ("rollback_copy", True, True),
    ]
    assert message in result.error
    assert job.fake.process_bytes_on(0) == 8 * MiB + job.total and job.fake.process_bytes_on(1) == 0
    job.fake.set_other_memory(1, 0)
    assert engine.migrate(engine.gpus[1]).ok
    job.assert_home(physical=1)


def test_a_target_filled_during_a_fast_move_loses_the_job_and_says_so(job: Job) -> None:
    """The copies still fit on GPU 1, the rest of the process does not: its restore fails for memory,
    after which the driver refuses every restore (docs/facts.md fact 28), the rollback's too."""
    job.segments([2 * MiB, 4 * MiB, 6 * MiB])
    job.fake.set_process_memory(0, 8 * MiB)
    engine = job.engine()
    job.train()
    fill_target_meanwhile(job, engine)
    error = failure(lambda: engine.migrate(engine.gpus[1]), RollbackFailedError)
    assert error.step == "restore" and "cuCheckpointProcessRestore returned CUDA_ERROR_OUT_OF_MEMORY" in str(error)
    assert "(docs/facts.md fact 28), so it can never run CUDA again" in str(error)
    assert engine.state == EngineState.FAILED and job.fake.state() == ProcessState.CHECKPOINTED


def test_a_map_failure_after_the_restore_is_retried(job: Job) -> None:
    fake = job.fake
    engine = job.training([2 * MiB, 4 * MiB, 2 * MiB])
    fds = open_fds()
    # Imports happen only when mapping back: the 2nd segment's fails once, the 1st is mapped by then.
    fake.fail("cuMemImportFromShareableHandle", "CUDA_ERROR_UNKNOWN", nth=2)
    result = engine.migrate(engine.gpus[1])
    assert result.ok and result.path == "fast" and result.error is None
    assert step_summary(result) == [(s, True, False) for s in FAST_MIGRATION[:-1]] + [
        ("map", False, False),
        ("map", True, False),
    ]
    assert "cuMemImportFromShareableHandle failed: CUDA_ERROR_UNKNOWN" in (result.steps[-2].error or "")
    assert fake.placement() == [1, 0] and engine.state == EngineState.RUNNING
    job.assert_home(physical=1)
    assert open_fds() == fds


def test_a_map_failure_that_persists_fails_the_job(job: Job) -> None:
    fake = job.fake
    engine = job.training([2 * MiB, 4 * MiB])
    fds = open_fds()
    fake.fail("cuMemImportFromShareableHandle", "CUDA_ERROR_UNKNOWN", nth=0)
    error = failure(lambda: engine.migrate(engine.gpus[1]), RollbackFailedError)
    result = error.result
    assert error.step == "map" and result.failed_step == "map" and not result.ok
    assert [s[:2] for s in step_summary(result)][-2:] == [("map", False), ("map", False)]
    assert result.error.endswith(
        "ROLLBACK FAILED: the job runs on cuda:1 but part of its memory is not mapped back; restart the job"
    )
    assert engine.state == EngineState.FAILED
    assert failure(lambda: engine.migrate(engine.gpus[0]), InvalidStateError).args[0].endswith("restart the job")
    job.assert_copies_map_back(fds, physical=1)


# ----------------------------------------------------------------------------- pause / resume


def test_fast_pause_and_resume_in_place_and_on_another_gpu(job: Job) -> None:
    fake = job.fake
    engine = job.training([2 * MiB, 4 * MiB, 6 * MiB])
    fds = open_fds()

    paused = engine.pause()
    assert paused.ok and paused.path == "fast" and names(paused) == FAST_PAUSE
    pin_note, copy_note = paused.notes
    assert re.match(r"pinned 0.01 GiB of host staging by the copier process \d+ in ", pin_note), pin_note
    assert "0.01 GiB of it newly mapped" in pin_note
    assert copy_note == "fast path: copied 0.01 GiB in use of 0.01 GiB of pool segments to host memory"
    assert engine.state == EngineState.PAUSED and fake.state() == ProcessState.CHECKPOINTED
    assert [fake.process_bytes_on(g) for g in (0, 1)] == [0, 0] and fake.vmm_bytes_on(0) == 0
    # Room for an eighth more than the pool held (12 MiB), in whole huge pages: 14 MiB.
    assert _C.host_staged_segments() == 3 and _C.host_staging_pool_bytes() == 14 * MiB
    # Pinned before the safe point by the copier process: never in this one.
    assert fake.pinned_at_last_checkpoint() == 0 and fake.call_count("cuMemHostRegister") == 0
    assert [s.mapped for s in _C.vmm_segments()] == [False] * 3

    resumed = engine.resume()
    assert resumed.ok and resumed.path == "fast" and names(resumed) == ["restore", "unlock", "copy_back"]
    assert engine.state == EngineState.RUNNING and fake.placement() == [0, 1]
    job.assert_home(physical=0)
    assert _C.host_staged_segments() == 0
    # The staging goes back to the host in the background; the copier stays, asleep, for the next pause.
    wait_until(
        lambda: _C.host_staging_pool_bytes() == 0 and open_fds() == fds, what="the host staging to be given back"
    )
    assert len(copier_processes()) == 1
    assert fake.pinned_bytes() == 0

    again = engine.pause()  # mapped, touched and pinned again
    assert (
        again.ok and again.path == "fast" and again.notes[0].startswith("pinned 0.01 GiB of host staging by the copier")
    )
    assert fake.pinned_bytes() == 0 and fake.pinned_at_last_checkpoint() == 0
    elsewhere = engine.resume(target=engine.gpus[1])
    assert elsewhere.ok and elsewhere.path == "fast" and elsewhere.target.device == "cuda:1"
    assert names(elsewhere) == ["restore", "unlock", "copy_back"]
    assert fake.placement() == [1, 0] and engine.placement()[1].device == "cuda:1"
    job.assert_home(physical=1)


def test_a_resume_with_room_for_the_job_but_not_the_copier_copies_back_in_this_process(job: Job) -> None:
    """The copier's context would take room the restore needs (a restore without room loses the job,
    docs/facts.md fact 28): it sleeps on, and this process copies back."""
    fake = job.fake
    fake.set_process_memory(0, 256 * MiB)  # what the driver restores; the pool comes back by copies
    engine = job.training([2 * MiB, 4 * MiB, 6 * MiB])
    paused = engine.pause()
    assert paused.ok and paused.path == "fast"
    # Beside another process the restore's 256 MiB get 512 MiB of headroom: 600 MiB more than the job
    # held are enough, but not with the copier's context as well.
    fake.set_other_memory(0, H200_BYTES - paused.bytes_moved - 600 * MiB)
    resumed = engine.resume()
    assert resumed.ok and resumed.path == "fast" and names(resumed) == ["restore", "unlock", "copy_back"]
    coming = paused.bytes_moved >> 20
    assert resumed.notes[-1] == (
        f"the copies to and from host memory ran in this process: the GPU has {coming + 600} MiB free, less than "
        f"the {coming + 1030} MiB the copier's context needs beside the {coming} MiB the job comes back with"
    )
    job.assert_home(physical=0)
    assert len(copier_processes()) == 1  # asleep, for the next pause
    # With room again, the copier copies back as before.
    fake.set_other_memory(0, 0)
    assert engine.pause().ok
    again = engine.resume()
    assert again.ok and not any(n.startswith("the copies to and from host memory ran in this") for n in again.notes)
    job.assert_home(physical=0)


def test_a_copy_back_that_finds_no_room_pauses_the_job_again(job: Job) -> None:
    """Another process takes the GPU after the room check: the restore (a small image after a fast
    pause) fits, the pool's memory does not. The driver checkpoints the job again and it stays
    paused, on the GPU it was resumed on, its memory in host memory; later it resumes."""
    fake = job.fake
    engine = job.training([2 * MiB, 4 * MiB, 6 * MiB])
    assert engine.pause().ok
    fake.fail("cuMemCreate", "CUDA_ERROR_OUT_OF_MEMORY", nth=0)
    error = failure(lambda: engine.resume(target=engine.gpus[1]))
    assert not isinstance(error, RollbackFailedError) and error.step == "copy_back"
    assert names(error.result) == ["restore", "unlock", "copy_back", "lock", "checkpoint", "copier_sleep"]
    assert "CUDA_ERROR_OUT_OF_MEMORY" in str(error)
    assert str(error).endswith(
        "another process took memory on cuda:1 after the room check; the job is paused again, its memory in host "
        f"memory: free {error.result.bytes_moved / GiB:.2f} GiB there and resume it, or resume it on another GPU"
    )
    assert engine.state == EngineState.PAUSED and fake.state() == ProcessState.CHECKPOINTED
    assert _C.host_staged_segments() == 3 and fake.vmm_bytes_on(1) == 0
    assert engine.placement()[1].device == "cuda:1"
    fake.clear_failures()
    resumed = engine.resume()
    assert resumed.ok and resumed.path == "fast"
    job.assert_home(physical=1)


def test_a_pause_that_ends_on_the_driver_path_gives_the_staging_back_first(job: Job) -> None:
    fake = job.fake
    job.segments([2 * MiB, 4 * MiB])
    engine = job.engine()
    paused = engine.pause()  # staging pinned, then no optimizer step comes: the driver path
    assert paused.ok and paused.path == "driver", paused.notes
    assert fake.pinned_at_last_checkpoint() == 0 and _C.host_staging_pool_bytes() == 0
    # The copier pinned the staging and let it go before the checkpoint; it waits, asleep.
    assert len(copier_processes()) == 1 and fake.call_count("cuMemHostRegister") == 0
    assert engine.resume().ok
    job.assert_home(physical=0)


PAUSE_FAILURES = {
    # stage_to_host unmaps nothing: the release's 2nd unmap fails, after the 1st segment went.
    "release": (("cuMemUnmap", 2), [("release", False, False)]),
    "checkpoint": (
        ("cuCheckpointProcessCheckpoint", 1),
        [("release", True, False), ("lock", True, False), ("checkpoint", False, False), ("unlock", True, True)],
    ),
}


@pytest.mark.parametrize("step", PAUSE_FAILURES)
def test_a_failed_fast_pause_is_rolled_back(job: Job, step: str) -> None:
    (call, nth), summary = PAUSE_FAILURES[step]
    job.segments([2 * MiB, 4 * MiB, 2 * MiB])
    engine = job.engine()
    trainer = job.train()
    fds = open_fds()
    job.fake.fail(call, "CUDA_ERROR_UNKNOWN", nth=nth)
    error = failure(engine.pause)
    result = rolled_back(job, engine, error, step, fds)
    assert step_summary(result) == [
        ("prepare", True, False),
        ("copy", True, False),
        *summary,
        ("rollback_copy", True, True),
    ]
    assert f"{call}" in result.error
    assert _C.host_staged_segments() == 0
    steps = trainer.steps
    wait_until(lambda: trainer.steps > steps, what="training to go on")  # not parked
    assert engine.pause().ok and engine.resume().ok  # the next pause goes through
    job.assert_home(physical=0)


def test_a_failed_restore_keeps_a_fast_pause_and_a_failed_copy_back_fails_the_job(
    job: Job, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("FLEXIUM_HOST_COPIER", "0")  # the copies run here, where the fake fails them
    fake = job.fake
    engine = job.training([2 * MiB, 4 * MiB])
    assert engine.pause().ok

    # The restore fails: still paused, the segments still wait in host memory.
    fake.fail("cuCheckpointProcessRestore", "CUDA_ERROR_UNKNOWN")
    error = failure(engine.resume)
    assert error.step == "restore" and error.result.path == "fast" and "still paused" in str(error)
    assert engine.state == EngineState.PAUSED and _C.host_staged_segments() == 2

    # The restore works, the copy back fails twice: the job cannot run.
    fake.fail("cuMemcpyHtoDAsync", "CUDA_ERROR_UNKNOWN", nth=0)
    error = failure(engine.resume, RollbackFailedError)
    assert error.step == "copy_back"
    assert names(error.result) == ["restore", "unlock", "copy_back", "copy_back"]
    assert error.result.error.endswith(
        "ROLLBACK FAILED: the job runs on cuda:0 but part of its memory is still in host memory; restart the job"
    )
    assert engine.state == EngineState.FAILED and fake.state() == ProcessState.RUNNING
    assert _C.host_staged_segments() == 2 and fake.vmm_bytes_on(0) == 0  # nothing half made stays
    # Nothing is lost: the host copies come back once the driver lets them.
    fake.clear_failures()
    assert _C.restore_segments_from_host(0) == job.total
    job.assert_home(physical=0)


# ----------------------------------------------------------------------------- the copier process

CUDA_ERROR_UNKNOWN = 999
# Where the copier fails (its own fake driver, armed through the environment it starts with) ->
# the operation whose copies then run in this process instead.
COPIER_FAILURES = {
    "pin": ("cuMemHostRegister", "pause"),
    "copy_to_host": ("cuMemcpyDtoHAsync", "pause"),
    "copy_back": ("cuMemcpyHtoDAsync", "resume"),
}


@pytest.mark.parametrize("where", COPIER_FAILURES)
def test_a_failing_copier_is_replaced_by_copies_in_this_process(
    job: Job, monkeypatch: pytest.MonkeyPatch, where: str
) -> None:
    call, op = COPIER_FAILURES[where]
    monkeypatch.setenv("FAKE_CUDA_FAIL", f"{call}:{CUDA_ERROR_UNKNOWN}")  # read by the copier's fake at its start
    engine = job.training([2 * MiB, 4 * MiB, 6 * MiB])
    fds = open_fds()

    paused = engine.pause()
    assert paused.ok and paused.path == "fast" and names(paused) == FAST_PAUSE
    if where == "pin":
        assert paused.notes[0].startswith("pinned 0.01 GiB of host staging in this process (the copier failed: ")
        assert call in paused.notes[0]
    if where == "copy_to_host":
        assert paused.notes[0].startswith("pinned 0.01 GiB of host staging by the copier process")
        assert paused.notes[-1].startswith("the copies to and from host memory ran in this process: ")
        assert call in paused.notes[-1]
    assert fake_state_paused(job)
    assert len(copier_processes()) == (0 if op == "pause" else 1)  # a failed copier is killed at once
    assert job.fake.pinned_at_last_checkpoint() == 0  # pinned here, but unpinned before the checkpoint

    resumed = engine.resume(target=engine.gpus[1])
    assert resumed.ok and resumed.path == "fast" and names(resumed) == ["restore", "unlock", "copy_back"]
    fell_back = [n for n in resumed.notes if n.startswith("the copies to and from host memory ran in this process")]
    assert len(fell_back) == (1 if op == "resume" else 0) and (op != "resume" or call in fell_back[0])
    job.assert_home(physical=1)
    # The failed copier was killed (its socket closed); a later pause starts another.
    wait_until(lambda: open_fds() == fds - 1 and copier_processes() == [], what="the copier and the staging to go")


def fake_state_paused(job: Job) -> bool:
    return job.fake.state() == ProcessState.CHECKPOINTED and _C.host_staged_segments() > 0


def test_a_copier_killed_while_the_job_is_paused_loses_nothing(job: Job) -> None:
    engine = job.training([2 * MiB, 4 * MiB, 6 * MiB])
    paused = engine.pause()
    assert paused.ok and paused.path == "fast"
    (copier,) = copier_processes()
    os.kill(copier, signal.SIGKILL)  # the staged bytes are this process's memfds: nothing goes with it
    wait_until(lambda: copier_processes() == [] or zombie(copier), what="the copier to die")

    resumed = engine.resume()
    assert resumed.ok and resumed.path == "fast"
    assert any(n.startswith("the copies to and from host memory ran in this process: ") for n in resumed.notes)
    job.assert_home(physical=0)
    again = engine.pause()  # a new copier serves the next pause
    assert again.ok and again.notes[0].startswith("pinned 0.01 GiB of host staging by the copier process")
    assert engine.resume().ok
    job.assert_home(physical=0)


def zombie(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as stat:
            return stat.read().rsplit(")", 1)[1].split()[0] == "Z"
    except OSError:
        return True


def test_after_a_driver_restore_the_pool_is_made_exportable_again_for_the_copier(job: Job) -> None:
    engine = job.training([2 * MiB, 4 * MiB, 6 * MiB])
    assert engine.pause(path="driver").ok
    resumed = engine.resume()
    assert resumed.ok and resumed.path == "driver"
    # The driver's restore gives the segments memory it will not export; they get fresh memory of
    # the job's own at the next optimizer steps, and then the copier can import them again.
    wait_until(lambda: _C.vmm_segments_to_own() == 0, what="the restored memory to become exportable again")
    job.assert_home(physical=0)
    paused = engine.pause()
    assert paused.ok and paused.path == "fast"
    assert not any("ran in this process" in n for n in paused.notes), paused.notes
    assert engine.resume().ok
    job.assert_home(physical=0)


def test_a_pause_before_the_pool_is_exportable_again_copies_in_this_process(job: Job) -> None:
    job.segments([2 * MiB, 4 * MiB])
    engine = job.engine()  # no training thread: no optimizer step makes the memory exportable
    assert engine.pause(path="driver").ok and engine.resume().ok
    assert _C.vmm_segments_to_own() == 2
    engine._safe_points.between_operations(None)  # the slices wait, as if the pause came first
    trainer = job.train()
    paused = engine.pause()
    assert paused.ok and paused.path == "fast"
    assert any("came back from a driver checkpoint" in n for n in paused.notes), paused.notes
    assert engine.resume().ok and trainer.error is None
    job.assert_home(physical=0)


def test_copier_off_pins_and_copies_in_this_process(job: Job, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("FLEXIUM_HOST_COPIER", "0")
    engine = job.training([2 * MiB, 4 * MiB])
    paused = engine.pause()
    assert paused.ok and paused.path == "fast" and copier_processes() == []
    assert paused.notes[0].startswith("pinned 0.01 GiB of host staging in this process (the copier process is off")
    # Pinned here ahead of the safe point, unpinned chunk by chunk as the copies finished.
    assert job.fake.call_count("cuMemHostRegister") > 0
    assert job.fake.pinned_at_last_checkpoint() == 0 and job.fake.pinned_bytes() == 0
    assert engine.resume().ok
    job.assert_home(physical=0)


# ----------------------------------------------------------------------------- host memory


def test_a_pause_that_ends_on_the_driver_path_is_checked_for_its_host_memory(job: Job, host_memory: HostMemory) -> None:
    job.segments([2 * MiB])
    job.fake.set_process_memory(0, 8 * GiB)  # outside the pool: only the checkpoint can carry it
    host_memory.available = 3 * GiB
    engine = job.engine()
    with pytest.raises(TargetRefusedError, match="pausing needs 9.00 GiB of host memory"):
        engine.pause(path="driver")
    # No optimizer step comes: "auto" ends on the driver path too, whose checkpoint needs the
    # same 8 GiB of host memory, and is refused as well.
    with pytest.raises((TargetRefusedError, OperationFailedError)):
        engine.pause()
    assert engine.state == EngineState.RUNNING
