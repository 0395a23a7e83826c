"""Memory the driver's checkpoint cannot carry: managed memory (fact `managed-memory-refused`), cuMem memory located on
the host (fact `cumem-host-memory-unrestorable`) and CUDA memory imported from another process (fact
`ipc-import-unrestorable`). The native layer finds the first two (csrc/uncheckpointable_memory.cpp), PyTorch's record
the third, and a pause or move of a process holding some is refused before anything is touched, at the operation's start
and again at its safe point. The fake driver makes both as the real one does; the GPU tests make them on an H200."""

from __future__ import annotations

import ctypes
import gc
import inspect
import os
import re
from collections.abc import Callable, Sequence
from typing import Any

import pytest

from flexium import _C
from flexium.engine import EngineState
from flexium.engine.guards import imported_memory
from flexium.errors import CapabilityError, OperationFailedError
from support.engine import GiB, MiB, checkpoint_ops, driver, fake, make_engine, wait_until  # noqa: F401  (fixtures)
from support.fake_driver import FakeDriver

SIZE = 4 * MiB
HOST_CUMEM = "this process holds cuMem memory located on the host (1 mapping, 4.0 MiB, the first at"
MANAGED = "this process holds managed memory (1 mapping, 4.0 MiB, the first at"


def found() -> list[tuple[int, int, str, str]]:
    return sorted((m.address, m.size, m.kind, m.location) for m in _C.uncheckpointable_mappings())


def test_the_scan_finds_managed_and_host_cumem_memory_and_nothing_else(fake: FakeDriver) -> None:
    assert found() == []
    # The fake maps device memory into the process too (the real driver does not): the scan must ask
    # where each allocation lives, not take every cuMem mapping for host memory.
    frees = [fake.cumem_mapping(SIZE, on_host=False), fake.cumem_mapping(SIZE), fake.cumem_mapping(2 * SIZE)]
    frees.append(fake.managed_memory(SIZE))
    try:
        addresses = [f.address for f in frees]  # type: ignore[attr-defined]
        assert found() == sorted(
            [
                (addresses[1], SIZE, "host cuMem", "host NUMA node 0"),
                (addresses[2], 2 * SIZE, "host cuMem", "host NUMA node 0"),
                (addresses[3], SIZE, "managed", ""),
            ]
        )
    finally:
        for free in frees:
            free()
    assert found() == []
    assert fake.vmm_leaks()["handles"] == 0  # every handle the scan retained was released


def test_the_scan_finds_host_cumem_memory_another_process_made(fake: FakeDriver) -> None:
    """As the copier makes host memory for a job's staging: imported and mapped here, it is host memory
    all the same, which the job must not hold mapped at its checkpoint; device memory made elsewhere is not."""
    on_host = fake.cumem_mapping(SIZE, made_elsewhere=True)
    on_device = fake.cumem_mapping(SIZE, on_host=False, made_elsewhere=True)
    try:
        assert found() == [(on_host.address, SIZE, "host cuMem", "host NUMA node 0")]  # type: ignore[attr-defined]
    finally:
        on_host()
        on_device()
    assert found() == []


def test_the_fake_checkpoint_refuses_managed_memory_as_the_driver_does(fake: FakeDriver) -> None:
    """fact `managed-memory-refused`, as the fake models it: what the refusal below keeps jobs from."""
    free = fake.managed_memory(SIZE)
    try:
        steps = [_C.Step(_C.StepKind.LOCK, timeout_ms=1000), _C.Step(_C.StepKind.CHECKPOINT)]
        outcomes = _C.run_steps(os.getpid(), steps, [[], [_C.Step(_C.StepKind.RECOVER)]])
        assert [(o.step, o.error_name, o.rollback) for o in outcomes] == [
            ("lock", "", False),
            ("checkpoint", "CUDA_ERROR_NOT_SUPPORTED", False),
            ("unlock", "", True),
        ]
        assert fake.state().name == "RUNNING"
    finally:
        free()


def refused_untouched(fake: FakeDriver, engine: Any, starts: str, what_to_do: Sequence[str]) -> None:
    """The pause and the migration are each refused with a message that starts "cannot OP: `starts`"
    and names what to do, before any checkpoint call; the job runs on where it was."""
    for name, operation in (("pause", engine.pause), ("migrate", lambda: engine.migrate(engine.gpus[1]))):
        with pytest.raises(CapabilityError) as caught:
            operation()
        message = str(caught.value)
        assert message.startswith(f"cannot {name}: {starts}"), message
        assert all(words in message for words in what_to_do), message
        assert checkpoint_ops(fake) == []
        assert engine.state == EngineState.RUNNING and fake.physical_of(0) == 0


@pytest.mark.parametrize("kind", ["host cuMem", "managed"])
def test_a_pause_or_move_of_a_process_holding_it_is_refused_before_anything_is_touched(
    fake: FakeDriver, make_engine: Callable[..., Any], kind: str
) -> None:
    fake.set_process_memory(0, GiB)
    engine = make_engine()
    free = fake.cumem_mapping(SIZE) if kind == "host cuMem" else fake.managed_memory(SIZE)
    said = HOST_CUMEM if kind == "host cuMem" else MANAGED
    what_to_do = ("NCCL_CUMEM_HOST_ENABLE=0", "cudaHostAlloc") if kind == "host cuMem" else ("paged_adamw_8bit",)
    try:
        refused_untouched(fake, engine, f"{said} {free.address:#x}", what_to_do)  # type: ignore[attr-defined]
    finally:
        free()
    assert engine.pause().ok  # once it is freed, the job pauses and resumes as any other
    assert engine.resume().ok
    assert checkpoint_ops(fake) == ["Lock", "Checkpoint", "Restore", "Unlock"]


