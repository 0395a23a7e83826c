"""The processes of one simulated host see each other's GPU memory, as NVML shows every process's on
a real host: with FAKE_CUDA_HOST_DIR set (as `flexium demo` sets it for its job and for the jobs a
user starts beside it), each process says there what it holds on each GPU, and every other process
counts it, under its pid, for as long as it lives."""

from __future__ import annotations

import ctypes
import os
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path
from typing import Any

import pytest

from flexium.engine import nvml
from support.engine import driver, fake  # noqa: F401  (fixtures)
from support.fake_driver import FakeDriver, _AllocationProp, _Location, host_gpus_in_another_process

GIB = 1 << 30

# A neighbour: holds 5 GiB on GPU 1 (as the demo job holds its memory), says so, and waits to be ended.
NEIGHBOUR = textwrap.dedent(
    """
    import ctypes, os, sys
    lib = ctypes.CDLL(os.environ["FLEXIUM_LIBCUDA"])
    lib.fake_set_process_memory(1, ctypes.c_ulonglong(5 << 30))
    print("holding", flush=True)
    sys.stdin.read()
    """
)


# Another process that imports the memory this one exported (as the copier maps a job's segments, or
# the job the memory the copier made at a resume) and maps it.
IMPORTER = textwrap.dedent(
    """
    import ctypes, os, sys
    lib = ctypes.CDLL(os.environ["FLEXIUM_LIBCUDA"])
    fd, size = int(sys.argv[1]), ctypes.c_size_t(int(sys.argv[2]))
    ctx, handle, address, zero = ctypes.c_void_p(), ctypes.c_ulonglong(), ctypes.c_uint64(), ctypes.c_uint64(0)
    for rc in (
        lib.cuInit(0),
        lib.cuDevicePrimaryCtxRetain(ctypes.byref(ctx), 0),
        lib.cuCtxSetCurrent(ctx),
        lib.cuMemImportFromShareableHandle(ctypes.byref(handle), ctypes.c_void_p(fd), 1),
        lib.cuMemAddressReserve(ctypes.byref(address), size, ctypes.c_size_t(0), zero, zero),
        lib.cuMemMap(address, size, ctypes.c_size_t(0), handle, zero),
    ):
        assert rc == 0, rc
    print("mapped", flush=True)
    sys.stdin.read()
    """
)


def _read_in_another_process(library: Path, host_dir: Path) -> dict[int, dict[str, Any]]:
    return host_gpus_in_another_process(library, FAKE_CUDA_HOST_DIR=str(host_dir))


def _start_neighbour(fake: FakeDriver, host_dir: Path) -> subprocess.Popen[str]:
    total = os.environ.get("FAKE_CUDA_TOTAL_MIB", "")
    env = fake.environment(FAKE_CUDA_HOST_DIR=str(host_dir), FAKE_CUDA_TOTAL_MIB=total)
    neighbour = subprocess.Popen(
        [sys.executable, "-c", NEIGHBOUR], env=env, stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True
    )
    assert neighbour.stdout is not None and neighbour.stdout.readline().strip() == "holding"
    return neighbour


