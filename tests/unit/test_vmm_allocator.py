"""The VMM allocator (csrc/vmm_allocator.cpp) and the fast path's relocation primitives
(csrc/vmm_relocate.cpp, csrc/vmm_host_*.cpp) against the fake driver, which backs device
memory with host memory: the bytes behind a returned address are read and written with ctypes.

flexium_vmm_alloc/free are called through ctypes on the _C module file, as PyTorch's
CUDAPluggableAllocator calls them. Configurations that need a fresh driver load run in a
subprocess; the rest shares this process's instance of the fake (and of _C's registry)."""

from __future__ import annotations

import ctypes
import json
import os
import random
import re
import subprocess
import sys
import textwrap
import threading
import time
from typing import Any, Iterator, Optional

import pytest

import fake_driver
from fake_driver import CUDA_ERRORS, FakeDriver, ProcessState
from flexium import _C

PID = os.getpid()
MiB = 1 << 20
H200_BYTES = 143771 * MiB
VMM_SYMBOLS = [
    "cuCtxGetCurrent",
    "cuCtxSetCurrent",
    "cuCtxGetDevice",
    "cuCtxSynchronize",
    "cuDevicePrimaryCtxRetain",
    "cuDevicePrimaryCtxRelease",
    "cuDevicePrimaryCtxGetState",
    "cuDeviceCanAccessPeer",
    "cuMemGetAllocationGranularity",
    "cuMemAddressReserve",
    "cuMemAddressFree",
    "cuMemCreate",
    "cuMemRelease",
    "cuPointerGetAttribute",
    "cuMemRetainAllocationHandle",
    "cuMemGetAllocationPropertiesFromHandle",
    "cuMemMap",
    "cuMemUnmap",
    "cuMemSetAccess",
    "cuMemExportToShareableHandle",
    "cuMemImportFromShareableHandle",
    "cuMemcpyDtoDAsync",
    "cuMemcpyDtoHAsync",
    "cuMemcpyHtoDAsync",
    "cuMemHostRegister",
    "cuMemHostUnregister",
    "cuStreamCreate",
    "cuStreamSynchronize",
    "cuStreamDestroy",
    "cuEventCreate",
    "cuEventRecord",
    "cuEventSynchronize",
    "cuEventDestroy",
]
NO_LEAKS = {
    "allocations": 0,
    "handles": 0,
    "mappings": 0,
    "reservations": 0,
    "pinned_bytes": 0,
    "streams": 0,
    "events": 0,
    "primary_contexts": 0,
}


class Allocator:
    """flexium_vmm_alloc/free with PyTorch's signatures, called the way PyTorch calls them."""

    def __init__(self, path: str) -> None:
        lib = ctypes.CDLL(path)
        self.alloc_fn = lib.flexium_vmm_alloc
        self.alloc_fn.restype = ctypes.c_void_p
        self.alloc_fn.argtypes = [ctypes.c_size_t, ctypes.c_int, ctypes.c_void_p]
        self.free_fn = lib.flexium_vmm_free
        self.free_fn.restype = None
        self.free_fn.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int, ctypes.c_void_p]
        self.last_error_fn = lib.flexium_vmm_last_error
        self.last_error_fn.restype = ctypes.c_char_p
        self.last_error_fn.argtypes = []

    def alloc(self, size: int, device: int = 0) -> Optional[int]:
        return self.alloc_fn(size, device, None)

    def must_alloc(self, size: int, device: int = 0) -> int:
        address = self.alloc(size, device)
        assert address is not None, self.last_error()
        return address

    def free(self, address: Optional[int], size: int = 0, device: int = 0) -> None:
        self.free_fn(address, size, device, None)

    def last_error(self) -> str:
        return (self.last_error_fn() or b"").decode()


# ----------------------------------------------------------------------------- fixtures, helpers


@pytest.fixture(scope="module")
def driver() -> Iterator[FakeDriver]:
    with fake_driver.activated() as fake:
        yield fake


@pytest.fixture(scope="module")
def allocator(driver: FakeDriver) -> Allocator:
    return Allocator(_C.__file__)


@pytest.fixture
def fake(driver: FakeDriver, allocator: Allocator, monkeypatch: pytest.MonkeyPatch) -> Iterator[FakeDriver]:
    for name in fake_driver.FAKE_ENV_VARS:
        monkeypatch.delenv(name, raising=False)
    driver.reset()
    yield driver
    # Whatever a failed test left: the next one starts from an empty registry and pool.
    driver.reset()
    if _C.host_staged_segments():
        _C.restore_segments_from_host()
    _C.release_host_staging()
    for segment in _C.vmm_segments():
        allocator.free(segment.address)
    assert _C.vmm_segment_count() == 0


def segments() -> list[tuple[int, int, int, bool]]:
    """(address, size, device, mapped) of every segment, to compare with a whole list at once."""
    return [(s.address, s.size, s.device, s.mapped) for s in _C.vmm_segments()]


def fill(address: int, size: int, seed: int) -> bytes:
    data = random.Random(seed).randbytes(size)
    ctypes.memmove(address, data, size)
    return data


def read(address: int, size: int) -> bytes:
    return ctypes.string_at(address, size)


def open_fds() -> set[int]:
    return {int(name) for name in os.listdir("/proc/self/fd")}


def is_open(fd: int) -> bool:
    try:
        os.fstat(fd)
    except OSError:
        return False
    return True


def driver_error(fn: Any, *args: Any, **kwargs: Any) -> Any:
    with pytest.raises(_C.DriverError) as caught:
        fn(*args, **kwargs)
    return caught.value


def make_segments(allocator: Allocator, sizes: list[int], device: int = 0) -> dict[int, bytes]:
    """Allocates and fills one segment per size; returns address -> contents."""
    contents = {}
    for i, size in enumerate(sizes):
        address = allocator.must_alloc(size, device)
        contents[address] = fill(address, size, seed=size + i)
    return contents


def assert_contents(contents: dict[int, bytes]) -> None:
    for address, data in contents.items():
        assert read(address, len(data)) == data, f"segment {address:#x} changed"


def swap_plan(fake: FakeDriver) -> tuple[list[Any], list[list[Any]]]:
    u = fake.uuids()
    pairs = [_C.GpuPair(u[0], u[1]), _C.GpuPair(u[1], u[0])]
    kinds = _C.StepKind
    steps = [
        _C.Step(kinds.LOCK, 5000),
        _C.Step(kinds.CHECKPOINT),
        _C.Step(kinds.RESTORE, pairs=pairs),
        _C.Step(kinds.UNLOCK),
    ]
    return steps, [[_C.Step(kinds.RECOVER)] for _ in steps]


# ----------------------------------------------------------------------------- the allocator


def test_driver_status_reports_the_vmm_api(fake: FakeDriver) -> None:
    status = _C.driver_status()
    assert status.vmm_api is True
    assert status.missing_optional == []
    assert _C.vmm_granularity(0) == _C.vmm_granularity(1) == fake.granularity == 2 * MiB


