"""The fast pause's host side in this process (csrc/vmm_host_staging.cpp, vmm_host_copies.cpp)
against the fake driver: host staging reserved and pinned ahead, the segments' live ranges staged
there and back across a pause, every failure leaving nothing pinned; and imported memory made the
job's own, a slice at a time."""

from __future__ import annotations

import os
import threading
import time

import pytest

from flexium import _C
from support.fake_driver import FakeDriver
from support.fast_path import staging_mapped_in
from support.vmm import (  # noqa: F401  (fixtures)
    NO_LEAKS,
    PID,
    Allocator,
    MiB,
    allocator,
    assert_contents,
    driver,
    driver_error,
    fake,
    make_segments,
    read,
    segments,
)

# ----------------------------------------------------------------------------- pause through host memory


def test_own_imported_stops_after_max_bytes(fake: FakeDriver, allocator: Allocator) -> None:
    contents = make_segments(allocator, [2 * MiB, 4 * MiB, 6 * MiB])
    staged = _C.stage_segments_to_device(1)
    _C.release_source_backing()
    _C.map_imported(staged, 1)
    assert _C.vmm_imported_count() == 3
    # Whole segments in address order, at least one, until max_bytes are replaced.
    assert _C.own_imported(1, {}, 1) in (2 * MiB, 4 * MiB, 6 * MiB)
    assert _C.vmm_imported_count() == 2
    rest = _C.own_imported(1, {}, 64 * MiB)
    assert _C.vmm_imported_count() == 0 and rest > 0
    assert_contents(contents)


def test_host_staging_round_trip_across_a_pause(fake: FakeDriver, allocator: Allocator) -> None:
    contents = make_segments(allocator, [2 * MiB, 4 * MiB, 6 * MiB])
    # Chunks of 3 MiB: segments straddle chunk boundaries.
    assert _C.stage_segments_to_host(chunk_bytes=3 * MiB) == 12 * MiB
    assert _C.host_staged_segments() == 3
    assert _C.host_staging_pool_bytes() == 12 * MiB
    # Every chunk was unpinned once its copies were done: the checkpoint sees no pinned memory.
    assert fake.pinned_bytes() == 0 and _C.host_staging_pinned_bytes() == 0
    assert fake.call_count("cuMemHostRegister") == fake.call_count("cuMemHostUnregister") == 4
    assert _C.release_source_backing() == 3
    assert fake.vmm_bytes_on(0) == 0
    _C.lock(PID, 0)
    _C.checkpoint(PID)
    assert fake.pinned_at_last_checkpoint() == 0
    assert fake.used_bytes(0) == 0 and fake.used_bytes(1) == 0  # a pause leaves nothing of ours
    _C.restore(PID)
    _C.unlock(PID)
    assert _C.restore_segments_from_host() == 12 * MiB
    assert_contents(contents)
    assert _C.host_staged_segments() == 0 and fake.pinned_bytes() == 0
    assert fake.vmm_bytes_on(0) == 12 * MiB and fake.live_streams() == 0 and fake.live_events() == 0
    assert fake.primary_ctx_refcount(0) == 0

    # A second pause reuses the staging; resuming on another device works too.
    assert _C.stage_segments_to_host(chunk_bytes=3 * MiB) == 12 * MiB
    assert _C.host_staging_pool_bytes() == 12 * MiB
    _C.release_source_backing()
    assert _C.restore_segments_from_host(1) == 12 * MiB
    assert_contents(contents)
    assert _C.vmm_bytes_on(1) == 12 * MiB and fake.vmm_bytes_on(1) == 12 * MiB and fake.vmm_bytes_on(0) == 0
    assert _C.release_host_staging() == 12 * MiB
    assert fake.pinned_bytes() == 0 and _C.host_staging_pool_bytes() == 0
    for address in contents:
        allocator.free(address)
    assert fake.vmm_leaks() == NO_LEAKS


def test_reserve_pins_ahead_and_the_stage_unpins(fake: FakeDriver, allocator: Allocator) -> None:
    contents = make_segments(allocator, [4 * MiB, 8 * MiB])
    assert _C.reserve_host_staging(12 * MiB, 0, chunk_bytes=4 * MiB) == 12 * MiB
    assert fake.pinned_bytes() == _C.host_staging_pinned_bytes() == 12 * MiB
    assert fake.primary_ctx_refcount(0) == 0  # the context was only borrowed
    assert _C.reserve_host_staging(12 * MiB, 0, chunk_bytes=4 * MiB) == 0  # nothing left to do
    assert _C.stage_segments_to_host(chunk_bytes=4 * MiB) == 12 * MiB
    assert fake.pinned_bytes() == 0
    # Pinned ahead, so the stage pinned nothing itself.
    assert fake.call_count("cuMemHostRegister") == 3
    _C.release_source_backing()
    assert _C.restore_segments_from_host() == 12 * MiB
    assert_contents(contents)
    # The next reserve pins the kept staging again without mapping more.
    assert _C.reserve_host_staging(8 * MiB, 0, chunk_bytes=4 * MiB) == 8 * MiB
    assert _C.host_staging_pool_bytes() == 12 * MiB and fake.pinned_bytes() == 8 * MiB
    assert _C.release_host_staging() == 12 * MiB
    assert fake.pinned_bytes() == 0


