"""The fast migration's primitives (csrc/vmm_relocate.cpp) against the fake driver: the segments
staged to another GPU and exported as fds, their source backing released, the copies mapped back
at their own addresses after a checkpoint and a remapped restore; every failure undone."""

from __future__ import annotations

import os

import pytest

from flexium import _C
from support.fake_driver import FakeDriver, ProcessState
from support.vmm import (  # noqa: F401  (fixtures)
    H200_BYTES,
    NO_LEAKS,
    PID,
    Allocator,
    MiB,
    allocator,
    assert_contents,
    driver,
    driver_error,
    fake,
    is_open,
    make_segments,
    open_fds,
    segments,
    swap_plan,
)

# ----------------------------------------------------------------------------- relocation to another GPU


def test_stage_release_map_imported_across_a_migration(fake: FakeDriver, allocator: Allocator) -> None:
    contents = make_segments(allocator, [2 * MiB, 4 * MiB, 6 * MiB])
    fds_before = open_fds()
    staged = _C.stage_segments_to_device(1)
    assert [(s.address, s.size) for s in staged] == [(a, len(d)) for a, d in sorted(contents.items())]
    fds = {s.fd for s in staged}
    assert len(fds) == 3 and fds <= open_fds() - fds_before
    # The copies live on GPU 1, held only by their fds; the sources are untouched.
    assert fake.vmm_bytes_on(1) == 12 * MiB and fake.vmm_bytes_on(0) == 12 * MiB
    assert fake.vmm_handles() == 3 and fake.vmm_mappings() == 3 and fake.vmm_reservations() == 3
    assert fake.primary_ctx_refcount(1) == 0 and fake.live_streams() == 0  # no temporary context left
    assert_contents(contents)

    assert _C.release_source_backing() == 3
    assert fake.vmm_bytes_on(0) == 0 and fake.vmm_handles() == 0 and fake.vmm_mappings() == 0
    assert fake.vmm_reservations() == 3 and _C.vmm_segment_count() == 3  # the addresses stay ours

    outcomes = _C.run_steps(PID, *swap_plan(fake))
    assert all(o.code == 0 for o in outcomes), [(o.step, o.error_name) for o in outcomes]
    assert fake.placement() == [1, 0]
    # Skipped by the checkpoint, still on GPU 1 (fact `exported-fd-survives-checkpoint`).
    assert fake.vmm_bytes_on(1) == 12 * MiB

    _C.map_imported(staged, 0)  # logical device 0 is on GPU 1 now
    assert_contents(contents)
    assert not any(is_open(s.fd) for s in staged)
    assert segments() == [(a, len(d), 0, True) for a, d in sorted(contents.items())]
    assert fake.vmm_bytes_on(1) == 12 * MiB and fake.vmm_bytes_on(0) == 0
    assert fake.used_bytes(0) == 0 and fake.used_bytes(1) == 12 * MiB
    for address in contents:
        allocator.free(address)
    assert fake.vmm_leaks() == NO_LEAKS


def test_relocation_without_a_checkpoint_and_of_one_device_only(fake: FakeDriver, allocator: Allocator) -> None:
    on_0 = make_segments(allocator, [2 * MiB, 2 * MiB], device=0)
    on_1 = make_segments(allocator, [4 * MiB], device=1)
    staged = _C.stage_segments_to_device(1, source=0)
    assert sorted(s.address for s in staged) == sorted(on_0)
    assert _C.release_source_backing(source=0) == 2
    assert fake.vmm_bytes_on(0) == 0 and fake.vmm_bytes_on(1) == 8 * MiB
    _C.map_imported(staged, 1)
    assert_contents(on_0)
    assert_contents(on_1)
    assert {s.device for s in _C.vmm_segments()} == {1} and _C.vmm_bytes_on(1) == 8 * MiB


def test_closing_the_staged_fds_frees_the_copies(fake: FakeDriver, allocator: Allocator) -> None:
    make_segments(allocator, [2 * MiB, 4 * MiB])
    staged = _C.stage_segments_to_device(1)
    assert fake.vmm_bytes_on(1) == 6 * MiB and fake.vmm_allocations() == 4
    for entry in staged:
        os.close(entry.fd)
    assert fake.vmm_bytes_on(1) == 0 and fake.vmm_allocations() == 2