def test_a_process_holding_both_is_told_of_both(fake: FakeDriver, make_engine: Callable[..., Any]) -> None:
    engine = make_engine()
    frees = [fake.managed_memory(SIZE), fake.cumem_mapping(SIZE)]
    try:
        with pytest.raises(CapabilityError) as caught:
            engine.pause()
        message = str(caught.value)
        assert message.startswith(f"cannot pause: {MANAGED}") and f"; and {HOST_CUMEM}" in message, message
    finally:
        for free in frees:
            free()


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
        assert f"{operation} refused at phase 'prepare' before anything was locked: {HOST_CUMEM}" in str(caught.value)
        assert checkpoint_ops(fake) == []
        assert engine.state == EngineState.RUNNING and not engine.is_busy()
    finally:
        for free in made:
            free()
    assert run().ok


# ---- CUDA memory imported from another process (fact `ipc-import-unrestorable`) ---------------------------

IMPORTED = "this process holds CUDA memory imported from another process (2 storages, 6.0 MiB, the first at 0x7f00"


def test_a_process_holding_imported_cuda_memory_is_refused_before_anything_is_touched(
    fake: FakeDriver, make_engine: Callable[..., Any], monkeypatch: pytest.MonkeyPatch
) -> None:
    """What PyTorch says the process holds (imported_memory.held_now, read from torch on the H200 by
    tests/gpu/test_fast_path.py) refuses the pause and the move, naming what to do."""
    fake.set_process_memory(0, GiB)
    engine = make_engine()
    monkeypatch.setattr(imported_memory, "held_now", lambda: imported_memory.Imports(2, 6 * MiB, 0x7F00_0000_0000))
    refused_untouched(fake, engine, IMPORTED, ("tensor.clone()", "fact `ipc-import-unrestorable`"))
    monkeypatch.undo()
    assert engine.pause().ok
    assert engine.resume().ok


def _send_back(queue: Any) -> None:  # a spawned process: sends a CPU tensor through shared memory
    import torch

    queue.put(torch.arange(1024, dtype=torch.float32))
    queue.get()  # holds it until told


def test_cpu_tensors_received_or_sent_through_torch_multiprocessing_are_no_cuda_imports() -> None:
    """Real torch.multiprocessing on the CPU: a tensor received from another process and one sent to
    it both land in torch's shared_cache, neither keyed as a CUDA import."""
    import torch
    import torch.multiprocessing as mp
    from torch.multiprocessing import reductions

    context = mp.get_context("spawn")
    queue = context.Queue()
    child = context.Process(target=_send_back, args=(queue,))
    child.start()
    try:
        received = queue.get(timeout=120)
        assert received.sum().item() == sum(range(1024))
        sent = torch.ones(1024)
        queue.put(sent)  # shared with the child by the queue's feeder thread: cached as an export
        wait_until(lambda: len(reductions.shared_cache) >= 2, what="the sent tensor to be shared")
        assert imported_memory.held_now() is None
    finally:
        child.join(timeout=60)
        if child.is_alive():
            child.kill()


def test_the_detector_reads_a_cuda_import_from_torchs_own_cache_until_it_is_let_go() -> None:
    """held_now on its real input: torch.multiprocessing's shared_cache holding an entry as
    rebuild_cuda_tensor writes one, (IPC handle, offset) -> StorageWeakRef of a storage on cuda:0.
    CPU torch makes that storage over host bytes it never touches (_construct_storage_from_data_pointer);
    beside it, what the detector must pass over: a CPU storage under a key of the same shape, and a CUDA
    storage keyed by its handle alone (one this process exported)."""
    import torch
    from torch.multiprocessing import reductions

    backing = ctypes.create_string_buffer(3 * MiB)
    address = ctypes.addressof(backing)
    imported = torch._C._construct_storage_from_data_pointer(address, torch.device("cuda", 0), 3 * MiB)
    assert imported.device.type == "cuda"
    cpu = torch.UntypedStorage(4096)
    entries = {
        (b"\x01" * 64, 2 * MiB): imported,  # (IPC handle, offset in bytes): an import
        (b"\x02" * 64, 0): cpu,
        b"\x03" * 64: imported,  # the handle alone: an export
    }
    try:
        for key, storage in entries.items():
            reductions.shared_cache[key] = reductions.StorageWeakRef(storage)
        assert imported_memory.held_now() == imported_memory.Imports(storages=1, bytes=3 * MiB, first_address=address)
        del storage, imported
        entries.clear()
        gc.collect()
        assert imported_memory.held_now() is None  # let go: the weak reference expired
    finally:
        with reductions.shared_cache.lock:
            for key in [(b"\x01" * 64, 2 * MiB), (b"\x02" * 64, 0), b"\x03" * 64]:
                dict.pop(reductions.shared_cache, key, None)


def test_torch_still_records_its_cuda_imports_where_flexium_reads_them() -> None:
    """imported_memory.held_now reads PyTorch's own record of the CUDA storages a process imported; a PyTorch that kept
    it elsewhere would leave such jobs unguarded (fact `ipc-import-unrestorable`) without a sound, so this fails
    first."""
    import torch
    from torch.multiprocessing import reductions

    rebuild = re.sub(r"\s+", "", inspect.getsource(reductions.rebuild_cuda_tensor))
    assert "shared_cache[(storage_handle,storage_offset_bytes)]=StorageWeakRef(storage)" in rebuild
    assert "storage=storage_cls._new_shared_cuda(" in rebuild
    assert isinstance(reductions.shared_cache, dict) and hasattr(reductions.shared_cache, "lock")
    assert callable(reductions.StorageWeakRef.expired) and callable(torch.UntypedStorage._new_with_weak_ptr)