def test_each_process_of_the_host_sees_the_others(
    fake: FakeDriver, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    host_dir = tmp_path / "host"
    host_dir.mkdir()
    monkeypatch.setenv("FAKE_CUDA_HOST_DIR", str(host_dir))
    monkeypatch.setenv("FAKE_CUDA_TOTAL_MIB", "8192")
    fake.reset()

    # This process's memory, made through the driver's calls, is seen by another process of the host.
    free = fake.cumem_mapping(4 * fake.granularity, on_host=False)
    there = _read_in_another_process(fake.path, host_dir)
    assert there[0]["memory_used"] == 4 * fake.granularity
    assert there[0]["processes"] == [{"pid": os.getpid(), "used_bytes": 4 * fake.granularity}]
    free()
    assert _read_in_another_process(fake.path, host_dir)[0]["memory_used"] == 0
    assert list(host_dir.iterdir()) == []  # holding nothing, it says nothing

    neighbour = _start_neighbour(fake, host_dir)
    try:
        here = {gpu.index: gpu for gpu in nvml.host_gpus()}
        assert here[1].memory_used == 5 * GIB and here[1].used_by(neighbour.pid) == 5 * GIB
        assert here[0].memory_used == 0
        # Its memory is room taken: this process cannot make more than what is left of the 8 GiB.
        with pytest.raises(ValueError, match="cuMemCreate"):
            fake.cumem_mapping(4 * GIB, on_host=False, device=1)
        fake.cumem_mapping(2 * GIB, on_host=False, device=1)()
    finally:
        neighbour.stdin.close()  # type: ignore[union-attr]
        assert neighbour.wait(30) == 0
    assert {gpu.index: gpu.memory_used for gpu in nvml.host_gpus()} == {0: 0, 1: 0}
    assert list(host_dir.iterdir()) == []  # it took its file with it


def test_a_killed_process_holds_nothing(fake: FakeDriver, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A process killed outright leaves its file behind: it is not counted, as its memory went with
    it, and the next process to read the directory takes the file away."""
    host_dir = tmp_path / "host"
    host_dir.mkdir()
    monkeypatch.setenv("FAKE_CUDA_HOST_DIR", str(host_dir))
    fake.reset()
    neighbour = _start_neighbour(fake, host_dir)
    assert nvml.host_gpus()[1].memory_used == 5 * GIB
    neighbour.send_signal(signal.SIGKILL)
    neighbour.wait(30)
    assert [path.name for path in host_dir.iterdir()] == [str(neighbour.pid)]
    assert _read_in_another_process(fake.path, host_dir)[1]["memory_used"] == 0
    assert nvml.host_gpus()[1].memory_used == 0
    assert list(host_dir.iterdir()) == []


def test_memory_two_processes_hold_counts_once_and_goes_with_its_last_holder(
    fake: FakeDriver, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Made here, exported and mapped by another process too: every process of the host counts it once.
    Handed over (this process lets go of its handle and closes the fd, which takes no driver call),
    it is the other's alone within a moment; gone with that one, no process counts it."""
    host_dir = tmp_path / "host"
    host_dir.mkdir()
    monkeypatch.setenv("FAKE_CUDA_HOST_DIR", str(host_dir))
    fake.reset()
    lib, size = fake.library, 64 * fake.granularity
    ctx, previous, handle, fd = ctypes.c_void_p(), ctypes.c_void_p(), ctypes.c_ulonglong(), ctypes.c_int(-1)
    prop = _AllocationProp(type=1, location=_Location(type=1, id=0))
    prop.requestedHandleTypes = 1  # a POSIX fd
    lib.cuCtxGetCurrent(ctypes.byref(previous))
    assert lib.cuDevicePrimaryCtxRetain(ctypes.byref(ctx), 0) == 0 and lib.cuCtxSetCurrent(ctx) == 0
    assert lib.cuMemCreate(ctypes.byref(handle), ctypes.c_size_t(size), ctypes.byref(prop), ctypes.c_uint64(0)) == 0
    assert lib.cuMemExportToShareableHandle(ctypes.byref(fd), handle, 1, ctypes.c_uint64(0)) == 0
    importer = subprocess.Popen(
        [sys.executable, "-c", IMPORTER, str(fd.value), str(size)],
        env=fake.environment(FAKE_CUDA_HOST_DIR=str(host_dir)),
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
        pass_fds=(fd.value,),
    )
    try:
        assert importer.stdout is not None and importer.stdout.readline().strip() == "mapped"
        assert fake.used_bytes(0) == size
        assert _read_in_another_process(fake.path, host_dir)[0]["memory_used"] == size
        assert lib.cuMemRelease(handle) == 0
        os.close(fd.value)  # handed over: no driver call says so
        deadline = time.monotonic() + 5
        while (host_dir / str(os.getpid())).exists() and time.monotonic() < deadline:
            time.sleep(0.05)
        assert not (host_dir / str(os.getpid())).exists()  # this process holds nothing now
        there = _read_in_another_process(fake.path, host_dir)[0]
        assert there["memory_used"] == size and there["processes"] == [{"pid": importer.pid, "used_bytes": size}]
    finally:
        importer.stdin.close()  # type: ignore[union-attr]
        importer.wait(30)
        lib.cuCtxSetCurrent(previous)  # contexts outlive the fake's reset: the next test finds none
        lib.cuDevicePrimaryCtxRelease(0)
    assert _read_in_another_process(fake.path, host_dir)[0]["memory_used"] == 0


def test_a_file_of_a_pid_used_again_is_not_counted(fake: FakeDriver, tmp_path: Path) -> None:
    """A file left by a process killed outright before a reboot names a pid that another process may
    have now: its start time tells them apart, and the file is taken away."""
    host_dir = tmp_path / "host"
    host_dir.mkdir()
    stranger = subprocess.Popen([sys.executable, "-c", "import sys; sys.stdin.read()"], stdin=subprocess.PIPE)
    try:
        (host_dir / str(stranger.pid)).write_text("start 1\n0 6442450944 0\n")
        assert _read_in_another_process(fake.path, host_dir)[0]["memory_used"] == 0
        assert list(host_dir.iterdir()) == []
    finally:
        stranger.stdin.close()  # type: ignore[union-attr]
        stranger.wait(30)


# A job of the simulated host (as `flexium demo` starts its own): holds 3 GiB on the device it names.
HOLDER = textwrap.dedent(
    """
    import sys
    from flexium import simulated
    try:
        simulated.hold_job_memory("gpu1", 1 << 30)
    except ValueError as exc:
        print(exc, flush=True)
    simulated.hold_job_memory(sys.argv[1], 3 << 30)
    print("holding", flush=True)
    sys.stdin.read()
    """
)


def test_a_simulated_job_holds_its_memory_on_its_own_device(tmp_path: Path) -> None:
    from flexium import simulated

    library = simulated.library_path()
    assert library is not None, "this build of flexium has no simulated driver"
    host_dir = tmp_path / "host"
    host_dir.mkdir()
    env = {**os.environ, **simulated.environment(library, host_dir)}
    holder = subprocess.Popen(
        [sys.executable, "-c", HOLDER, "cuda:1"], env=env, stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True
    )
    try:
        assert holder.stdout is not None
        refused = holder.stdout.readline().strip()
        assert refused == "hold_job_memory: 'gpu1' is not a GPU of this process; pass its cuda:N"
        assert holder.stdout.readline().strip() == "holding"
        seen = host_gpus_in_another_process(library, **simulated.environment(library, host_dir))
        assert seen[1]["processes"] == [{"pid": holder.pid, "used_bytes": 3 * GIB}]
        assert seen[0]["memory_used"] == 0
    finally:
        holder.stdin.close()  # type: ignore[union-attr]
        assert holder.wait(30) == 0


def test_each_simulated_host_counts_its_own_processes_only(fake: FakeDriver, tmp_path: Path) -> None:
    """Simulated hosts beside one another (FLEXIUM_SIMULATED_HOST, the demo's FAKE_CUDA_HOST_DIR for all):
    a neighbour on host sim-a holds memory on sim-a's GPU 1, not on sim-b's."""
    host_dir = tmp_path / "host"
    host_dir.mkdir()
    total = os.environ.get("FAKE_CUDA_TOTAL_MIB", "")
    env = {
        **fake.environment(FAKE_CUDA_HOST_DIR=str(host_dir), FAKE_CUDA_TOTAL_MIB=total),
        "FLEXIUM_SIMULATED_HOST": "sim-a",
    }
    neighbour = subprocess.Popen(
        [sys.executable, "-c", NEIGHBOUR], env=env, stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True
    )
    try:
        assert neighbour.stdout is not None and neighbour.stdout.readline().strip() == "holding"
        on_a = host_gpus_in_another_process(fake.path, FAKE_CUDA_HOST_DIR=str(host_dir), FLEXIUM_SIMULATED_HOST="sim-a")
        on_b = host_gpus_in_another_process(fake.path, FAKE_CUDA_HOST_DIR=str(host_dir), FLEXIUM_SIMULATED_HOST="sim-b")
        assert on_a[1]["memory_used"] == 5 * GIB and on_b[1]["memory_used"] == 0, (on_a[1], on_b[1])
        assert on_a[1]["uuid"] != on_b[1]["uuid"]
        assert sorted(path.name for path in host_dir.iterdir()) == ["host-sim-a", "host-sim-b"]
    finally:
        neighbour.stdin.close()  # type: ignore[union-attr]
        assert neighbour.wait(30) == 0
