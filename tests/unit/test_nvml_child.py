"""NVML reads while the process is frozen (flexium/engine/nvml.py) go to the reader process, else
to a short-lived child; both run nvml.py by its path with the fake NVML the parent uses and
report the same GPUs."""

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


def test_frozen_reads_go_to_the_reader_process_and_to_a_child_once_it_is_gone(fake: FakeDriver) -> None:  # noqa: F811
    nvml.start_reader()
    try:
        reader = nvml._reader
        assert reader is not None
        nvml.set_frozen(True)
        try:
            for _ in range(3):  # one process answers every read
                assert [g.uuid for g in nvml.host_gpus()] == fake.uuids()
                assert nvml._reader is reader and reader.proc.poll() is None
            reader.proc.kill()
            reader.proc.wait()
            assert [g.uuid for g in nvml.host_gpus()] == fake.uuids()  # a child read instead
            assert nvml._reader is None
        finally:
            nvml.set_frozen(False)
    finally:
        nvml.stop_reader()
    assert nvml._reader is None


def test_stopping_the_reader_ends_its_process(fake: FakeDriver) -> None:  # noqa: F811
    nvml.start_reader()
    reader = nvml._reader
    assert reader is not None
    nvml.stop_reader()
    assert reader.proc.returncode == 0