def test_alloc_rounds_up_registers_and_gives_read_write_memory(fake: FakeDriver, allocator: Allocator) -> None:
    small = allocator.alloc(1, 0)
    big = allocator.alloc(3 * MiB, 1)
    assert small is not None and big is not None, allocator.last_error()
    assert small % (2 * MiB) == 0 and big % (2 * MiB) == 0
    assert segments() == sorted([(small, 2 * MiB, 0, True), (big, 4 * MiB, 1, True)])
    assert _C.vmm_segment_count() == 2
    assert _C.vmm_bytes_on(0) == 2 * MiB and _C.vmm_bytes_on(1) == 4 * MiB
    # The fake's accounting and NVML see the same bytes.
    assert fake.vmm_bytes_on(0) == 2 * MiB and fake.vmm_bytes_on(1) == 4 * MiB
    assert fake.used_bytes(0) == 2 * MiB and fake.process_bytes_on(1) == 4 * MiB
    # Every byte of the rounded size is there, readable and writable.
    data = fill(big, 4 * MiB, seed=7)
    assert read(big, 4 * MiB) == data
    ctypes.memmove(small + 2 * MiB - 4, b"tail", 4)
    assert read(small + 2 * MiB - 4, 4) == b"tail"
    # Nothing of ours stays current or retained on the calling thread.
    assert fake.current_context() == -1 and fake.primary_ctx_refcount(0) == 0
    allocator.free(small, 1, 0)  # PyTorch passes the size it asked for
    allocator.free(big, 3 * MiB, 1)
    assert segments() == [] and _C.vmm_bytes_on(0) == 0
    assert fake.vmm_leaks() == NO_LEAKS and fake.used_bytes(0) == 0


def test_alloc_keeps_the_callers_current_context(fake: FakeDriver, allocator: Allocator) -> None:
    lib = fake.library
    ctx = ctypes.c_void_p()
    assert lib.cuDevicePrimaryCtxRetain(ctypes.byref(ctx), 1) == 0
    assert lib.cuCtxSetCurrent(ctx) == 0
    try:
        address = allocator.alloc(MiB, 0)
        assert address is not None, allocator.last_error()
        assert fake.current_context() == 1 and fake.primary_ctx_refcount(1) == 1
        assert fake.primary_ctx_refcount(0) == 0
        allocator.free(address)
        assert fake.current_context() == 1
    finally:
        lib.cuCtxSetCurrent(None)
        lib.cuDevicePrimaryCtxRelease(1)


# ----------------------------------------------------------------------------- several GPUs in one process

ILLEGAL_ADDRESS = fake_driver.CUDA_ERRORS["CUDA_ERROR_ILLEGAL_ADDRESS"]


def test_the_pool_is_reachable_from_every_gpu_the_process_uses(fake: FakeDriver, allocator: Allocator) -> None:
    """DataParallel's scatter and gather copy between the GPUs' memory; VMM memory is reachable only
    from the devices it was opened to (the HF Trainer failed in its first gather before)."""
    on0 = allocator.must_alloc(2 * MiB, 0)
    assert fake.copy_on(1, on0, on0, MiB) == ILLEGAL_ADDRESS  # one GPU used: GPU 1 has no access
    assert fake.primary_ctx_refcount(1) == 0
    on1 = allocator.must_alloc(2 * MiB, 1)  # the process now uses GPU 1 too
    ctypes.memset(on0, 7, MiB)
    assert fake.copy_on(1, on1, on0, MiB) == 0  # GPU 1 reads GPU 0's memory (a gather)
    assert fake.copy_on(0, on0 + MiB, on1, MiB) == 0  # and GPU 0 reads GPU 1's (a scatter's reverse)
    assert ctypes.string_at(on0 + MiB, MiB) == b"\x07" * MiB
    later = allocator.must_alloc(2 * MiB, 0)  # later segments are opened to both from the start
    assert fake.copy_on(1, on1, later, MiB) == 0

    # After a driver checkpoint the segments get fresh memory of their own: still reachable.
    assert _C.vmm_mark_restored_by_driver() == 3
    assert _C.own_imported(0) == 4 * MiB
    assert fake.copy_on(1, on1, on0, MiB) == 0 and fake.copy_on(1, on1, later, MiB) == 0
    for address in (on0, on1, later):
        allocator.free(address)
    assert fake.vmm_leaks() == NO_LEAKS


def test_the_pool_is_opened_to_a_gpu_used_through_pytorchs_own_allocator(
    fake: FakeDriver, allocator: Allocator
) -> None:
    """In a real job the pool is on the job's own GPU only; a second GPU (DataParallel's replicas,
    the back of a split model) holds PyTorch's own memory, so it has no pool segment but an active
    context, and PyTorch runs a copy between GPUs on the source GPU: GPU 1 writes GPU 0's pool for
    a gather. The pool opens to it at the next segment it makes, the earlier segments too."""
    lib = fake.library
    early = allocator.must_alloc(2 * MiB, 0)
    assert fake.copy_on(1, early + MiB, early, MiB) == ILLEGAL_ADDRESS  # GPU 1 not used yet
    ctx = ctypes.c_void_p()
    assert lib.cuDevicePrimaryCtxRetain(ctypes.byref(ctx), 1) == 0  # the process begins to use GPU 1
    try:
        later = allocator.must_alloc(2 * MiB, 0)
        assert fake.copy_on(1, later, early, MiB) == 0  # both segments reachable from GPU 1
        assert fake.copy_on(1, early + MiB, later + MiB, MiB) == 0
        assert all(s.device == 0 for s in _C.vmm_segments())  # no pool memory on GPU 1 for it
        # After a driver checkpoint the segments get fresh memory of their own: still reachable.
        assert _C.vmm_mark_restored_by_driver() == 2
        assert _C.own_imported(0) == 4 * MiB
        assert fake.copy_on(1, later, early, MiB) == 0
    finally:
        lib.cuDevicePrimaryCtxRelease(1)
    for address in (early, later):
        allocator.free(address)
    assert fake.vmm_leaks() == NO_LEAKS


def test_the_pool_opens_to_a_gpu_in_use_without_making_a_segment(fake: FakeDriver, allocator: Allocator) -> None:
    """What the pool does at each optimizer step and before DataParallel's gather: a GPU whose
    context became active gets the existing segments, each once (the access stays with the memory)."""
    lib = fake.library
    early = allocator.must_alloc(2 * MiB, 0)
    assert _C.open_pool_to_current_users() == 0  # one GPU used
    ctx = ctypes.c_void_p()
    assert lib.cuDevicePrimaryCtxRetain(ctypes.byref(ctx), 1) == 0
    try:
        assert fake.copy_on(1, early + MiB, early, MiB) == ILLEGAL_ADDRESS
        assert _C.open_pool_to_current_users() == 1
        assert fake.copy_on(1, early + MiB, early, MiB) == 0
        assert _C.open_pool_to_current_users() == 0  # already open
    finally:
        lib.cuDevicePrimaryCtxRelease(1)
    allocator.free(early)
    assert fake.vmm_leaks() == NO_LEAKS


@pytest.mark.parametrize("function", ["cuDevicePrimaryCtxGetState", "cuMemSetAccess"])
def test_an_allocation_never_fails_for_another_gpu_in_use(
    fake: FakeDriver, allocator: Allocator, function: str
) -> None:
    """Opening the pool to the other GPUs a job uses is best effort: a driver call failing there
    (GPU 1's state, or GPU 1's access: the allocation's second cuMemSetAccess) never fails the
    job's allocation, and the pool's next look opens it."""
    lib = fake.library
    ctx = ctypes.c_void_p()
    assert lib.cuDevicePrimaryCtxRetain(ctypes.byref(ctx), 1) == 0
    try:
        fake.fail(function, "CUDA_ERROR_UNKNOWN", nth=2 if function == "cuMemSetAccess" else 1)
        address = allocator.must_alloc(2 * MiB, 0)
        assert fake.copy_on(0, address + MiB, address, MiB) == 0
        assert fake.copy_on(1, address + MiB, address, MiB) == ILLEGAL_ADDRESS
        assert _C.open_pool_to_current_users() == 1  # the next look
        assert fake.copy_on(1, address + MiB, address, MiB) == 0
    finally:
        lib.cuDevicePrimaryCtxRelease(1)
    allocator.free(address)
    assert fake.vmm_leaks() == NO_LEAKS


