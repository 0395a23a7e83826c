"""The VMM allocator (csrc/vmm_allocator.cpp) against the fake driver: what flexium_vmm_alloc/free
give and take, called as PyTorch calls them; each failing step returning NULL with the reason and
leaking nothing; allocations and frees from several threads; a driver without the VMM API, and
PyTorch resolving the allocator's functions."""

from __future__ import annotations

import ctypes
import json
import subprocess
import sys
import textwrap
import threading
from typing import Any

import pytest

from flexium import _C
from support.fake_driver import CUDA_ERRORS, FakeDriver
from support.vmm import (  # noqa: F401  (fixtures)
    H200_BYTES,
    NO_LEAKS,
    Allocator,
    MiB,
    allocator,
    driver,
    fake,
    fill,
    read,
    segments,
)

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
