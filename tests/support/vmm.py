"""What the tests of the VMM allocator and the fast path's primitives (test_vmm_*.py) share: the
fake driver, which backs device memory with host memory (the bytes behind a returned address are
read and written with ctypes), flexium_vmm_alloc/free called through ctypes on the _C module file
as PyTorch's CUDAPluggableAllocator calls them, and a `fake` that leaves an empty registry and pool
after every test. Configurations that need a fresh driver load run in a subprocess; the rest
shares this process's instance of the fake (and of _C's registry).

Test modules import what they use: ``from support.vmm import Allocator, allocator, driver, fake``."""

from __future__ import annotations

import ctypes
import os
import random
from collections.abc import Iterator
from typing import Any

import pytest

from flexium import _C
from support import fake_driver
from support.fake_driver import FakeDriver

PID = os.getpid()
MiB = 1 << 20
H200_BYTES = 143771 * MiB
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

    def alloc(self, size: int, device: int = 0) -> int | None:
        return self.alloc_fn(size, device, None)

    def must_alloc(self, size: int, device: int = 0) -> int:
        address = self.alloc(size, device)
        assert address is not None, self.last_error()
        return address

    def free(self, address: int | None, size: int = 0, device: int = 0) -> None:
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
