"""A simulated host's other processes (a neighbour a test starts and ends) are seen by every process
of the host: the simulated driver reads FAKE_CUDA_HOST_FILE at each use, in the job and in another
process alike (the job's NVML reader process, while the job is paused)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from flexium.engine import nvml
from support.engine import MiB, driver, fake  # noqa: F401  (fixtures)
from support.fake_driver import OTHER_PID_BASE, FakeDriver, host_gpus_in_another_process, write_host_file

GIB = 1 << 30


def _read_in_another_process(library: Path, host_file: Path) -> dict[int, dict[str, Any]]:
    return host_gpus_in_another_process(library, FAKE_CUDA_HOST_FILE=str(host_file))


def test_every_process_of_the_host_sees_its_neighbours(
    fake: FakeDriver, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    host_file = tmp_path / "host"
    monkeypatch.setenv("FAKE_CUDA_HOST_FILE", str(host_file))
    fake.reset()
    fake.set_process_memory(0, 3 * MiB)
    write_host_file(host_file, {1: 20 * GIB})
    here = {gpu.index: gpu for gpu in nvml.host_gpus()}
    assert here[1].memory_used == 20 * GIB and here[1].used_by(OTHER_PID_BASE + 1) == 20 * GIB
    assert here[0].memory_used == 3 * MiB
    there = _read_in_another_process(fake.path, host_file)
    assert there[1]["memory_used"] == 20 * GIB and there[0]["memory_used"] == 0  # the job's memory is its own

    write_host_file(host_file, {})  # the neighbour exits
    assert {gpu.index: gpu.memory_used for gpu in nvml.host_gpus()} == {0: 3 * MiB, 1: 0}
    assert _read_in_another_process(fake.path, host_file)[1]["memory_used"] == 0
