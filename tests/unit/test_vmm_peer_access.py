"""Which GPUs may reach the pool's memory (csrc/vmm_peer_access.cpp): every GPU the process uses, by
the pool's segments or through PyTorch's own allocator, that can reach it, and none other."""

from __future__ import annotations

import ctypes

import pytest

from flexium import _C
from support import fake_driver
from support.fake_driver import FakeDriver
from support.vmm import (  # noqa: F401  (fixtures)
    NO_LEAKS,
    Allocator,
    MiB,
    allocator,
    driver,
    fake,
    segments,
)

# ----------------------------------------------------------------------------- several GPUs in one process

ILLEGAL_ADDRESS = fake_driver.CUDA_ERRORS["CUDA_ERROR_ILLEGAL_ADDRESS"]


def test_the_pool_is_reachable_from_every_gpu_the_process_uses(fake: FakeDriver, allocator: Allocator) -> None:
    """DataParallel's scatter and gather copy between the GPUs' memory; VMM memory is reachable only
    from the devices it was opened to (the HF Trainer failed in its first gather before)."""
    on0 = allocator.must_alloc(2 * MiB, 0)
    assert fake.copy_on(1, on0, on0, MiB) == ILLEGAL_ADDRESS  # one GPU used: GPU 1 has no access
    assert fake.primary_ctx_refcount(1) == 0
    on1 = allocator.must_alloc(2 * MiB, 1)  # the process now uses GPU 1 too
    ctypes.memset(on0, 7, MiB)
    assert fake.copy_on(1, on1, on0, MiB) == 0  # GPU 1 reads GPU 0's memory (a gather)
    assert fake.copy_on(0, on0 + MiB, on1, MiB) == 0  # and GPU 0 reads GPU 1's (a scatter's reverse)
    assert ctypes.string_at(on0 + MiB, MiB) == b"\x07" * MiB
    later = allocator.must_alloc(2 * MiB, 0)  # later segments are opened to both from the start
    assert fake.copy_on(1, on1, later, MiB) == 0

    # After a driver checkpoint the segments get fresh memory of their own: still reachable.
    assert _C.vmm_mark_restored_by_driver() == 3
    assert _C.own_imported(0) == 4 * MiB
    assert fake.copy_on(1, on1, on0, MiB) == 0 and fake.copy_on(1, on1, later, MiB) == 0
    for address in (on0, on1, later):
        allocator.free(address)
    assert fake.vmm_leaks() == NO_LEAKS


def test_the_pool_is_opened_to_a_gpu_used_through_pytorchs_own_allocator(
    fake: FakeDriver, allocator: Allocator
) -> None:
    """In a real job the pool is on the job's own GPU only; a second GPU (DataParallel's replicas,
    the back of a split model) holds PyTorch's own memory, so it has no pool segment but an active
    context, and PyTorch runs a copy between GPUs on the source GPU: GPU 1 writes GPU 0's pool for
    a gather. The pool opens to it at the next segment it makes, the earlier segments too."""
    lib = fake.library
    early = allocator.must_alloc(2 * MiB, 0)
    assert fake.copy_on(1, early + MiB, early, MiB) == ILLEGAL_ADDRESS  # GPU 1 not used yet
    ctx = ctypes.c_void_p()
    assert lib.cuDevicePrimaryCtxRetain(ctypes.byref(ctx), 1) == 0  # the process begins to use GPU 1
    try:
        later = allocator.must_alloc(2 * MiB, 0)
        assert fake.copy_on(1, later, early, MiB) == 0  # both segments reachable from GPU 1
        assert fake.copy_on(1, early + MiB, later + MiB, MiB) == 0
        assert all(s.device == 0 for s in _C.vmm_segments())  # no pool memory on GPU 1 for it
        # After a driver checkpoint the segments get fresh memory of their own: still reachable.
        assert _C.vmm_mark_restored_by_driver() == 2
        assert _C.own_imported(0) == 4 * MiB
        assert fake.copy_on(1, later, early, MiB) == 0
    finally:
        lib.cuDevicePrimaryCtxRelease(1)
    for address in (early, later):
        allocator.free(address)
    assert fake.vmm_leaks() == NO_LEAKS


def test_the_pool_opens_to_a_gpu_in_use_without_making_a_segment(fake: FakeDriver, allocator: Allocator) -> None:
    """What the pool does at each optimizer step and before DataParallel's gather: a GPU whose
    context became active gets the existing segments, each once (the access stays with the memory)."""
    lib = fake.library
    early = allocator.must_alloc(2 * MiB, 0)
    assert _C.open_pool_to_current_users() == 0  # one GPU used
    ctx = ctypes.c_void_p()
    assert lib.cuDevicePrimaryCtxRetain(ctypes.byref(ctx), 1) == 0
    try:
        assert fake.copy_on(1, early + MiB, early, MiB) == ILLEGAL_ADDRESS
        assert _C.open_pool_to_current_users() == 1
        assert fake.copy_on(1, early + MiB, early, MiB) == 0
        assert _C.open_pool_to_current_users() == 0  # already open
    finally:
        lib.cuDevicePrimaryCtxRelease(1)
    allocator.free(early)
    assert fake.vmm_leaks() == NO_LEAKS


@pytest.mark.parametrize("function", ["cuDevicePrimaryCtxGetState", "cuMemSetAccess"])
def test_an_allocation_never_fails_for_another_gpu_in_use(
    fake: FakeDriver, allocator: Allocator, function: str
) -> None:
    """Opening the pool to the other GPUs a job uses is best effort: a driver call failing there
    (GPU 1's state, or GPU 1's access: the allocation's second cuMemSetAccess) never fails the
    job's allocation, and the pool's next look opens it."""
    lib = fake.library
    ctx = ctypes.c_void_p()
    assert lib.cuDevicePrimaryCtxRetain(ctypes.byref(ctx), 1) == 0
    try:
        fake.fail(function, "CUDA_ERROR_UNKNOWN", nth=2 if function == "cuMemSetAccess" else 1)
        address = allocator.must_alloc(2 * MiB, 0)
        assert fake.copy_on(0, address + MiB, address, MiB) == 0
        assert fake.copy_on(1, address + MiB, address, MiB) == ILLEGAL_ADDRESS
        assert _C.open_pool_to_current_users() == 1  # the next look
        assert fake.copy_on(1, address + MiB, address, MiB) == 0
    finally:
        lib.cuDevicePrimaryCtxRelease(1)
    allocator.free(address)
    assert fake.vmm_leaks() == NO_LEAKS


def test_gpus_that_cannot_reach_each_other_are_not_opened(fake: FakeDriver, allocator: Allocator) -> None:
    fake.set_peer_access(False)
    on0, on1 = allocator.must_alloc(2 * MiB, 0), allocator.must_alloc(2 * MiB, 1)
    assert fake.copy_on(1, on1, on0, MiB) == ILLEGAL_ADDRESS
    assert fake.copy_on(0, on0, on1, MiB) == ILLEGAL_ADDRESS
    assert fake.copy_on(0, on0, on0 + MiB, MiB) == 0  # each GPU its own, as before
    allocator.free(on0)
    allocator.free(on1)
    assert fake.vmm_leaks() == NO_LEAKS
