"""flexium.engine.fast.memory_pool without a GPU: how PyTorch's snapshot becomes the live ranges the
fast path copies, and the order of PyTorch calls that route, pause and end the routing.

This machine's torch has no CUDA, so the few torch.cuda functions the hook calls are replaced by
recorders (``FakeTorchCuda``); what they must do on a real GPU is checked by tests/gpu. The
driver side is the fake driver (tests/support/fake_driver.py), which has the VMM API."""

from __future__ import annotations

import gc
import resource
from collections.abc import Iterator
from types import SimpleNamespace
from typing import Any

import pytest

torch = pytest.importorskip("torch")

from flexium.engine.fast import memory_pool  # noqa: E402
from flexium.engine.fast.memory_pool import MemoryPool, _active_blocks, _merge  # noqa: E402
from support.engine import driver, fake  # noqa: E402,F401  (fixtures)
from support.fake_driver import FakeDriver  # noqa: E402

MiB = 1 << 20


# ----------------------------------------------------------------------------- live ranges


def test_merge_joins_touching_and_overlapping_ranges() -> None:
    assert _merge([(40, 10), (0, 8), (8, 4), (44, 20), (100, 1)]) == [(0, 12), (40, 24), (100, 1)]
    assert _merge([]) == []


def test_active_blocks_keep_what_is_allocated_or_waits_for_a_stream() -> None:
    base = 0x7F0000000000
    segment = {
        "address": base,
        "total_size": 8 * MiB,
        "blocks": [
            {"address": base, "size": 2 * MiB, "state": "active_allocated"},
            {"address": base + 2 * MiB, "size": 3 * MiB, "state": "inactive"},
            {"address": base + 5 * MiB, "size": 1 * MiB, "state": "active_pending_free"},
            {"address": base + 6 * MiB, "size": 2 * MiB, "state": "inactive"},
        ],
    }
    assert _active_blocks(segment, base) == [(0, 2 * MiB), (5 * MiB, 1 * MiB)]
    # Older snapshots give no block addresses: blocks follow each other from the segment's start.
    for block in segment["blocks"]:
        del block["address"]
    assert _active_blocks(segment, base) == [(0, 2 * MiB), (5 * MiB, 1 * MiB)]


# ----------------------------------------------------------------------------- routing


class FakeMemPool:
    made: list[FakeMemPool] = []

    def __init__(self, allocator: Any) -> None:
        self.allocator = allocator
        self.id = (0, len(FakeMemPool.made) + 1)
        FakeMemPool.made.append(self)


class FakeTorchCuda:
    """The torch.cuda surface memory_pool uses, recording each call in order."""

    def __init__(self, monkeypatch: pytest.MonkeyPatch) -> None:
        self.calls: list[tuple[Any, ...]] = []
        self.snapshot: list[dict[str, Any]] = []
        self.settings: list[str] = []
        FakeMemPool.made = []
        cuda, C = torch.cuda, torch._C
        monkeypatch.setattr(cuda, "is_available", lambda: True)
        monkeypatch.setattr(cuda, "is_initialized", lambda: False)
        monkeypatch.setattr(cuda, "MemPool", FakeMemPool)
        monkeypatch.setattr(cuda, "_maybe_exchange_device", lambda d: self._record("exchange", d) or 0)
        monkeypatch.setattr(cuda.memory, "CUDAPluggableAllocator", self._allocator)
        monkeypatch.setattr(C, "_accelerator_setAllocatorSettings", self.settings.append, raising=False)
        monkeypatch.setattr(cuda.memory, "_set_allocator_settings", self._deprecated_setter)
        monkeypatch.setattr(cuda, "memory_snapshot", lambda pool_id=None: self.snapshot)
        monkeypatch.setattr(C, "_cuda_beginAllocateToPool", lambda d, i: self._record("begin", d, i), raising=False)
        monkeypatch.setattr(C, "_cuda_endAllocateToPool", lambda d, i: self._record("end", d, i), raising=False)
        monkeypatch.setattr(C, "_cuda_releasePool", lambda d, i: self._record("release", d, i), raising=False)
        for name in memory_pool._ALLOC_CONF_VARIABLES:
            monkeypatch.delenv(name, raising=False)

    def _record(self, *call: Any) -> None:
        self.calls.append(call)

    def _deprecated_setter(self, settings: str) -> None:
        raise AssertionError(
            f"torch.cuda.memory._set_allocator_settings({settings!r}) warns on torch 2.9+: "
            "use torch._C._accelerator_setAllocatorSettings"
        )

    def _allocator(self, path: str, alloc: str, free: str) -> Any:
        self._record("allocator", alloc, free)

        class Allocator:
            def allocator(self) -> str:
                return "pluggable"

        return Allocator()


