"""The simulated driver's imports of memory another process made (csrc/simulated/driver.c): the
memory stays on the GPU it was made on, whichever GPU the importer's context is on, as
cuMemImportFromShareableHandle names the existing allocation. Tests that check where a copier
process made a job's memory rely on it (test_resume_overlap.py)."""

from __future__ import annotations

import ctypes
import socket
import subprocess
import sys
import textwrap

from support.engine import MiB, driver, fake  # noqa: F401  (fixtures)
from support.fake_driver import FakeDriver, _AllocationProp, subprocess_env

POSIX_FD = 1  # CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR

MAKE_AND_SEND = textwrap.dedent(
    """
    import ctypes, os, socket, sys
    from support.fake_driver import _AllocationProp, _Location
    lib = ctypes.CDLL(os.environ["FLEXIUM_LIBCUDA"])
    device, size, sock = int(sys.argv[1]), int(sys.argv[2]), int(sys.argv[3])
    ctx, handle, fd = ctypes.c_void_p(), ctypes.c_ulonglong(), ctypes.c_int(-1)
    prop = _AllocationProp(type=1, location=_Location(type=1, id=device))
    prop.requestedHandleTypes = 1
    for rc in (
        lib.cuInit(0),
        lib.cuDevicePrimaryCtxRetain(ctypes.byref(ctx), device),
        lib.cuCtxSetCurrent(ctx),
        lib.cuMemCreate(ctypes.byref(handle), ctypes.c_size_t(size), ctypes.byref(prop), ctypes.c_uint64(0)),
        lib.cuMemExportToShareableHandle(ctypes.byref(fd), handle, 1, ctypes.c_uint64(0)),
    ):
        assert rc == 0, rc
    socket.send_fds(socket.socket(fileno=sock), [b"fd"], [fd.value])
    """
)


def _made_by_another_process(fake: FakeDriver, device: int, size: int) -> int:
    ours, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM)
    with ours, theirs:
        subprocess.run(
            [sys.executable, "-c", MAKE_AND_SEND, str(device), str(size), str(theirs.fileno())],
            env=subprocess_env(fake.path),
            pass_fds=(theirs.fileno(),),
            check=True,
            timeout=60,
        )
        _, fds, _, _ = socket.recv_fds(ours, 16, 1)
    return fds[0]


def test_memory_another_process_made_stays_on_its_gpu_when_imported_from_another(fake: FakeDriver) -> None:
    size = 4 * MiB
    fd = _made_by_another_process(fake, 1, size)
    lib = ctypes.CDLL(str(fake.path))
    ctx, handle = ctypes.c_void_p(), ctypes.c_ulonglong()
    assert lib.cuInit(0) == 0
    assert lib.cuDevicePrimaryCtxRetain(ctypes.byref(ctx), 0) == 0 and lib.cuCtxSetCurrent(ctx) == 0
    assert lib.cuMemImportFromShareableHandle(ctypes.byref(handle), ctypes.c_void_p(fd), POSIX_FD) == 0
    prop = _AllocationProp()
    assert lib.cuMemGetAllocationPropertiesFromHandle(ctypes.byref(prop), handle) == 0
    assert (prop.location.type, prop.location.id) == (1, 1)  # a device, GPU 1 as this process numbers it
    address, length = ctypes.c_uint64(), ctypes.c_size_t(size)
    zero = ctypes.c_uint64(0)
    assert lib.cuMemAddressReserve(ctypes.byref(address), length, ctypes.c_size_t(0), zero, zero) == 0
    assert lib.cuMemMap(address, length, ctypes.c_size_t(0), handle, zero) == 0
    assert fake.vmm_bytes_on(1) == size and fake.vmm_bytes_on(0) == 0  # counted where it lives, once mapped
    assert lib.cuMemUnmap(address, length) == 0 and lib.cuMemAddressFree(address, length) == 0
    assert lib.cuMemRelease(handle) == 0
    ctypes.CDLL(None).close(fd)
    assert lib.cuCtxSetCurrent(None) == 0  # no context left current on this thread for the next test
    assert lib.cuDevicePrimaryCtxRelease(0) == 0