def test_fd_held_memory_counts_against_the_restore(fake: FakeDriver, allocator: Allocator) -> None:
    contents = make_segments(allocator, [6 * MiB])
    staged = _C.stage_segments_to_device(1)
    _C.release_source_backing()
    fake.set_process_memory(0, 8 * MiB)  # the rest of the process, carried by the checkpoint
    fake.set_other_memory(1, H200_BYTES - 10 * MiB)  # 10 MiB free on GPU 1, 6 held by our fd
    # What is checked is where the memory counts. The real driver would then refuse the rollback's
    # restore too (fact `restore-without-room-loses-process`), which the fake models unless told not to.
    fake.set_failed_restore_poisons(False)
    outcomes = _C.run_steps(PID, *swap_plan(fake))
    assert [(o.step, o.rollback, o.error_name or "ok") for o in outcomes][2:] == [
        ("restore", False, "CUDA_ERROR_OUT_OF_MEMORY"),
        ("restore", True, "ok"),
        ("unlock", True, "ok"),
    ]
    assert fake.placement() == [0, 1] and fake.state() == ProcessState.RUNNING
    # Rolled back on the source: the copy on GPU 1 maps back from there over the peer mapping.
    _C.map_imported(staged, 0)
    assert_contents(contents)


def test_primitives_refuse_to_run_while_the_process_is_locked(fake: FakeDriver, allocator: Allocator) -> None:
    make_segments(allocator, [2 * MiB])
    _C.lock(PID, 0)
    try:
        err = driver_error(_C.stage_segments_to_device, 1)
        # The real driver hangs here (fact `locked-process-blocks-cuda`).
        assert err.error_name == "CUDA_ERROR_ILLEGAL_STATE"
        assert fake.deadlocks() >= 1
    finally:
        _C.unlock(PID)


STAGE_FAILURES = [
    # (function, nth call that fails) with two segments on device 0
    ("cuDevicePrimaryCtxRetain", 1),
    ("cuCtxSynchronize", 1),
    ("cuStreamCreate", 1),
    ("cuMemCreate", 2),
    ("cuMemExportToShareableHandle", 2),
    ("cuMemAddressReserve", 2),
    ("cuMemMap", 2),
    ("cuMemSetAccess", 2),
    ("cuMemcpyDtoDAsync", 2),
    ("cuStreamSynchronize", 1),
    ("cuMemUnmap", 2),
    ("cuMemAddressFree", 1),
    ("cuMemRelease", 2),
]


@pytest.mark.parametrize("function,nth", STAGE_FAILURES, ids=[f for f, _ in STAGE_FAILURES])
def test_a_failed_stage_raises_and_undoes_every_copy(
    fake: FakeDriver, allocator: Allocator, function: str, nth: int
) -> None:
    contents = make_segments(allocator, [2 * MiB, 4 * MiB])
    fds_before = open_fds()
    fake.fail(function, "CUDA_ERROR_UNKNOWN", nth=nth)
    err = driver_error(_C.stage_segments_to_device, 1)
    assert err.call == function and err.error_name == "CUDA_ERROR_UNKNOWN"
    assert f"{function} failed: CUDA_ERROR_UNKNOWN" in str(err)
    assert fake.pending_failures() == 0
    assert open_fds() == fds_before
    assert fake.vmm_bytes_on(1) == 0 and fake.vmm_allocations() == 2
    assert fake.vmm_handles() == 2 and fake.vmm_mappings() == 2 and fake.vmm_reservations() == 2
    assert fake.live_streams() == 0 and fake.primary_ctx_refcount(0) == fake.primary_ctx_refcount(1) == 0
    assert_contents(contents)
    staged = _C.stage_segments_to_device(1)  # nothing left behind blocks a retry
    assert len(staged) == 2
    for entry in staged:
        os.close(entry.fd)


