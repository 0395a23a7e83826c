"""The simulated driver's NVML agrees with the real one where the engine could be fooled by it
(csrc/simulated/driver.c): a frozen process's own NVML calls do not return until it runs again
(facts `locked-process-blocks-cuda`, `nvml-reader-process`), and NVML leaves out of the process's
count the memory it holds only through an import of its own export (fact
`nvml-skips-imported-memory`) while the GPU's memory used still shows it. The UUID a device names
after a remap is tested with the restore (test_native_layer.py)."""

from __future__ import annotations

import ctypes
import os
import threading
from collections.abc import Iterator
from typing import Any

import pytest

from flexium import _C
from flexium.engine import nvml
from support.engine import PID, MiB, driver, fake  # noqa: F401  (fixtures)
from support.fake_driver import FakeDriver, _AllocationProp, _Location

POSIX_FD = 1  # CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR
ON_DEVICE = 1  # CU_MEM_LOCATION_TYPE_DEVICE


@pytest.fixture
def pynvml(fake: FakeDriver) -> Any:
    """pynvml on the fake, as flexium's NVML reads it (engine/nvml.py)."""
    assert nvml.available(), nvml.unavailable_reason()
    return nvml._pynvml()


@pytest.fixture
def frozen(fake: FakeDriver) -> Iterator[None]:
    """The process checkpointed by this thread (which holds the lock), running again afterwards."""
    _C.lock(PID, 0)
    _C.checkpoint(PID)
    try:
        yield
    finally:
        _C.restore(PID)
        _C.unlock(PID)


@pytest.mark.usefixtures("frozen")
def test_nvml_of_a_frozen_process_never_answers_the_thread_that_froze_it(fake: FakeDriver, pynvml: Any) -> None:
    with pytest.raises(pynvml.NVMLError_Timeout):  # the real driver hangs here for good
        pynvml.nvmlDeviceGetCount()
    assert fake.blocked_calls() == 1 and fake.deadlocks() == 1
    with fake.nvml_of_another_process():  # the engine's reader process sees the machine meanwhile
        assert pynvml.nvmlDeviceGetCount() == 2
    assert fake.blocked_calls() == 1 and fake.deadlocks() == 1


def test_nvml_of_a_frozen_process_answers_another_thread_once_it_runs(fake: FakeDriver, pynvml: Any) -> None:
    fake.set_process_memory(0, 3 * MiB)
    _C.lock(PID, 0)
    _C.checkpoint(PID)
    answered: list[Any] = []
    waiting = threading.Thread(
        target=lambda: answered.append(pynvml.nvmlDeviceGetMemoryInfo(pynvml.nvmlDeviceGetHandleByIndex(0)).used)
    )
    try:
        waiting.start()
        waiting.join(0.3)
        assert waiting.is_alive() and answered == []  # blocked while the process is checkpointed
    finally:
        _C.restore(PID)
        _C.unlock(PID)
    waiting.join(10)
    assert answered == [3 * MiB] and fake.blocked_calls() >= 1 and fake.deadlocks() == 0


def test_nvml_leaves_out_memory_the_process_holds_only_through_an_import_of_its_own_export(
    fake: FakeDriver, pynvml: Any
) -> None:
    """What a fast move leaves on its target until the job owns it (the copies made there, their
    handles dropped before the checkpoint, imported back from their fds): on the GPU, but not the
    job's by NVML. Memory the process made and holds is its own."""
    lib, size = fake.library, 4 * MiB
    context, previous = ctypes.c_void_p(), ctypes.c_void_p()
    assert lib.cuDevicePrimaryCtxRetain(ctypes.byref(context), 0) == 0
    lib.cuCtxGetCurrent(ctypes.byref(previous))
    lib.cuCtxSetCurrent(context)
    prop = _AllocationProp(type=1, requestedHandleTypes=POSIX_FD, location=_Location(type=ON_DEVICE, id=0))
    made, moved, imported, fd = ctypes.c_ulonglong(), ctypes.c_ulonglong(), ctypes.c_ulonglong(), ctypes.c_int()
    try:
        assert lib.cuMemCreate(ctypes.byref(made), ctypes.c_size_t(size), ctypes.byref(prop), ctypes.c_uint64(0)) == 0
        assert lib.cuMemCreate(ctypes.byref(moved), ctypes.c_size_t(size), ctypes.byref(prop), ctypes.c_uint64(0)) == 0
        assert lib.cuMemExportToShareableHandle(ctypes.byref(fd), moved, POSIX_FD, ctypes.c_uint64(0)) == 0
        assert lib.cuMemRelease(moved) == 0  # held by its fd alone
        assert lib.cuMemImportFromShareableHandle(ctypes.byref(imported), ctypes.c_void_p(fd.value), POSIX_FD) == 0
        gpu = pynvml.nvmlDeviceGetHandleByIndex(0)
        ours = {p.pid: p.usedGpuMemory for p in pynvml.nvmlDeviceGetComputeRunningProcesses(gpu)}
        assert ours == {PID: size}  # what it made, not what it imported
        assert pynvml.nvmlDeviceGetMemoryInfo(gpu).used == 2 * size == fake.used_bytes(0)
        assert fake.process_bytes_on(0) == 2 * size  # where its memory is
    finally:
        for handle in (imported, made):
            if handle.value:
                lib.cuMemRelease(handle)
        if fd.value:
            os.close(fd.value)
        lib.cuCtxSetCurrent(previous)
        lib.cuDevicePrimaryCtxRelease(0)
    assert fake.vmm_allocations() == 0


def test_the_drivers_own_reserve_is_left_out_of_what_flexium_reads(
    fake: FakeDriver, pynvml: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    """NVML's v1 memory info counts what the driver keeps for itself as used (615 MiB of an idle
    H200); flexium reads it apart (v2), so an idle GPU shows 0 used, as nvidia-smi shows it, while
    what is free stays what the driver can give."""
    monkeypatch.setenv("FAKE_NVML_RESERVED_MIB", "615")
    fake.reset()
    handle = pynvml.nvmlDeviceGetHandleByIndex(0)
    raw = pynvml.nvmlDeviceGetMemoryInfo(handle)
    assert raw.used == 615 * MiB and raw.free == raw.total - 615 * MiB
    fake.set_process_memory(0, 3 * MiB)
    gpus = {gpu.index: gpu for gpu in nvml.host_gpus()}
    assert gpus[1].memory_used == 0 and gpus[1].memory_total == raw.total - 615 * MiB
    assert gpus[1].memory_free == gpus[1].memory_total
    assert gpus[0].memory_used == 3 * MiB and gpus[0].memory_free == raw.total - 618 * MiB
    monkeypatch.delenv("FAKE_NVML_RESERVED_MIB")
    fake.reset()