def test_gpus_that_cannot_reach_each_other_are_not_opened(fake: FakeDriver, allocator: Allocator) -> None:
    fake.set_peer_access(False)
    on0, on1 = allocator.must_alloc(2 * MiB, 0), allocator.must_alloc(2 * MiB, 1)
    assert fake.copy_on(1, on1, on0, MiB) == ILLEGAL_ADDRESS
    assert fake.copy_on(0, on0, on1, MiB) == ILLEGAL_ADDRESS
    assert fake.copy_on(0, on0, on0 + MiB, MiB) == 0  # each GPU its own, as before
    allocator.free(on0)
    allocator.free(on1)
    assert fake.vmm_leaks() == NO_LEAKS


def test_out_of_memory_returns_null_and_says_why(fake: FakeDriver, allocator: Allocator) -> None:
    fake.set_other_memory(0, H200_BYTES - 4 * MiB)
    assert allocator.alloc(6 * MiB, 0) is None  # NULL, no exception across the C boundary
    error = allocator.last_error()
    assert error.startswith("flexium_vmm_alloc: cuMemCreate failed: CUDA_ERROR_OUT_OF_MEMORY (out of memory)")
    assert fake.vmm_leaks() == NO_LEAKS
    exact = allocator.alloc(4 * MiB, 0)  # exactly what is left
    assert exact is not None
    assert allocator.alloc(1, 0) is None and "CUDA_ERROR_OUT_OF_MEMORY" in allocator.last_error()
    assert allocator.alloc(1, 1) is not None  # the other GPU has room
    fake.set_process_memory(1, H200_BYTES - 2 * MiB)  # non-VMM memory of the process counts too
    assert allocator.alloc(1, 1) is None
    for segment in _C.vmm_segments():
        allocator.free(segment.address)
    assert fake.vmm_leaks() == NO_LEAKS


ALLOC_STEPS = [
    "cuDeviceGet",
    "cuCtxGetCurrent",
    "cuDevicePrimaryCtxRetain",
    "cuCtxSetCurrent",
    "cuMemAddressReserve",
    "cuMemCreate",
    "cuMemMap",
    "cuMemSetAccess",
]


@pytest.mark.parametrize("function", ALLOC_STEPS)
def test_a_failing_step_returns_null_and_leaks_nothing(fake: FakeDriver, allocator: Allocator, function: str) -> None:
    kept = allocator.must_alloc(MiB, 0)  # a segment already there stays untouched
    fake.fail(function, "CUDA_ERROR_UNKNOWN")
    assert allocator.alloc(5 * MiB, 0) is None
    assert allocator.last_error().startswith(f"flexium_vmm_alloc: {function} failed: CUDA_ERROR_UNKNOWN")
    assert fake.pending_failures() == 0
    assert segments() == [(kept, 2 * MiB, 0, True)]
    allocator.free(kept)
    assert fake.vmm_leaks() == NO_LEAKS
    assert fake.current_context() == -1
    assert allocator.alloc(MiB, 0) is not None  # a one-off failure


def test_zero_size_and_bad_device_return_null(fake: FakeDriver, allocator: Allocator) -> None:
    assert allocator.alloc(0, 0) is None and "size 0" in allocator.last_error()
    assert allocator.alloc(MiB, 7) is None
    assert "cuDeviceGet failed: CUDA_ERROR_INVALID_DEVICE" in allocator.last_error()
    assert fake.vmm_leaks() == NO_LEAKS


def test_free_of_an_unknown_pointer_is_ignored_and_counted(fake: FakeDriver, allocator: Allocator) -> None:
    kept = allocator.must_alloc(MiB, 0)
    before = _C.vmm_unknown_frees()
    allocator.free(0xDEAD00000)
    allocator.free(None)
    allocator.free(kept + 4096)  # inside a segment is not a segment
    assert _C.vmm_unknown_frees() == before + 3
    assert "is not a segment of this allocator" in allocator.last_error()
    assert segments() == [(kept, 2 * MiB, 0, True)]
    allocator.free(kept)
    allocator.free(kept)  # twice: the second is unknown
    assert _C.vmm_unknown_frees() == before + 4
    assert fake.vmm_leaks() == NO_LEAKS


def test_a_failing_free_step_is_reported_and_the_rest_still_runs(fake: FakeDriver, allocator: Allocator) -> None:
    address = allocator.must_alloc(MiB, 0)
    fake.fail("cuCtxSynchronize", "CUDA_ERROR_LAUNCH_FAILED")
    allocator.free(address)
    assert allocator.last_error().startswith("flexium_vmm_free: cuCtxSynchronize failed: CUDA_ERROR_LAUNCH_FAILED")
    assert segments() == []
    assert fake.vmm_leaks() == NO_LEAKS  # unmap, release and address free ran anyway


def test_last_error_is_per_thread(fake: FakeDriver, allocator: Allocator) -> None:
    assert allocator.alloc(0, 0) is None
    mine = allocator.last_error()
    seen: list[str] = []

    def other() -> None:
        seen.append(allocator.last_error())
        allocator.alloc(MiB, 9)
        seen.append(allocator.last_error())

    thread = threading.Thread(target=other)
    thread.start()
    thread.join(10)
    assert seen[0] == "" and "CUDA_ERROR_INVALID_DEVICE" in seen[1]
    assert allocator.last_error() == mine
    assert _C.vmm_last_error() == mine  # the binding reads the calling thread's too


