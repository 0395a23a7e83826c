"""The processes of one simulated host see each other's GPU memory, as NVML shows every process's on
a real host: with FAKE_CUDA_HOST_DIR set (as `flexium demo` sets it for its job and for the jobs a
user starts beside it), each process says there what it holds on each GPU, and every other process
counts it, under its pid, for as long as it lives."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
from pathlib import Path
from typing import Any

import pytest

from flexium.engine import nvml
from support.engine import driver, fake  # noqa: F401  (fixtures)
from support.fake_driver import FakeDriver, host_gpus_in_another_process

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