def test_the_stage_grows_the_staging_when_the_pool_outgrew_the_reserve(fake: FakeDriver, allocator: Allocator) -> None:
    contents = make_segments(allocator, [2 * MiB, 8 * MiB])
    _C.reserve_host_staging(2 * MiB, 0, chunk_bytes=2 * MiB)
    assert _C.stage_segments_to_host(chunk_bytes=2 * MiB) == 10 * MiB
    assert _C.host_staging_pool_bytes() == 10 * MiB and fake.pinned_bytes() == 0
    _C.release_source_backing()
    assert _C.restore_segments_from_host() == 10 * MiB
    assert_contents(contents)


def test_host_staging_copies_only_live_ranges(fake: FakeDriver, allocator: Allocator) -> None:
    contents = make_segments(allocator, [4 * MiB, 2 * MiB])
    partial, whole = sorted(contents, key=lambda address: -len(contents[address]))
    live = {partial: [(0, MiB), (3 * MiB, 512 << 10), (MiB, 0)]}
    assert _C.stage_segments_to_host(live) == MiB + (512 << 10) + 2 * MiB
    assert _C.host_staging_pool_bytes() == 4 * MiB  # what the live bytes need, in whole huge pages
    _C.release_source_backing()
    assert _C.restore_segments_from_host() == MiB + (512 << 10) + 2 * MiB
    data = contents[partial]
    assert read(partial, MiB) == data[:MiB]
    assert read(partial + 3 * MiB, 512 << 10) == data[3 * MiB : 3 * MiB + (512 << 10)]
    assert_contents({whole: contents[whole]})
    with pytest.raises(ValueError, match="lies outside"):
        _C.stage_segments_to_host({whole: [(MiB, 2 * MiB)]})
    assert _C.host_staged_segments() == 0


def test_staging_twice_or_releasing_a_full_pool_is_refused(fake: FakeDriver, allocator: Allocator) -> None:
    contents = make_segments(allocator, [2 * MiB])
    _C.stage_segments_to_host(chunk_bytes=MiB)
    with pytest.raises(RuntimeError, match="still staged on the host"):
        _C.stage_segments_to_host()
    with pytest.raises(RuntimeError, match="still staged on the host"):
        _C.release_host_staging()
    with pytest.raises(RuntimeError, match="still staged on the host"):
        _C.reserve_host_staging(2 * MiB, 0)
    with pytest.raises(ValueError, match="chunk_bytes"):
        _C.stage_segments_to_host(chunk_bytes=0)
    with pytest.raises(ValueError, match="multiple of 4096"):
        _C.reserve_host_staging(2 * MiB, 0, chunk_bytes=1000)
    # Never released (the pause was called off): restoring only drops the stash.
    assert _C.restore_segments_from_host() == 0
    assert _C.host_staged_segments() == 0
    assert_contents(contents)


STAGE_FAILURES = [
    ("cuMemHostRegister", 2),
    ("cuCtxSynchronize", 1),
    ("cuMemcpyDtoHAsync", 3),
    ("cuEventRecord", 2),
    ("cuEventSynchronize", 1),
    ("cuMemHostUnregister", 2),
    ("cuStreamSynchronize", 1),
]


@pytest.mark.parametrize("function,nth", STAGE_FAILURES, ids=[f for f, _ in STAGE_FAILURES])
def test_a_failed_host_stage_stages_nothing_and_leaves_nothing_pinned(
    fake: FakeDriver, allocator: Allocator, function: str, nth: int
) -> None:
    contents = make_segments(allocator, [2 * MiB, 4 * MiB])
    fake.fail(function, "CUDA_ERROR_UNKNOWN", nth=nth)
    err = driver_error(_C.stage_segments_to_host, chunk_bytes=2 * MiB)
    assert err.call == function
    assert _C.host_staged_segments() == 0 and fake.live_streams() == 0 and fake.live_events() == 0
    assert fake.pinned_bytes() == 0, "a failed stage left host memory pinned for the next checkpoint"
    assert fake.vmm_mappings() == 2
    assert_contents(contents)
    assert _C.stage_segments_to_host(chunk_bytes=2 * MiB) == 6 * MiB  # the retry


def test_a_failed_reserve_leaves_nothing_pinned(fake: FakeDriver) -> None:
    fake.fail("cuMemHostRegister", "CUDA_ERROR_OUT_OF_MEMORY", nth=3)
    err = driver_error(_C.reserve_host_staging, 8 * MiB, 0, chunk_bytes=2 * MiB)
    assert err.call == "cuMemHostRegister"
    assert fake.pinned_bytes() == 0 and fake.primary_ctx_refcount(0) == 0
    assert _C.reserve_host_staging(8 * MiB, 0, chunk_bytes=2 * MiB) == 8 * MiB