def test_concurrent_allocations_and_frees(fake: FakeDriver, allocator: Allocator) -> None:
    failures: list[str] = []

    def worker(device: int) -> None:
        for i in range(25):
            address = allocator.alloc((i % 3 + 1) * MiB, device)
            if address is None:
                failures.append(allocator.last_error())
                return
            ctypes.memset(address, i, MiB)
            if read(address, 1) != bytes([i]):
                failures.append(f"bytes of {address:#x}")
            allocator.free(address)

    threads = [threading.Thread(target=worker, args=(i % 2,)) for i in range(6)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    assert not failures, failures
    assert _C.vmm_segment_count() == 0 and fake.vmm_leaks() == NO_LEAKS


# ----------------------------------------------------------------------------- relocation to another GPU


def test_stage_release_map_imported_across_a_migration(fake: FakeDriver, allocator: Allocator) -> None:
    contents = make_segments(allocator, [2 * MiB, 4 * MiB, 6 * MiB])
    fds_before = open_fds()
    staged = _C.stage_segments_to_device(1)
    assert [(s.address, s.size) for s in staged] == [(a, len(d)) for a, d in sorted(contents.items())]
    fds = {s.fd for s in staged}
    assert len(fds) == 3 and fds <= open_fds() - fds_before
    # The copies live on GPU 1, held only by their fds; the sources are untouched.
    assert fake.vmm_bytes_on(1) == 12 * MiB and fake.vmm_bytes_on(0) == 12 * MiB
    assert fake.vmm_handles() == 3 and fake.vmm_mappings() == 3 and fake.vmm_reservations() == 3
    assert fake.primary_ctx_refcount(1) == 0 and fake.live_streams() == 0  # no temporary context left
    assert_contents(contents)

    assert _C.release_source_backing() == 3
    assert fake.vmm_bytes_on(0) == 0 and fake.vmm_handles() == 0 and fake.vmm_mappings() == 0
    assert fake.vmm_reservations() == 3 and _C.vmm_segment_count() == 3  # the addresses stay ours

    outcomes = _C.run_steps(PID, *swap_plan(fake))
    assert all(o.code == 0 for o in outcomes), [(o.step, o.error_name) for o in outcomes]
    assert fake.placement() == [1, 0]
    assert fake.vmm_bytes_on(1) == 12 * MiB  # skipped by the checkpoint, still on GPU 1 (docs/facts.md fact 9)

    _C.map_imported(staged, 0)  # logical device 0 is on GPU 1 now
    assert_contents(contents)
    assert not any(is_open(s.fd) for s in staged)
    assert segments() == [(a, len(d), 0, True) for a, d in sorted(contents.items())]
    assert fake.vmm_bytes_on(1) == 12 * MiB and fake.vmm_bytes_on(0) == 0
    assert fake.used_bytes(0) == 0 and fake.used_bytes(1) == 12 * MiB
    for address in contents:
        allocator.free(address)
    assert fake.vmm_leaks() == NO_LEAKS


def test_relocation_without_a_checkpoint_and_of_one_device_only(fake: FakeDriver, allocator: Allocator) -> None:
    on_0 = make_segments(allocator, [2 * MiB, 2 * MiB], device=0)
    on_1 = make_segments(allocator, [4 * MiB], device=1)
    staged = _C.stage_segments_to_device(1, source=0)
    assert sorted(s.address for s in staged) == sorted(on_0)
    assert _C.release_source_backing(source=0) == 2
    assert fake.vmm_bytes_on(0) == 0 and fake.vmm_bytes_on(1) == 8 * MiB
    _C.map_imported(staged, 1)
    assert_contents(on_0)
    assert_contents(on_1)
    assert {s.device for s in _C.vmm_segments()} == {1} and _C.vmm_bytes_on(1) == 8 * MiB


def test_closing_the_staged_fds_frees_the_copies(fake: FakeDriver, allocator: Allocator) -> None:
    make_segments(allocator, [2 * MiB, 4 * MiB])
    staged = _C.stage_segments_to_device(1)
    assert fake.vmm_bytes_on(1) == 6 * MiB and fake.vmm_allocations() == 4
    for entry in staged:
        os.close(entry.fd)
    assert fake.vmm_bytes_on(1) == 0 and fake.vmm_allocations() == 2


def test_fd_held_memory_counts_against_the_restore(fake: FakeDriver, allocator: Allocator) -> None:
    contents = make_segments(allocator, [6 * MiB])
    staged = _C.stage_segments_to_device(1)
    _C.release_source_backing()
    fake.set_process_memory(0, 8 * MiB)  # the rest of the process, carried by the checkpoint
    fake.set_other_memory(1, H200_BYTES - 10 * MiB)  # 10 MiB free on GPU 1, 6 held by our fd
    # What is checked is where the memory counts. The real driver would then refuse the rollback's
    # restore too (docs/facts.md fact 28), which the fake models unless told not to.
    fake.set_oom_poisons_restore(False)
    outcomes = _C.run_steps(PID, *swap_plan(fake))
    assert [(o.step, o.rollback, o.error_name or "ok") for o in outcomes][2:] == [
        ("restore", False, "CUDA_ERROR_OUT_OF_MEMORY"),
        ("restore", True, "ok"),
        ("unlock", True, "ok"),
    ]
    assert fake.placement() == [0, 1] and fake.state() == ProcessState.RUNNING
    # Rolled back on the source: the copy on GPU 1 maps back from there over the peer mapping.
    _C.map_imported(staged, 0)
    assert_contents(contents)


def test_primitives_refuse_to_run_while_the_process_is_locked(fake: FakeDriver, allocator: Allocator) -> None:
    make_segments(allocator, [2 * MiB])
    _C.lock(PID, 0)
    try:
        err = driver_error(_C.stage_segments_to_device, 1)
        assert err.error_name == "CUDA_ERROR_ILLEGAL_STATE"  # the real driver hangs here (docs/facts.md fact 4)
        assert fake.deadlocks() >= 1
    finally:
        _C.unlock(PID)


STAGE_FAILURES = [
    # (function, nth call that fails) with two segments on device 0
    ("cuDevicePrimaryCtxRetain", 1),
    ("cuCtxSynchronize", 1),
    ("cuStreamCreate", 1),
    ("cuMemCreate", 2),
    ("cuMemExportToShareableHandle", 2),
    ("cuMemAddressReserve", 2),
    ("cuMemMap", 2),
    ("cuMemSetAccess", 2),
    ("cuMemcpyDtoDAsync", 2),
    ("cuStreamSynchronize", 1),
    ("cuMemUnmap", 2),
    ("cuMemAddressFree", 1),
    ("cuMemRelease", 2),
]


@pytest.mark.parametrize("function,nth", STAGE_FAILURES, ids=[f for f, _ in STAGE_FAILURES])
def test_a_failed_stage_raises_and_undoes_every_copy(
    fake: FakeDriver, allocator: Allocator, function: str, nth: int
) -> None:
    contents = make_segments(allocator, [2 * MiB, 4 * MiB])
    fds_before = open_fds()
    fake.fail(function, "CUDA_ERROR_UNKNOWN", nth=nth)
    err = driver_error(_C.stage_segments_to_device, 1)
    assert err.call == function and err.error_name == "CUDA_ERROR_UNKNOWN"
    assert f"{function} failed: CUDA_ERROR_UNKNOWN" in str(err)
    assert fake.pending_failures() == 0
    assert open_fds() == fds_before
    assert fake.vmm_bytes_on(1) == 0 and fake.vmm_allocations() == 2
    assert fake.vmm_handles() == 2 and fake.vmm_mappings() == 2 and fake.vmm_reservations() == 2
    assert fake.live_streams() == 0 and fake.primary_ctx_refcount(0) == fake.primary_ctx_refcount(1) == 0
    assert_contents(contents)
    staged = _C.stage_segments_to_device(1)  # nothing left behind blocks a retry
    assert len(staged) == 2
    for entry in staged:
        os.close(entry.fd)


def test_release_stops_at_a_failure_and_the_registry_stays_truthful(fake: FakeDriver, allocator: Allocator) -> None:
    make_segments(allocator, [2 * MiB, 2 * MiB, 2 * MiB])
    fake.fail("cuMemUnmap", "CUDA_ERROR_UNKNOWN", nth=2)
    err = driver_error(_C.release_source_backing)
    assert err.call == "cuMemUnmap"
    assert fake.vmm_mappings() == 2 and fake.vmm_handles() == 2  # the first one went
    assert _C.release_source_backing() == 2  # the retry does the two still backed
    assert fake.vmm_mappings() == 0 and fake.vmm_handles() == 0 and fake.vmm_bytes_on(0) == 0
    fake.fail("cuCtxSynchronize", "CUDA_ERROR_UNKNOWN")
    assert driver_error(_C.release_source_backing).call == "cuCtxSynchronize"
    assert _C.release_source_backing() == 0


@pytest.mark.parametrize("function", ["cuMemImportFromShareableHandle", "cuMemMap", "cuMemSetAccess"])
def test_a_failed_import_keeps_the_fds_not_mapped(fake: FakeDriver, allocator: Allocator, function: str) -> None:
    contents = make_segments(allocator, [2 * MiB, 4 * MiB, 2 * MiB])
    staged = _C.stage_segments_to_device(1)
    _C.release_source_backing()
    fake.fail(function, "CUDA_ERROR_UNKNOWN", nth=2)
    err = driver_error(_C.map_imported, staged, 1)
    assert err.call == function
    assert not is_open(staged[0].fd) and is_open(staged[1].fd) and is_open(staged[2].fd)
    assert fake.vmm_mappings() == 1 and fake.vmm_handles() == 1
    assert fake.vmm_bytes_on(1) == 8 * MiB  # nothing lost: the fds still hold the rest
    _C.map_imported(staged[1:], 1)
    assert_contents(contents)
    assert not any(is_open(s.fd) for s in staged)


def test_map_imported_checks_the_whole_list_first(fake: FakeDriver, allocator: Allocator) -> None:
    contents = make_segments(allocator, [2 * MiB, 4 * MiB])
    staged = _C.stage_segments_to_device(1)
    first, second = staged
    a0, s0, f0 = first.address, first.size, first.fd
    a1, s1, f1 = second.address, second.size, second.fd
    with pytest.raises(ValueError, match="is still mapped"):
        _C.map_imported(staged, 1)
    _C.release_source_backing()
    bad_lists = {
        "is not a segment": [first, _C.StagedSegment(a1 + 2 * MiB, s1, f1)],
        "does not have the staged size": [first, _C.StagedSegment(address=a1, size=s0, fd=f1)],
        "is listed twice": [first, _C.StagedSegment(a0, s0, f1)],
        "comes with no fd": [first, _C.StagedSegment(a1, s1, -1)],
    }
    for message, entries in bad_lists.items():
        with pytest.raises(ValueError, match=message):
            _C.map_imported(entries, 1)
    assert is_open(f0) and is_open(f1) and fake.vmm_mappings() == 0
    _C.map_imported(staged, 1)
    assert_contents(contents)


def test_stage_without_backing_is_refused(fake: FakeDriver, allocator: Allocator) -> None:
    make_segments(allocator, [2 * MiB])
    _C.release_source_backing()
    with pytest.raises(ValueError, match="has no backing to stage"):
        _C.stage_segments_to_device(1)
    with pytest.raises(ValueError, match="has no backing to stage"):
        _C.stage_segments_to_host()


def test_free_during_the_window_frees_only_the_address(fake: FakeDriver, allocator: Allocator) -> None:
    contents = make_segments(allocator, [2 * MiB, 2 * MiB])
    gone, kept = sorted(contents)
    staged = _C.stage_segments_to_device(1)
    _C.release_source_backing()
    error_before = allocator.last_error()
    allocator.free(gone)
    assert allocator.last_error() == error_before  # no step failed: only the address range went
    assert fake.vmm_reservations() == 1
    with pytest.raises(ValueError, match="is not a segment"):
        _C.map_imported(staged, 1)
    _C.map_imported([s for s in staged if s.address == kept], 1)
    os.close([s for s in staged if s.address == gone][0].fd)
    assert_contents({kept: contents[kept]})


# ----------------------------------------------------------------------------- pause through host memory


def test_own_imported_stops_after_max_bytes(fake: FakeDriver, allocator: Allocator) -> None:
    contents = make_segments(allocator, [2 * MiB, 4 * MiB, 6 * MiB])
    staged = _C.stage_segments_to_device(1)
    _C.release_source_backing()
    _C.map_imported(staged, 1)
    assert _C.vmm_imported_count() == 3
    # Whole segments in address order, at least one, until max_bytes are replaced.
    assert _C.own_imported(1, {}, 1) in (2 * MiB, 4 * MiB, 6 * MiB)
    assert _C.vmm_imported_count() == 2
    rest = _C.own_imported(1, {}, 64 * MiB)
    assert _C.vmm_imported_count() == 0 and rest > 0
    assert_contents(contents)


def test_host_staging_round_trip_across_a_pause(fake: FakeDriver, allocator: Allocator) -> None:
    contents = make_segments(allocator, [2 * MiB, 4 * MiB, 6 * MiB])
    # Chunks of 3 MiB: segments straddle chunk boundaries.
    assert _C.stage_segments_to_host(chunk_bytes=3 * MiB) == 12 * MiB
    assert _C.host_staged_segments() == 3
    assert _C.host_staging_pool_bytes() == 12 * MiB
    # Every chunk was unpinned once its copies were done: the checkpoint sees no pinned memory.
    assert fake.pinned_bytes() == 0 and _C.host_staging_pinned_bytes() == 0
    assert fake.call_count("cuMemHostRegister") == fake.call_count("cuMemHostUnregister") == 4
    assert _C.release_source_backing() == 3
    assert fake.vmm_bytes_on(0) == 0
    _C.lock(PID, 0)
    _C.checkpoint(PID)
    assert fake.pinned_at_last_checkpoint() == 0
    assert fake.used_bytes(0) == 0 and fake.used_bytes(1) == 0  # a pause leaves nothing of ours
    _C.restore(PID)
    _C.unlock(PID)
    assert _C.restore_segments_from_host() == 12 * MiB
    assert_contents(contents)
    assert _C.host_staged_segments() == 0 and fake.pinned_bytes() == 0
    assert fake.vmm_bytes_on(0) == 12 * MiB and fake.live_streams() == 0 and fake.live_events() == 0
    assert fake.primary_ctx_refcount(0) == 0

    # A second pause reuses the staging; resuming on another device works too.
    assert _C.stage_segments_to_host(chunk_bytes=3 * MiB) == 12 * MiB
    assert _C.host_staging_pool_bytes() == 12 * MiB
    _C.release_source_backing()
    assert _C.restore_segments_from_host(1) == 12 * MiB
    assert_contents(contents)
    assert _C.vmm_bytes_on(1) == 12 * MiB and fake.vmm_bytes_on(1) == 12 * MiB and fake.vmm_bytes_on(0) == 0
    assert _C.release_host_staging() == 12 * MiB
    assert fake.pinned_bytes() == 0 and _C.host_staging_pool_bytes() == 0
    for address in contents:
        allocator.free(address)
    assert fake.vmm_leaks() == NO_LEAKS


def test_reserve_pins_ahead_and_the_stage_unpins(fake: FakeDriver, allocator: Allocator) -> None:
    contents = make_segments(allocator, [4 * MiB, 8 * MiB])
    assert _C.reserve_host_staging(12 * MiB, 0, chunk_bytes=4 * MiB) == 12 * MiB
    assert fake.pinned_bytes() == _C.host_staging_pinned_bytes() == 12 * MiB
    assert fake.primary_ctx_refcount(0) == 0  # the context was only borrowed
    assert _C.reserve_host_staging(12 * MiB, 0, chunk_bytes=4 * MiB) == 0  # nothing left to do
    assert _C.stage_segments_to_host(chunk_bytes=4 * MiB) == 12 * MiB
    assert fake.pinned_bytes() == 0
    # Pinned ahead, so the stage pinned nothing itself.
    assert fake.call_count("cuMemHostRegister") == 3
    _C.release_source_backing()
    assert _C.restore_segments_from_host() == 12 * MiB
    assert_contents(contents)
    # The next reserve pins the kept staging again without mapping more.
    assert _C.reserve_host_staging(8 * MiB, 0, chunk_bytes=4 * MiB) == 8 * MiB
    assert _C.host_staging_pool_bytes() == 12 * MiB and fake.pinned_bytes() == 8 * MiB
    assert _C.release_host_staging() == 12 * MiB
    assert fake.pinned_bytes() == 0


def test_the_stage_grows_the_staging_when_the_pool_outgrew_the_reserve(fake: FakeDriver, allocator: Allocator) -> None:
    contents = make_segments(allocator, [2 * MiB, 8 * MiB])
    _C.reserve_host_staging(2 * MiB, 0, chunk_bytes=2 * MiB)
    assert _C.stage_segments_to_host(chunk_bytes=2 * MiB) == 10 * MiB
    assert _C.host_staging_pool_bytes() == 10 * MiB and fake.pinned_bytes() == 0
    _C.release_source_backing()
    assert _C.restore_segments_from_host() == 10 * MiB
    assert_contents(contents)


def test_host_staging_copies_only_live_ranges(fake: FakeDriver, allocator: Allocator) -> None:
    contents = make_segments(allocator, [4 * MiB, 2 * MiB])
    partial, whole = sorted(contents, key=lambda address: -len(contents[address]))
    live = {partial: [(0, MiB), (3 * MiB, 512 << 10), (MiB, 0)]}
    assert _C.stage_segments_to_host(live) == MiB + (512 << 10) + 2 * MiB
    assert _C.host_staging_pool_bytes() == 4 * MiB  # what the live bytes need, in whole huge pages
    _C.release_source_backing()
    assert _C.restore_segments_from_host() == MiB + (512 << 10) + 2 * MiB
    data = contents[partial]
    assert read(partial, MiB) == data[:MiB]
    assert read(partial + 3 * MiB, 512 << 10) == data[3 * MiB : 3 * MiB + (512 << 10)]
    assert_contents({whole: contents[whole]})
    with pytest.raises(ValueError, match="lies outside"):
        _C.stage_segments_to_host({whole: [(MiB, 2 * MiB)]})
    assert _C.host_staged_segments() == 0


def test_staging_twice_or_releasing_a_full_pool_is_refused(fake: FakeDriver, allocator: Allocator) -> None:
    contents = make_segments(allocator, [2 * MiB])
    _C.stage_segments_to_host(chunk_bytes=MiB)
    with pytest.raises(RuntimeError, match="still staged on the host"):
        _C.stage_segments_to_host()
    with pytest.raises(RuntimeError, match="still staged on the host"):
        _C.release_host_staging()
    with pytest.raises(RuntimeError, match="still staged on the host"):
        _C.reserve_host_staging(2 * MiB, 0)
    with pytest.raises(ValueError, match="chunk_bytes"):
        _C.stage_segments_to_host(chunk_bytes=0)
    with pytest.raises(ValueError, match="multiple of 4096"):
        _C.reserve_host_staging(2 * MiB, 0, chunk_bytes=1000)
    # Never released (the pause was called off): restoring only drops the stash.
    assert _C.restore_segments_from_host() == 0
    assert _C.host_staged_segments() == 0
    assert_contents(contents)


STAGE_FAILURES = [
    ("cuMemHostRegister", 2),
    ("cuCtxSynchronize", 1),
    ("cuMemcpyDtoHAsync", 3),
    ("cuEventRecord", 2),
    ("cuEventSynchronize", 1),
    ("cuMemHostUnregister", 2),
    ("cuStreamSynchronize", 1),
]


@pytest.mark.parametrize("function,nth", STAGE_FAILURES, ids=[f for f, _ in STAGE_FAILURES])
def test_a_failed_host_stage_stages_nothing_and_leaves_nothing_pinned(
    fake: FakeDriver, allocator: Allocator, function: str, nth: int
) -> None:
    contents = make_segments(allocator, [2 * MiB, 4 * MiB])
    fake.fail(function, "CUDA_ERROR_UNKNOWN", nth=nth)
    err = driver_error(_C.stage_segments_to_host, chunk_bytes=2 * MiB)
    assert err.call == function
    assert _C.host_staged_segments() == 0 and fake.live_streams() == 0 and fake.live_events() == 0
    assert fake.pinned_bytes() == 0, "a failed stage left host memory pinned for the next checkpoint"
    assert fake.vmm_mappings() == 2
    assert_contents(contents)
    assert _C.stage_segments_to_host(chunk_bytes=2 * MiB) == 6 * MiB  # the retry


def test_a_failed_reserve_leaves_nothing_pinned(fake: FakeDriver) -> None:
    fake.fail("cuMemHostRegister", "CUDA_ERROR_OUT_OF_MEMORY", nth=3)
    err = driver_error(_C.reserve_host_staging, 8 * MiB, 0, chunk_bytes=2 * MiB)
    assert err.call == "cuMemHostRegister"
    assert fake.pinned_bytes() == 0 and fake.primary_ctx_refcount(0) == 0
    assert _C.reserve_host_staging(8 * MiB, 0, chunk_bytes=2 * MiB) == 8 * MiB


# Device 0's two segments come back first (one call each, 3 copies of 2 MiB pieces in 2 chunks
# pinned one by one, a synchronize and the stream's own at its end); device 1's group starts on a
# chunk of its own, and the nth call is the first of that group.
RESTORE_FAILURES = [
    ("cuMemCreate", 3),
    ("cuMemMap", 3),
    ("cuMemSetAccess", 3),
    ("cuMemcpyHtoDAsync", 4),
    ("cuMemHostRegister", 3),
    ("cuEventSynchronize", 3),
    ("cuStreamSynchronize", 3),
]


@pytest.mark.parametrize("function,nth", RESTORE_FAILURES, ids=[f for f, _ in RESTORE_FAILURES])
def test_a_failed_restore_from_host_can_be_retried(
    fake: FakeDriver, allocator: Allocator, function: str, nth: int
) -> None:
    contents = make_segments(allocator, [2 * MiB, 4 * MiB], device=0)
    contents.update(make_segments(allocator, [6 * MiB], device=1))
    _C.stage_segments_to_host(chunk_bytes=4 * MiB)
    _C.release_source_backing()
    fake.fail(function, "CUDA_ERROR_OUT_OF_MEMORY", nth=nth)
    err = driver_error(_C.restore_segments_from_host)
    assert err.call == function and err.error_name == "CUDA_ERROR_OUT_OF_MEMORY"
    assert _C.host_staged_segments() == 1
    assert fake.vmm_bytes_on(0) == 6 * MiB and fake.vmm_bytes_on(1) == 0 and fake.vmm_mappings() == 2
    assert fake.live_streams() == 0 and fake.live_events() == 0 and fake.pinned_bytes() == 0
    assert _C.restore_segments_from_host() == 6 * MiB
    assert_contents(contents)
    assert sorted(s.device for s in _C.vmm_segments()) == [0, 0, 1]


def test_host_staging_of_nothing(fake: FakeDriver) -> None:
    assert _C.stage_segments_to_host() == 0
    assert _C.restore_segments_from_host() == 0
    assert _C.stage_segments_to_device(1) == []
    assert _C.release_source_backing() == 0
    _C.map_imported([], 0)
    assert fake.pinned_bytes() == 0


# ----------------------------------------------------------------------------- orders for the copier process
# The copier (csrc/host_copier.cpp) runs in its own process in flexium; here it runs in this one,
# which the fake allows: the orders and the copier meet only through fds and the staging's memfds.


def copier_for_staging() -> Any:
    layout = _C.host_staging_layout()
    return _C.HostCopier(layout.extents, layout.chunks)


def test_copier_orders_round_trip_across_a_pause(fake: FakeDriver, allocator: Allocator) -> None:
    contents = make_segments(allocator, [2 * MiB, 4 * MiB, 6 * MiB])
    assert _C.reserve_host_staging(12 * MiB, 0, chunk_bytes=4 * MiB, pin_here=False) == 0
    assert fake.pinned_bytes() == 0 and _C.host_staging_pool_bytes() == 12 * MiB
    copier = copier_for_staging()
    copier.wake(fake.uuid(0), True, 0)
    assert copier.awake and copier.pinned_bytes == 12 * MiB

    order = _C.begin_stage_order()
    assert order.bytes == 12 * MiB and len(order.segments) == 3 and sum(p.length for p in order.pieces) == order.bytes
    with pytest.raises(RuntimeError, match="already open"):
        _C.begin_stage_order()
    assert copier.copy(True, order.segments, order.pieces) == 12 * MiB
    assert _C.finish_host_order() == 12 * MiB
    assert not any(is_open(fd) for fd, _size in order.segments)  # the order closed its exported fds
    assert _C.host_staged_segments() == 3
    copier.sleep()
    assert not copier.awake and fake.pinned_bytes() == 0 and fake.primary_ctx_refcount(0) == 0

    assert _C.release_source_backing() == 3
    _C.lock(PID, 0)
    _C.checkpoint(PID)
    assert fake.used_bytes(0) == fake.used_bytes(1) == 0
    _C.restore(PID)
    _C.unlock(PID)

    order = _C.begin_restore_order(1)
    assert order.bytes == 12 * MiB
    copier.wake(fake.uuid(1), False, 0)  # pins while this thread goes on; the copy pins the rest
    assert copier.copy(False, order.segments, order.pieces) == 12 * MiB
    assert _C.finish_host_order() == 12 * MiB
    assert_contents(contents)
    assert _C.host_staged_segments() == 0 and fake.vmm_bytes_on(1) == 12 * MiB and fake.vmm_bytes_on(0) == 0
    copier.sleep()
    del copier
    assert _C.release_host_staging() == 12 * MiB
    for address in contents:
        allocator.free(address)
    assert fake.vmm_leaks() == NO_LEAKS


def test_a_grown_staging_extends_the_copier_whose_pins_stay(fake: FakeDriver, allocator: Allocator) -> None:
    make_segments(allocator, [4 * MiB])
    _C.reserve_host_staging(4 * MiB, 0, chunk_bytes=2 * MiB, pin_here=False)
    before = _C.host_staging_layout()
    copier = copier_for_staging()
    copier.wake(fake.uuid(0), True, 0)
    assert copier.pinned_bytes == 4 * MiB and fake.call_count("cuMemHostRegister") == 2

    make_segments(allocator, [2 * MiB])
    _C.reserve_host_staging(6 * MiB, 0, chunk_bytes=2 * MiB, pin_here=False)  # grows: extents and chunks added
    after = _C.host_staging_layout()
    assert len(after.extents) > len(before.extents) and len(after.chunks) == 3
    copier.extend(after.extents[len(before.extents) :], after.chunks[len(before.chunks) :])
    assert copier.awake and copier.pinned_bytes == 4 * MiB  # nothing unpinned
    copier.wake(fake.uuid(0), True, 0)  # awake already: pins only the new chunk
    assert copier.pinned_bytes == 6 * MiB and fake.call_count("cuMemHostRegister") == 3
    assert fake.call_count("cuMemHostUnregister") == 0
    order = _C.begin_stage_order()
    assert copier.copy(True, order.segments, order.pieces) == 6 * MiB
    _C.finish_host_order()
    with pytest.raises(ValueError, match="lies outside the staging's extents"):
        copier.extend([], [_C.CopierChunk(extent=len(after.extents), offset=0, size=2 * MiB)])
    copier.sleep()
    assert fake.pinned_bytes() == 0


def test_after_a_copy_the_copier_pins_the_chunks_it_did_not_use(fake: FakeDriver, allocator: Allocator) -> None:
    """A copy pins only the chunks it uses; a kept staging must be whole for the next pause."""
    contents = make_segments(allocator, [2 * MiB])
    _C.reserve_host_staging(6 * MiB, 0, chunk_bytes=2 * MiB, pin_here=False)  # 3 chunks, 1 used
    copier = copier_for_staging()
    assert copier.last_pinner == ""
    copier.wake(fake.uuid(0), False, 200)  # pins one chunk, then waits: the copy stops it there
    deadline = time.monotonic() + 10
    while copier.pinned_bytes < 2 * MiB and time.monotonic() < deadline:
        time.sleep(0.01)
    order = _C.begin_stage_order()
    assert copier.copy(True, order.segments, order.pieces) == 2 * MiB
    _C.finish_host_order()
    assert copier.pinned_bytes == 2 * MiB
    assert re.fullmatch(
        r"pinned 1 chunks \(0\.00 GiB\) in \d+\.\d\d s \(the slowest \d+ ms\), stopped", copier.last_pinner
    )
    copier.pin_rest(0)
    deadline = time.monotonic() + 10
    while copier.pinned_bytes < 6 * MiB and time.monotonic() < deadline:
        time.sleep(0.01)
    assert copier.pinned_bytes == 6 * MiB
    deadline = time.monotonic() + 10
    while not copier.last_pinner.endswith("all pinned") and time.monotonic() < deadline:
        time.sleep(0.01)
    assert re.fullmatch(
        r"pinned 2 chunks \(0\.00 GiB\) in \d+\.\d\d s \(the slowest \d+ ms\), all pinned", copier.last_pinner
    )
    copier.sleep()
    with pytest.raises(RuntimeError, match="asleep"):
        copier.pin_rest(0)
    assert fake.pinned_bytes() == 0
    assert_contents(contents)


def test_an_aborted_order_leaves_everything_as_it_was(fake: FakeDriver, allocator: Allocator) -> None:
    contents = make_segments(allocator, [2 * MiB, 4 * MiB])
    _C.reserve_host_staging(6 * MiB, 0, pin_here=False)
    order = _C.begin_stage_order()
    _C.abort_host_order()
    assert not any(is_open(fd) for fd, _size in order.segments) and _C.host_staged_segments() == 0
    extra = allocator.must_alloc(2 * MiB)  # the segment lock is free again
    allocator.free(extra)

    assert _C.stage_segments_to_host() == 6 * MiB
    _C.release_source_backing()
    _C.begin_restore_order(0)
    assert fake.vmm_bytes_on(0) == 6 * MiB  # the new memory, not yet the segments'
    _C.abort_host_order()
    assert fake.vmm_bytes_on(0) == 0 and [s.mapped for s in _C.vmm_segments()] == [False, False]
    assert _C.restore_segments_from_host() == 6 * MiB  # in this process instead
    assert_contents(contents)
    _C.abort_host_order()  # none open: nothing to do


def test_a_stage_order_does_not_grow_the_staging(fake: FakeDriver, allocator: Allocator) -> None:
    contents = make_segments(allocator, [2 * MiB, 8 * MiB])
    _C.reserve_host_staging(2 * MiB, 0, chunk_bytes=2 * MiB, pin_here=False)
    with pytest.raises(ValueError, match="outgrew the host staging prepared for them"):
        _C.begin_stage_order()
    assert _C.host_staging_pool_bytes() == 2 * MiB
    assert _C.stage_segments_to_host(chunk_bytes=2 * MiB) == 10 * MiB  # this process's stage grows it
    _C.release_source_backing()
    assert _C.restore_segments_from_host() == 10 * MiB
    assert_contents(contents)


def test_memory_a_driver_restore_left_unexportable_is_owned_again(fake: FakeDriver, allocator: Allocator) -> None:
    contents = make_segments(allocator, [2 * MiB, 4 * MiB])
    _C.reserve_host_staging(6 * MiB, 0, pin_here=False)
    assert _C.vmm_mark_restored_by_driver() == 2 and _C.vmm_segments_to_own() == 2
    with pytest.raises(ValueError, match="came back from a driver checkpoint"):
        _C.begin_stage_order()
    assert _C.own_imported(0) == 6 * MiB and _C.vmm_segments_to_own() == 0
    assert_contents(contents)
    order = _C.begin_stage_order()
    assert order.bytes == 6 * MiB and len(order.segments) == 2
    _C.abort_host_order()
    # Memory a pause gives back is fresh too: nothing is left to own after a round trip in this process.
    _C.vmm_mark_restored_by_driver()
    assert _C.stage_segments_to_host() == 6 * MiB
    _C.release_source_backing()
    assert _C.restore_segments_from_host() == 6 * MiB
    assert _C.vmm_segments_to_own() == 0
    assert_contents(contents)


def test_the_copier_refuses_bad_orders(fake: FakeDriver, allocator: Allocator) -> None:
    make_segments(allocator, [2 * MiB])
    _C.reserve_host_staging(2 * MiB, 0, pin_here=False)
    copier = copier_for_staging()
    with pytest.raises(RuntimeError, match="asleep"):
        copier.copy(True, [], [])
    with pytest.raises(ValueError, match="no GPU with UUID GPU-00000000"):
        copier.wake("GPU-00000000-0000-0000-0000-000000000000", True, 0)
    copier.wake(fake.uuid(0), True, 0)
    order = _C.begin_stage_order()
    try:
        bad = [_C.CopierPiece(segment=0, segment_offset=0, chunk=0, chunk_offset=0, length=4 * MiB)]  # too long
        with pytest.raises(ValueError, match="lies outside its segment or chunk"):
            copier.copy(True, order.segments, bad)
    finally:
        _C.abort_host_order()
    with pytest.raises(ValueError, match="lies outside the staging's extents"):
        _C.HostCopier(_C.host_staging_layout().extents, [_C.CopierChunk(extent=0, offset=0, size=4 * MiB)])
    copier.sleep()
    assert fake.pinned_bytes() == 0


# ----------------------------------------------------------------------------- other drivers, PyTorch

SUBPROCESS = """
import ctypes, json, os
from flexium import _C
lib = ctypes.CDLL(_C.__file__)
lib.flexium_vmm_alloc.restype = ctypes.c_void_p
lib.flexium_vmm_alloc.argtypes = [ctypes.c_size_t, ctypes.c_int, ctypes.c_void_p]
lib.flexium_vmm_last_error.restype = ctypes.c_char_p
def alloc(size):
    address = lib.flexium_vmm_alloc(size, 0, None)
    return address, lib.flexium_vmm_last_error().decode()
def error(fn, *args):
    try:
        fn(*args)
    except _C.DriverError as e:
        return {"call": e.call, "error_name": e.error_name, "message": str(e)}
    return None
"""


def run_python(code: str, env: dict[str, str]) -> dict[str, Any]:
    done = subprocess.run(
        [sys.executable, "-c", SUBPROCESS + textwrap.dedent(code)], env=env, capture_output=True, text=True, timeout=120
    )
    assert done.returncode == 0, done.stderr
    return json.loads(done.stdout.strip().splitlines()[-1])


def test_a_driver_without_the_vmm_api(driver: FakeDriver) -> None:
    out = run_python(
        """
        status = _C.driver_status()
        print(json.dumps({"status": {"vmm_api": status.vmm_api, "checkpoint_api": status.checkpoint_api,
                                     "missing_optional": status.missing_optional}, "alloc": alloc(1 << 20),
                          "stage": error(_C.stage_segments_to_device, 1), "host": error(_C.stage_segments_to_host)}))
        """,
        driver.environment(FAKE_CUDA_NO_VMM=1),
    )
    assert out["status"]["vmm_api"] is False and out["status"]["checkpoint_api"] is True
    assert sorted(out["status"]["missing_optional"]) == sorted(VMM_SYMBOLS)
    address, error = out["alloc"]
    assert address is None
    assert error.startswith("flexium_vmm_alloc: cuCtxGetCurrent failed: CUDA_ERROR_NOT_FOUND")
    assert "needs CUDA 4000+" in error
    for name in ("stage", "host"):
        assert out[name]["call"] == "cuCtxGetCurrent" and out[name]["error_name"] == "CUDA_ERROR_NOT_FOUND"


def test_a_failing_granularity_query_returns_null_once(driver: FakeDriver) -> None:
    # The granularity is cached per device after the first query: a fresh process sees the query.
    code = CUDA_ERRORS["CUDA_ERROR_NOT_SUPPORTED"]
    out = run_python(
        'print(json.dumps({"first": alloc(1), "second": alloc(1)}))',
        driver.environment(FAKE_CUDA_FAIL=f"cuMemGetAllocationGranularity:{code}:1"),
    )
    assert out["first"][0] is None
    assert out["first"][1].startswith(
        "flexium_vmm_alloc: cuMemGetAllocationGranularity failed: CUDA_ERROR_NOT_SUPPORTED"
    )
    assert out["second"][0] is not None


def test_pytorch_can_resolve_the_allocator_functions(driver: FakeDriver) -> None:
    torch = pytest.importorskip("torch")
    from torch.cuda.memory import CUDAPluggableAllocator

    # What CUDAPluggableAllocator.__init__ does before handing the pointers to C++.
    lib = ctypes.CDLL(_C.__file__)
    for name in ("flexium_vmm_alloc", "flexium_vmm_free"):
        assert ctypes.cast(getattr(lib, name), ctypes.c_void_p).value
    if hasattr(torch._C, "_cuda_customAllocator"):  # a CUDA build: the whole constructor runs
        allocator = CUDAPluggableAllocator(_C.__file__, "flexium_vmm_alloc", "flexium_vmm_free")
        assert allocator.allocator() is not None
    else:  # CPU torch: the names resolved; only the C++ half is missing
        with pytest.raises(AttributeError, match="_cuda_customAllocator"):
            CUDAPluggableAllocator(_C.__file__, "flexium_vmm_alloc", "flexium_vmm_free")
    with pytest.raises(AttributeError, match="undefined symbol"):
        CUDAPluggableAllocator(_C.__file__, "flexium_vmm_malloc", "flexium_vmm_free")
