"""NVML reads while the process is frozen (flexium/engine/nvml.py) go to the reader process, else
to a short-lived child; both run nvml.py by its path with the fake NVML the parent uses and
report the same GPUs."""

from __future__ import annotations

from flexium.engine import nvml
from support.engine import driver, fake  # noqa: F401  (fixtures)
from support.fake_driver import FakeDriver


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


def _room(pipes: tuple[int, int], uuid: str, needed: int) -> tuple[int, str, str]:
    from flexium import _C

    outcome = _C.run_steps(0, [_C.room_check_step(pipes[0], pipes[1], uuid, needed)], [])[0]
    return outcome.code, outcome.step, outcome.error_text


def test_the_room_check_asks_the_reader_process_over_its_pipes(fake: FakeDriver) -> None:  # noqa: F811
    """The native room check (csrc/room_check.h) against the real reader process: the free memory its
    fake reports, a GPU it does not know, and a Python read between two checks that still works."""
    nvml.start_reader()
    try:
        gpu = nvml._read_here()[0]
        with nvml.reader_pipes() as pipes:
            assert pipes is not None
            assert _room(pipes, gpu.uuid, gpu.memory_free) == (0, "room", "")
            code, _, text = _room(pipes, gpu.uuid, gpu.memory_free + 1)
            assert code != 0
            mib = gpu.memory_free >> 20
            assert text == f"{gpu.uuid} has {mib} MiB free, the restore needs {mib} MiB"
            assert _room(pipes, "GPU-nothing", 1) == (0, "room", "not checked: NVML cannot tell the GPU's free memory")
        nvml.set_frozen(True)
        try:
            assert [g.uuid for g in nvml.host_gpus()] == fake.uuids()  # the reader answers reads as before
        finally:
            nvml.set_frozen(False)
    finally:
        nvml.stop_reader()


def test_a_room_check_without_a_reader_passes_unchecked(fake: FakeDriver) -> None:  # noqa: F811
    with nvml.reader_pipes() as pipes:
        assert pipes is None
    assert _room((-1, -1), fake.uuids()[0], 1) == (0, "room", "not checked: no NVML reader")
