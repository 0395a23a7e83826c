"""NVML reads while the process is frozen run in a child process (flexium/engine/nvml.py): the
child runs nvml.py by its path, with the fake NVML the parent uses, and reports the same GPUs."""

from __future__ import annotations

from engine_fixtures import driver, fake  # noqa: F401  (fixtures)
from fake_driver import FakeDriver
from flexium.engine import nvml


def test_a_read_in_a_child_sees_the_gpus_the_parent_sees(fake: FakeDriver) -> None:  # noqa: F811
    here = nvml._read_here()
    child = nvml._read_in_child(timeout=60)
    assert [g.uuid for g in child] == [g.uuid for g in here] == fake.uuids()
    assert [g.memory_total for g in child] == [g.memory_total for g in here]


def test_host_gpus_reads_in_a_child_while_frozen(fake: FakeDriver) -> None:  # noqa: F811
    nvml.set_frozen(True)
    try:
        assert [g.uuid for g in nvml.host_gpus()] == fake.uuids()
    finally:
        nvml.set_frozen(False)