def test_release_stops_at_a_failure_and_the_registry_stays_truthful(fake: FakeDriver, allocator: Allocator) -> None:
    make_segments(allocator, [2 * MiB, 2 * MiB, 2 * MiB])
    fake.fail("cuMemUnmap", "CUDA_ERROR_UNKNOWN", nth=2)
    err = driver_error(_C.release_source_backing)
    assert err.call == "cuMemUnmap"
    assert fake.vmm_mappings() == 2 and fake.vmm_handles() == 2  # the first one went
    assert _C.release_source_backing() == 2  # the retry does the two still backed
    assert fake.vmm_mappings() == 0 and fake.vmm_handles() == 0 and fake.vmm_bytes_on(0) == 0
    fake.fail("cuCtxSynchronize", "CUDA_ERROR_UNKNOWN")
    assert driver_error(_C.release_source_backing).call == "cuCtxSynchronize"
    assert _C.release_source_backing() == 0


@pytest.mark.parametrize("function", ["cuMemImportFromShareableHandle", "cuMemMap", "cuMemSetAccess"])
def test_a_failed_import_keeps_the_fds_not_mapped(fake: FakeDriver, allocator: Allocator, function: str) -> None:
    contents = make_segments(allocator, [2 * MiB, 4 * MiB, 2 * MiB])
    staged = _C.stage_segments_to_device(1)
    _C.release_source_backing()
    fake.fail(function, "CUDA_ERROR_UNKNOWN", nth=2)
    err = driver_error(_C.map_imported, staged, 1)
    assert err.call == function
    assert not is_open(staged[0].fd) and is_open(staged[1].fd) and is_open(staged[2].fd)
    assert fake.vmm_mappings() == 1 and fake.vmm_handles() == 1
    assert fake.vmm_bytes_on(1) == 8 * MiB  # nothing lost: the fds still hold the rest
    _C.map_imported(staged[1:], 1)
    assert_contents(contents)
    assert not any(is_open(s.fd) for s in staged)


def test_map_imported_checks_the_whole_list_first(fake: FakeDriver, allocator: Allocator) -> None:
    contents = make_segments(allocator, [2 * MiB, 4 * MiB])
    staged = _C.stage_segments_to_device(1)
    first, second = staged
    a0, s0, f0 = first.address, first.size, first.fd
    a1, s1, f1 = second.address, second.size, second.fd
    with pytest.raises(ValueError, match="is still mapped"):
        _C.map_imported(staged, 1)
    _C.release_source_backing()
    bad_lists = {
        "is not a segment": [first, _C.StagedSegment(a1 + 2 * MiB, s1, f1)],
        "does not have the staged size": [first, _C.StagedSegment(address=a1, size=s0, fd=f1)],
        "is listed twice": [first, _C.StagedSegment(a0, s0, f1)],
        "comes with no fd": [first, _C.StagedSegment(a1, s1, -1)],
    }
    for message, entries in bad_lists.items():
        with pytest.raises(ValueError, match=message):
            _C.map_imported(entries, 1)
    assert is_open(f0) and is_open(f1) and fake.vmm_mappings() == 0
    _C.map_imported(staged, 1)
    assert_contents(contents)


def test_stage_without_backing_is_refused(fake: FakeDriver, allocator: Allocator) -> None:
    make_segments(allocator, [2 * MiB])
    _C.release_source_backing()
    with pytest.raises(ValueError, match="has no backing to stage"):
        _C.stage_segments_to_device(1)
    with pytest.raises(ValueError, match="has no backing to stage"):
        _C.stage_segments_to_host()


def test_free_during_the_window_frees_only_the_address(fake: FakeDriver, allocator: Allocator) -> None:
    contents = make_segments(allocator, [2 * MiB, 2 * MiB])
    gone, kept = sorted(contents)
    staged = _C.stage_segments_to_device(1)
    _C.release_source_backing()
    error_before = allocator.last_error()
    allocator.free(gone)
    assert allocator.last_error() == error_before  # no step failed: only the address range went
    assert fake.vmm_reservations() == 1
    with pytest.raises(ValueError, match="is not a segment"):
        _C.map_imported(staged, 1)
    _C.map_imported([s for s in staged if s.address == kept], 1)
    os.close([s for s in staged if s.address == gone][0].fd)
    assert_contents({kept: contents[kept]})
