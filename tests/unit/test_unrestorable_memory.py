"""Memory the driver's checkpoint cannot bring back (docs/facts.md fact 26): the native layer finds
the process's cuMem allocations located on the host (csrc/host_cumem_scan.cpp), and a pause or move
of a process holding one is refused before anything is touched, at the operation's start and again
at its safe point. The fake driver makes that memory as NCCL does; the GPU test does it on an H200."""

from __future__ import annotations

from typing import Any, Callable

import pytest

from engine_fixtures import GiB, MiB, checkpoint_ops, driver, fake, make_engine  # noqa: F401  (fixtures)
from fake_driver import FakeDriver
from flexium import _C
from flexium.engine import EngineState
from flexium.errors import CapabilityError, OperationFailedError

SIZE = 4 * MiB


def test_the_scan_finds_host_cumem_memory_and_nothing_else(fake: FakeDriver) -> None:
    assert _C.host_cumem_mappings() == []
    # The fake maps device memory into the process too (the real driver does not): the scan must ask
    # where each allocation lives, not take every cuMem mapping for host memory.
    frees = [fake.cumem_mapping(SIZE, on_host=False), fake.cumem_mapping(SIZE), fake.cumem_mapping(2 * SIZE)]
    try:
        found = _C.host_cumem_mappings()
        on_host = [(f.address, size) for f, size in zip(frees[1:], (SIZE, 2 * SIZE), strict=True)]  # type: ignore[attr-defined]
        assert sorted((m.address, m.size) for m in found) == sorted(on_host)
        assert {m.location for m in found} == {"host NUMA node 0"}
    finally:
        for free in frees:
            free()
    assert _C.host_cumem_mappings() == []
    assert fake.vmm_leaks()["handles"] == 0  # every handle the scan retained was released


def test_a_pause_or_move_of_a_process_holding_it_is_refused_before_anything_is_touched(
    fake: FakeDriver, make_engine: Callable[..., Any]
) -> None:
    fake.set_process_memory(0, GiB)
    engine = make_engine()
    free = fake.cumem_mapping(SIZE)
    try:
        for operation in (engine.pause, lambda: engine.migrate(engine.gpus[1])):
            with pytest.raises(CapabilityError) as caught:
                operation()
            message = str(caught.value)
            assert "holds cuMem memory located on the host (1 mapping, 4.0 MiB on host NUMA node 0" in message
            assert f"the first at {free.address:#x}" in message  # type: ignore[attr-defined]
            assert "fails and leaves the process unable to use CUDA again (docs/facts.md fact 26)" in message
            assert "NCCL_CUMEM_HOST_ENABLE=0" in message and "cudaHostAlloc" in message
            assert checkpoint_ops(fake) == []
            assert engine.state == EngineState.RUNNING and fake.physical_of(0) == 0
    finally:
        free()
    assert engine.pause().ok  # once it is freed, the job pauses and resumes as any other
    assert engine.resume().ok
    assert checkpoint_ops(fake) == ["Lock", "Checkpoint", "Restore", "Unlock"]


@pytest.mark.parametrize("operation", ["pause", "migrate"])
def test_memory_made_while_the_operation_waited_is_refused_at_its_safe_point(
    fake: FakeDriver, make_engine: Callable[..., Any], operation: str
) -> None:
    fake.set_process_memory(0, GiB)
    engine = make_engine()
    made: list[Callable[[], None]] = []

    def made_now(state: EngineState) -> None:  # after the operation's first look, before prepare's
        if state in (EngineState.PAUSING, EngineState.MIGRATING) and not made:
            made.append(fake.cumem_mapping(SIZE))

    engine.add_state_listener(made_now)
    run = engine.pause if operation == "pause" else (lambda: engine.migrate(engine.gpus[1]))
    try:
        with pytest.raises(OperationFailedError) as caught:
            run()
        assert caught.value.step == "prepare"
        assert f"{operation} refused at step 'prepare' before anything was locked: this process holds cuMem" in str(
            caught.value
        )
        assert checkpoint_ops(fake) == []
        assert engine.state == EngineState.RUNNING and not engine.is_busy()
    finally:
        for free in made:
            free()
    assert run().ok