@pytest.fixture
def cuda(fake: FakeDriver, monkeypatch: pytest.MonkeyPatch) -> Iterator[FakeTorchCuda]:
    yield FakeTorchCuda(monkeypatch)
    assert memory_pool._installed is None, "a test left its pool installed"


def test_install_routes_the_device_and_uninstall_gives_the_use_back(cuda: FakeTorchCuda) -> None:
    pool = MemoryPool()
    assert pool.install([0]) and pool.active and pool.devices == (0,) and pool.reason_off is None
    (made,) = FakeMemPool.made
    assert made.allocator == "pluggable"
    assert cuda.calls == [
        ("allocator", "flexium_vmm_alloc", "flexium_vmm_free"),
        ("exchange", 0),
        ("exchange", 0),
        ("begin", 0, made.id),
    ]
    assert cuda.settings == [f"max_split_size_mb:{memory_pool.DEFAULT_MAX_SPLIT_MB}"]
    assert pool.install([0])  # a second install changes nothing
    assert len(FakeMemPool.made) == 1
    pool.uninstall()
    assert not pool.active and pool.reason_off == "uninstalled"
    assert cuda.calls[-2:] == [("end", 0, made.id), ("release", 0, made.id)]


def test_the_users_max_split_size_stands(cuda: FakeTorchCuda, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("PYTORCH_CUDA_ALLOC_CONF", "max_split_size_mb:1024,expandable_segments:False")
    pool = MemoryPool()
    assert pool.install([0])
    assert cuda.settings == []
    pool.uninstall()


def test_torch_before_2_9_gets_the_setting_through_torch_cuda(
    cuda: FakeTorchCuda, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.delattr(torch._C, "_accelerator_setAllocatorSettings", raising=False)
    monkeypatch.setattr(torch.cuda.memory, "_set_allocator_settings", cuda.settings.append)
    pool = MemoryPool()
    assert pool.install([0])
    assert cuda.settings == [f"max_split_size_mb:{memory_pool.DEFAULT_MAX_SPLIT_MB}"]
    pool.uninstall()


def test_memory_allocated_before_init_keeps_the_pool_off(cuda: FakeTorchCuda, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(torch.cuda, "is_initialized", lambda: True)
    monkeypatch.setattr(torch.cuda, "empty_cache", lambda: None)
    monkeypatch.setattr(torch._C, "_cuda_hasPrimaryContext", lambda d: True, raising=False)
    monkeypatch.setattr(torch.cuda, "memory_reserved", lambda d: 64 * MiB)
    pool = MemoryPool()
    assert not pool.install([0]) and not pool.active
    assert pool.reason_off is not None
    assert pool.reason_off.startswith("CUDA memory was allocated before flexium.init() (64 MiB on cuda:0)")
    assert "call flexium.init() before creating CUDA tensors" in pool.reason_off
    assert cuda.calls == []  # nothing routed


def test_a_driver_without_vmm_keeps_the_pool_off(cuda: FakeTorchCuda, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(memory_pool._C, "driver_status", lambda: SimpleNamespace(vmm_api=False))
    pool = MemoryPool()
    assert not pool.install([0])
    assert pool.reason_off == "the driver lacks the virtual memory management API (cuMemCreate and friends)"


def test_a_refused_pool_is_undone_and_said(cuda: FakeTorchCuda, monkeypatch: pytest.MonkeyPatch) -> None:
    def refuse(device: int, pool_id: Any) -> None:
        raise RuntimeError("not now")

    monkeypatch.setattr(torch._C, "_cuda_beginAllocateToPool", refuse)
    pool = MemoryPool()
    assert not pool.install([0]) and not pool.active
    assert pool.reason_off == "PyTorch refused the memory pool (RuntimeError: not now)"


def test_another_pool_destroyed_pauses_the_routing_until_the_next_step(cuda: FakeTorchCuda) -> None:
    pool = MemoryPool()
    assert pool.install([0])
    ours = FakeMemPool.made[0]
    theirs = FakeMemPool("user's")
    FakeMemPool.made.remove(theirs)  # the only reference left is this test's
    cuda.calls.clear()
    del theirs
    gc.collect()
    assert cuda.calls == [("end", 0, ours.id), ("release", 0, ours.id)]  # before their pool goes
    assert pool.active  # still installed; allocations meanwhile come from PyTorch's allocator

    model = torch.nn.Linear(2, 1)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    model(torch.ones(1, 2)).sum().backward()
    optimizer.step()  # the next safe point routes again
    assert cuda.calls[-1] == ("begin", 0, ours.id)
    optimizer.step()
    assert cuda.calls.count(("begin", 0, ours.id)) == 1  # once
    pool.uninstall()
    assert cuda.calls[-2:] == [("end", 0, ours.id), ("release", 0, ours.id)]
    optimizer.step()
    assert cuda.calls.count(("begin", 0, ours.id)) == 1  # the hook is gone with the pool


def test_live_ranges_read_the_pools_snapshot(
    cuda: FakeTorchCuda, fake: FakeDriver, monkeypatch: pytest.MonkeyPatch
) -> None:
    pool = MemoryPool()
    assert pool.install([0])
    ours, theirs = 0x7F0000000000, 0x7F1000000000
    monkeypatch.setattr(
        memory_pool._C, "vmm_segments", lambda: [SimpleNamespace(address=ours, size=4 * MiB, device=0, mapped=True)]
    )
    pool_id = FakeMemPool.made[0].id
    cuda.snapshot = [
        {
            "address": ours,
            "device": 0,
            "segment_pool_id": pool_id,
            "total_size": 4 * MiB,
            "blocks": [
                {"address": ours, "size": MiB, "state": "inactive"},
                {"address": ours + MiB, "size": MiB, "state": "active_allocated"},
                {"address": ours + 2 * MiB, "size": 2 * MiB, "state": "active_allocated"},
            ],
        },
        # a segment of another pool (a CUDA graph's), and one PyTorch has but we did not make
        {"address": theirs, "device": 0, "segment_pool_id": (7, 7), "total_size": MiB, "blocks": []},
        {"address": theirs, "device": 0, "segment_pool_id": pool_id, "total_size": MiB, "blocks": []},
    ]
    assert pool.live_ranges(0) == {ours: [(MiB, 3 * MiB)]}
    assert pool.live_ranges(1) == {}  # no pool there
    pool.uninstall()


def test_the_pool_opens_to_the_gpus_in_use_at_each_step_and_before_a_data_parallel_gather(
    cuda: FakeTorchCuda, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    """fact `jobs-use-every-visible-gpu`: another GPU the job uses copies into the pool; the pool looks for
    such GPUs at every optimizer step and before DataParallel's gather, and a failure there never
    reaches training."""
    looked: list[str] = []
    monkeypatch.setattr(memory_pool._C, "open_pool_to_current_users", lambda: looked.append("look") or 0)
    pool = MemoryPool()
    assert pool.install([0])
    model = torch.nn.Linear(2, 1)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    model(torch.ones(1, 2)).sum().backward()
    optimizer.step()
    assert looked == ["look"]
    replicas = SimpleNamespace(dim=0)  # a DataParallel's gather needs only its dim
    with pytest.raises(AssertionError, match="not implemented for CPU"):  # no CUDA here: after the look
        torch.nn.DataParallel.gather(replicas, [torch.ones(1)], "cpu")
    assert looked == ["look", "look"]

    def broken() -> int:
        raise RuntimeError("cuDevicePrimaryCtxGetState failed")

    monkeypatch.setattr(memory_pool._C, "open_pool_to_current_users", broken)
    optimizer.step()
    optimizer.step()  # training goes on; said once
    said = [r.getMessage() for r in caplog.records if "could not open the memory pool" in r.getMessage()]
    assert said == ["could not open the memory pool to the other GPUs this job uses: cuDevicePrimaryCtxGetState failed"]
    pool.uninstall()
    optimizer.step()  # the hook is gone with the pool
    with pytest.raises(AssertionError, match="not implemented for CPU"):  # the wrapper stays, idle
        torch.nn.DataParallel.gather(replicas, [torch.ones(1)], "cpu")


def test_the_open_file_limit_is_raised_for_one_fd_per_segment(cuda: FakeTorchCuda) -> None:
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    try:
        lowered = min(256, hard)
        resource.setrlimit(resource.RLIMIT_NOFILE, (lowered, hard))
        pool = MemoryPool()
        assert pool.install([0])
        now, _ = resource.getrlimit(resource.RLIMIT_NOFILE)
        expected = (
            hard
            if hard != resource.RLIM_INFINITY and hard < memory_pool.WANTED_OPEN_FILES
            else memory_pool.WANTED_OPEN_FILES
        )
        assert now == max(lowered, expected)
        pool.uninstall()
    finally:
        resource.setrlimit(resource.RLIMIT_NOFILE, (soft, hard))