# Device 0's two segments come back first (one call each, 3 copies of 2 MiB pieces in 2 chunks
# pinned one by one, a synchronize and the stream's own at its end); device 1's group starts on a
# chunk of its own, and the nth call is the first of that group.
RESTORE_FAILURES = [
    ("cuMemCreate", 3),
    ("cuMemMap", 3),
    ("cuMemSetAccess", 3),
    ("cuMemcpyHtoDAsync", 4),
    ("cuMemHostRegister", 3),
    ("cuEventSynchronize", 3),
    ("cuStreamSynchronize", 3),
]


@pytest.mark.parametrize("function,nth", RESTORE_FAILURES, ids=[f for f, _ in RESTORE_FAILURES])
def test_a_failed_restore_from_host_can_be_retried(
    fake: FakeDriver, allocator: Allocator, function: str, nth: int
) -> None:
    contents = make_segments(allocator, [2 * MiB, 4 * MiB], device=0)
    contents.update(make_segments(allocator, [6 * MiB], device=1))
    _C.stage_segments_to_host(chunk_bytes=4 * MiB)
    _C.release_source_backing()
    fake.fail(function, "CUDA_ERROR_OUT_OF_MEMORY", nth=nth)
    err = driver_error(_C.restore_segments_from_host)
    assert err.call == function and err.error_name == "CUDA_ERROR_OUT_OF_MEMORY"
    assert _C.host_staged_segments() == 1
    assert fake.vmm_bytes_on(0) == 6 * MiB and fake.vmm_bytes_on(1) == 0 and fake.vmm_mappings() == 2
    assert fake.live_streams() == 0 and fake.live_events() == 0 and fake.pinned_bytes() == 0
    assert _C.restore_segments_from_host() == 6 * MiB
    assert_contents(contents)
    assert sorted(s.device for s in _C.vmm_segments()) == [0, 0, 1]


def test_host_staging_of_nothing(fake: FakeDriver) -> None:
    assert _C.stage_segments_to_host() == 0
    assert _C.restore_segments_from_host() == 0
    assert _C.stage_segments_to_device(1) == []
    assert _C.release_source_backing() == 0
    _C.map_imported([], 0)
    assert fake.pinned_bytes() == 0


def staging_fds() -> int:
    """This process's open fds of the host staging's memfds."""
    found = 0
    for fd in os.listdir("/proc/self/fd"):
        try:
            found += "memfd:flexium-host-staging" in os.readlink(f"/proc/self/fd/{fd}")
        except OSError:
            pass  # the fd the listing itself used
    return found


def release_timed(hurried: bool) -> float:
    """A staging of 256 chunks of 64 KiB, touched and pinned, given back with or without hurry; its seconds."""
    _C.reserve_host_staging(16 * MiB, 0, chunk_bytes=64 << 10)
    assert staging_mapped_in(os.getpid()) == 16 * MiB and staging_fds() > 0
    _C.set_host_release_hurried(hurried)
    try:
        started = time.perf_counter()
        assert _C.release_host_staging() == 16 * MiB
        seconds = time.perf_counter() - started
    finally:
        _C.set_host_release_hurried(False)
    assert staging_mapped_in(os.getpid()) == 0 and staging_fds() == 0 and _C.host_staging_pool_bytes() == 0
    return seconds


def test_a_hurried_release_gives_everything_back_without_the_breaks_that_spare_training(fake: FakeDriver) -> None:
    """Not hurried, the release drops the staging a chunk at a time with a 1 ms break between chunks
    (fact `staging-unmapped-in-chunks`); hurried (a pause waits for the room), it drops the rest at once,
    a thread per file. Either way nothing is left mapped or open."""
    spared = release_timed(hurried=False)
    hurried = release_timed(hurried=True)
    assert spared >= 0.255, spared  # 255 breaks of 1 ms
    assert hurried < spared / 2, (hurried, spared)


def test_a_hurry_that_comes_during_the_release_ends_it_at_once(fake: FakeDriver) -> None:
    """The hurry is read as the release goes: set from another thread (a pause that waits for the room)
    while the release takes its breaks, it drops what is left at once."""
    _C.reserve_host_staging(64 * MiB, 0, chunk_bytes=64 << 10)
    assert staging_mapped_in(os.getpid()) == 64 * MiB
    timer = threading.Timer(0.1, _C.set_host_release_hurried, args=(True,))
    timer.start()
    try:
        started = time.perf_counter()
        assert _C.release_host_staging() == 64 * MiB
        seconds = time.perf_counter() - started
    finally:
        timer.join()
        _C.set_host_release_hurried(False)
    assert seconds < 0.5, seconds  # unhurried, its 1023 breaks alone would take over a second
    assert staging_mapped_in(os.getpid()) == 0 and staging_fds() == 0
