"""The orders for the copier process (csrc/vmm_host_orders.cpp) and the copier's native side
(csrc/host_copier.cpp) against the fake driver."""

from __future__ import annotations

import os
import re
import time
from typing import Any

import pytest

from flexium import _C
from support.fake_driver import FakeDriver
from support.vmm import (  # noqa: F401  (fixtures)
    NO_LEAKS,
    PID,
    Allocator,
    MiB,
    allocator,
    assert_contents,
    driver,
    fake,
    is_open,
    make_segments,
    segments,
)

# ----------------------------------------------------------------------------- orders for the copier process
# The copier (csrc/host_copier.cpp) runs in its own process in flexium; here it runs in this one,
# which the fake allows: the orders and the copier meet only through fds and the staging's memfds.


def copier_for_staging() -> Any:
    layout = _C.host_staging_layout()
    return _C.HostCopier(layout.extents, layout.chunks)


def test_copier_orders_round_trip_across_a_pause(fake: FakeDriver, allocator: Allocator) -> None:
    contents = make_segments(allocator, [2 * MiB, 4 * MiB, 6 * MiB])
    assert _C.reserve_host_staging(12 * MiB, 0, chunk_bytes=4 * MiB, pin_here=False) == 0
    assert fake.pinned_bytes() == 0 and _C.host_staging_pool_bytes() == 12 * MiB
    copier = copier_for_staging()
    copier.wake(fake.uuid(0), True, 0)
    assert copier.awake and copier.pinned_bytes == 12 * MiB

    order = _C.begin_stage_order()
    assert order.bytes == 12 * MiB and len(order.segments) == 3 and sum(p.length for p in order.pieces) == order.bytes
    with pytest.raises(RuntimeError, match="already open"):
        _C.begin_stage_order()
    assert copier.copy(True, order.segments, order.pieces) == 12 * MiB
    assert _C.finish_host_order() == 12 * MiB
    assert not any(is_open(fd) for fd, _size in order.segments)  # the order closed its exported fds
    assert _C.host_staged_segments() == 3
    copier.sleep()
    assert not copier.awake and fake.pinned_bytes() == 0 and fake.primary_ctx_refcount(0) == 0

    assert _C.release_source_backing() == 3
    _C.lock(PID, 0)
    _C.checkpoint(PID)
    assert fake.used_bytes(0) == fake.used_bytes(1) == 0
    _C.restore(PID)
    _C.unlock(PID)

    order = _C.begin_restore_order(1)
    assert order.bytes == 12 * MiB
    copier.wake(fake.uuid(1), False, 0)  # pins while this thread goes on; the copy pins the rest
    assert copier.copy(False, order.segments, order.pieces) == 12 * MiB
    assert _C.finish_host_order() == 12 * MiB
    assert_contents(contents)
    assert _C.host_staged_segments() == 0 and fake.vmm_bytes_on(1) == 12 * MiB and fake.vmm_bytes_on(0) == 0
    copier.sleep()
    del copier
    assert _C.release_host_staging() == 12 * MiB
    for address in contents:
        allocator.free(address)
    assert fake.vmm_leaks() == NO_LEAKS


def test_driver_made_host_memory_carries_a_pause_held_by_its_fds_alone(fake: FakeDriver, allocator: Allocator) -> None:
    """The copier makes host memory with the driver (fact `driver-made-host-memory`) and hands its fds over; the
    staging holds them (adopt_host_memory), the copier maps the memory for the GPU instead of pinning it, and its
    sleep only unmaps it: the bytes cross the checkpoint with nothing mapped or pinned anywhere, and come back."""
    contents = make_segments(allocator, [2 * MiB, 4 * MiB])
    maker = _C.HostCopier([], [])
    with pytest.raises(RuntimeError, match="asleep"):
        maker.make_host_memory(6 * MiB, 4 * MiB)
    maker.wake(fake.uuid(0), True, 0)
    made = maker.make_host_memory(6 * MiB, 4 * MiB)
    assert [size for _fd, size in made] == [4 * MiB, 2 * MiB]
    maker.sleep()
    del maker
    assert _C.adopt_host_memory(made) == 6 * MiB
    layout = _C.host_staging_layout()
    assert layout.driver_made == [True, True] and [c.size for c in layout.chunks] == [4 * MiB, 2 * MiB]
    copier = _C.HostCopier(layout.extents, layout.chunks, layout.driver_made)
    copier.wake(fake.uuid(0), True, 0)
    assert copier.pinned_bytes == 6 * MiB and fake.pinned_bytes() == 0  # mapped, not registered

    order = _C.begin_stage_order()
    assert copier.copy(True, order.segments, order.pieces) == 6 * MiB
    _C.finish_host_order()
    copier.sleep()
    assert _C.release_source_backing() == 2
    mapped = fake.vmm_mappings()
    assert mapped == 0, mapped  # the segments released, the staging mapped nowhere: fds only
    _C.lock(PID, 0)
    _C.checkpoint(PID)
    assert fake.used_bytes(0) == 0
    _C.restore(PID)
    _C.unlock(PID)
    order = _C.begin_restore_order(1)
    copier.wake(fake.uuid(1), True, 0)
    assert copier.copy(False, order.segments, order.pieces) == 6 * MiB
    _C.finish_host_order()
    assert_contents(contents)
    copier.sleep()
    del copier
    assert _C.release_host_staging() == 6 * MiB
    assert not any(is_open(fd) for fd, _size in made)
    for address in contents:
        allocator.free(address)
    assert fake.vmm_leaks() == NO_LEAKS


def test_driver_made_memory_is_mapped_here_only_while_this_process_copies(
    fake: FakeDriver, allocator: Allocator
) -> None:
    """Without the copier the job copies itself: it maps the driver's host memory for its copies and lets go
    of it after them (a process holding it mapped cannot be restored: fact `cumem-host-memory-unrestorable`);
    memory added while segments are staged is refused and its fds closed."""
    contents = make_segments(allocator, [2 * MiB, 4 * MiB])
    maker = _C.HostCopier([], [])
    maker.wake(fake.uuid(0), True, 0)
    made = maker.make_host_memory(6 * MiB, 6 * MiB)
    more = maker.make_host_memory(2 * MiB, 2 * MiB)
    maker.sleep()
    del maker
    _C.adopt_host_memory(made)
    assert _C.stage_segments_to_host() == 6 * MiB
    assert _C.release_source_backing() == 2
    assert fake.vmm_mappings() == 0 and fake.pinned_bytes() == 0
    with pytest.raises(RuntimeError, match="still staged"):
        _C.adopt_host_memory(more)
    assert not any(is_open(fd) for fd, _size in more)
    assert _C.restore_segments_from_host(0) == 6 * MiB
    assert_contents(contents)
    assert fake.vmm_mappings() == 2  # the segments only
    assert _C.release_host_staging() == 6 * MiB
    for address in contents:
        allocator.free(address)
    assert fake.vmm_leaks() == NO_LEAKS


def test_a_staging_made_at_the_safe_point_gets_a_file_per_core(fake: FakeDriver) -> None:
    """Each file has a touching thread of its own in the copier: beside training half the cores, up
    to 8; with the job stopped at its safe point every core, up to 16 (fact `streamed-staging-pace`)."""
    cores = os.cpu_count() or 1
    files = {}
    for job_stopped in (False, True):
        _C.reserve_host_staging(4 << 30, 0, pin_here=False, job_stopped=job_stopped)  # files only: nothing touched
        files[job_stopped] = len(_C.host_staging_layout().extents)
        _C.release_host_staging()
    assert files == {False: max(1, min(8, cores // 2)), True: min(16, cores)}
    assert fake.pinned_bytes() == 0


def test_a_grown_staging_extends_the_copier_whose_pins_stay(fake: FakeDriver, allocator: Allocator) -> None:
    make_segments(allocator, [4 * MiB])
    _C.reserve_host_staging(4 * MiB, 0, chunk_bytes=2 * MiB, pin_here=False)
    before = _C.host_staging_layout()
    copier = copier_for_staging()
    copier.wake(fake.uuid(0), True, 0)
    assert copier.pinned_bytes == 4 * MiB and fake.call_count("cuMemHostRegister") == 2

    make_segments(allocator, [2 * MiB])
    _C.reserve_host_staging(6 * MiB, 0, chunk_bytes=2 * MiB, pin_here=False)  # grows: extents and chunks added
    after = _C.host_staging_layout()
    assert len(after.extents) > len(before.extents) and len(after.chunks) == 3
    copier.extend(after.extents[len(before.extents) :], after.chunks[len(before.chunks) :])
    assert copier.awake and copier.pinned_bytes == 4 * MiB  # nothing unpinned
    copier.wake(fake.uuid(0), True, 0)  # awake already: pins only the new chunk
    assert copier.pinned_bytes == 6 * MiB and fake.call_count("cuMemHostRegister") == 3
    assert fake.call_count("cuMemHostUnregister") == 0
    order = _C.begin_stage_order()
    assert copier.copy(True, order.segments, order.pieces) == 6 * MiB
    _C.finish_host_order()
    with pytest.raises(ValueError, match="lies outside the staging's extents"):
        copier.extend([], [_C.CopierChunk(extent=len(after.extents), offset=0, size=2 * MiB)])
    copier.sleep()
    assert fake.pinned_bytes() == 0


def test_after_a_copy_the_copier_pins_the_chunks_it_did_not_use(fake: FakeDriver, allocator: Allocator) -> None:
    """A copy pins only the chunks it uses; a kept staging must be whole for the next pause."""
    contents = make_segments(allocator, [2 * MiB])
    _C.reserve_host_staging(6 * MiB, 0, chunk_bytes=2 * MiB, pin_here=False)  # 3 chunks, 1 used
    copier = copier_for_staging()
    assert copier.last_pinner == ""
    copier.wake(fake.uuid(0), False, 200)  # pins one chunk, then waits: the copy stops it there
    deadline = time.monotonic() + 10
    while copier.pinned_bytes < 2 * MiB and time.monotonic() < deadline:
        time.sleep(0.01)
    order = _C.begin_stage_order()
    assert copier.copy(True, order.segments, order.pieces) == 2 * MiB
    _C.finish_host_order()
    assert copier.pinned_bytes == 2 * MiB
    assert re.fullmatch(
        r"pinned 1 chunks \(0\.00 GiB\) in \d+\.\d\d s \(the slowest \d+ ms\), stopped", copier.last_pinner
    )
    copier.pin_rest(0)
    deadline = time.monotonic() + 10
    while copier.pinned_bytes < 6 * MiB and time.monotonic() < deadline:
        time.sleep(0.01)
    assert copier.pinned_bytes == 6 * MiB
    deadline = time.monotonic() + 10
    while not copier.last_pinner.endswith("all pinned") and time.monotonic() < deadline:
        time.sleep(0.01)
    assert re.fullmatch(
        r"pinned 2 chunks \(0\.00 GiB\) in \d+\.\d\d s \(the slowest \d+ ms\), all pinned", copier.last_pinner
    )
    copier.sleep()
    with pytest.raises(RuntimeError, match="asleep"):
        copier.pin_rest(0)
    assert fake.pinned_bytes() == 0
    assert_contents(contents)


@pytest.mark.parametrize("buffer", [None, 64 << 10, 16 * MiB])
def test_a_written_staging_round_trips_and_is_then_kept_whole(
    fake: FakeDriver, allocator: Allocator, buffer: int | None
) -> None:
    """Made at the safe point to be written (csrc/host_copier_writes.cpp): the copy to host pins none of
    it and writes what the order uses through buffers of the size asked (FLEXIUM_WRITE_BUFFER, which the
    copier process sets; None: the default), each copy from the GPU filling at most one; a chunk no piece
    filled (the staging's slack) no longer waits to be written, so a kept staging is pinned whole
    afterwards, and the bytes come back intact."""
    contents = make_segments(allocator, [2 * MiB, 4 * MiB, 6 * MiB])
    _C.reserve_host_staging(16 * MiB, 0, chunk_bytes=4 * MiB, pin_here=False, job_stopped=True)
    layout = _C.host_staging_layout()
    copier = _C.HostCopier(layout.extents, layout.chunks, layout.driver_made, [True] * len(layout.extents))
    if buffer is not None:
        copier.set_write_buffer_bytes(buffer)
    copier.wake(fake.uuid(0), False, 0)  # the pinner skips what is to be written: nothing to pin
    order = _C.begin_stage_order()
    used = {piece.chunk for piece in order.pieces}
    assert len(used) < len(layout.chunks)  # a chunk left over, as at the safe point
    copies_before = fake.call_count("cuMemcpyDtoHAsync")
    assert copier.copy(True, order.segments, order.pieces) == 12 * MiB
    through = buffer or _C.default_write_buffer_bytes()
    least = sum(-(-piece.length // through) for piece in order.pieces)
    assert fake.call_count("cuMemcpyDtoHAsync") - copies_before == least
    assert copier.last_copy_times["written"] == 12 * MiB and copier.pinned_bytes == 0
    assert fake.pinned_bytes() == 0  # the copier's buffers went with the copy
    _C.finish_host_order()
    copier.sleep()
    assert _C.release_source_backing() == 3
    _C.lock(PID, 0)
    _C.checkpoint(PID)
    _C.restore(PID)
    _C.unlock(PID)

    # A kept staging's pinning: every chunk, the unwritten one too.
    back_from_a_kept_staging(fake, allocator, copier, contents, staging=16 * MiB, copied=12 * MiB)


@pytest.mark.parametrize("buffer", [0, 4096, (64 << 10) + 1, (256 << 20) + 4096])
def test_a_write_buffer_the_copier_cannot_use_is_refused(buffer: int) -> None:
    copier = _C.HostCopier([], [])
    refusal = f"a write buffer must be a multiple of 4 KiB from 64 KiB to 256 MiB, not {buffer} bytes"
    assert _C.write_buffer_refusal(buffer) == refusal
    with pytest.raises(ValueError, match=refusal):
        copier.set_write_buffer_bytes(buffer)
    assert copier.write_buffer_bytes == _C.default_write_buffer_bytes() == 1 * MiB  # unchanged: the default


def back_from_a_kept_staging(
    fake: FakeDriver, allocator: Allocator, copier: Any, contents: dict[int, bytes], *, staging: int, copied: int
) -> None:
    """A resume on GPU 1 from the staging the copier keeps, pinned whole first; the bytes come back intact,
    and then everything goes."""
    order = _C.begin_restore_order(1)
    copier.wake(fake.uuid(1), True, 0)
    assert copier.pinned_bytes == staging and copier.last_pinner.endswith("all pinned"), copier.last_pinner
    assert copier.copy(False, order.segments, order.pieces) == copied
    _C.finish_host_order()
    assert_contents(contents)
    copier.sleep()
    del copier
    _C.release_host_staging()
    for address in contents:
        allocator.free(address)
    assert fake.vmm_leaks() == NO_LEAKS


def round_trip_a_staging_being_touched(fake: FakeDriver, allocator: Allocator, *, write_untouched: bool) -> Any:
    """A young job's kept staging of memfds (64 chunks in one file, touched by the copier in the background
    from the file's start) copied to host at once, then back: returns the copy to host's times."""
    contents = make_segments(allocator, [64 * MiB, 192 * MiB])
    _C.reserve_host_staging(256 * MiB, 0, chunk_bytes=4 * MiB, pin_here=False)
    copier = copier_for_staging()  # its thread starts touching the chunks now
    copier.wake(fake.uuid(0), False, 0)
    order = _C.begin_stage_order()
    assert copier.copy(True, order.segments, order.pieces, write_untouched) == 256 * MiB
    times = copier.last_copy_times
    _C.finish_host_order()
    copier.sleep()
    assert fake.pinned_bytes() == 0
    _C.release_source_backing()
    _C.lock(PID, 0)
    _C.checkpoint(PID)
    _C.restore(PID)
    _C.unlock(PID)
    # Every chunk is mapped in by then, the written ones too: the kept staging's pinning takes all of it.
    back_from_a_kept_staging(fake, allocator, copier, contents, staging=256 * MiB, copied=256 * MiB)
    return times


def test_a_copy_to_host_writes_the_chunks_the_touching_has_not_reached(fake: FakeDriver, allocator: Allocator) -> None:
    """A pause that finds its kept staging still being touched writes the chunks the touching has not
    reached, as it writes a staging made at the safe point, and pins the rest (docs/fast-path.md, "Written at
    the safe point"); the bytes come back intact. The touching runs beside the copy, so how far it got
    differs from run to run: tried until a copy finds chunks untouched (the first, almost always)."""
    tries = []
    for _ in range(5):
        times = round_trip_a_staging_being_touched(fake, allocator, write_untouched=True)
        tries.append(times)
        if times["written"] > 0:
            break
    assert tries[-1]["written"] > 0, f"every copy found the staging touched: {tries}"
    assert tries[-1]["written"] % (4 * MiB) == 0 and tries[-1]["written"] + tries[-1]["pinned_in_copy"] <= 256 * MiB


def test_without_write_untouched_a_copy_to_host_pins_every_chunk_as_the_touching_reaches_it(
    fake: FakeDriver, allocator: Allocator
) -> None:
    """FLEXIUM_WRITTEN_STAGING=0's way: the copy waits for the touching and pins each chunk."""
    times = round_trip_a_staging_being_touched(fake, allocator, write_untouched=False)
    assert times["written"] == 0 and times["pinned_in_copy"] > 0, times


def test_an_aborted_order_leaves_everything_as_it_was(fake: FakeDriver, allocator: Allocator) -> None:
    contents = make_segments(allocator, [2 * MiB, 4 * MiB])
    _C.reserve_host_staging(6 * MiB, 0, pin_here=False)
    order = _C.begin_stage_order()
    _C.abort_host_order()
    assert not any(is_open(fd) for fd, _size in order.segments) and _C.host_staged_segments() == 0
    extra = allocator.must_alloc(2 * MiB)  # the segment lock is free again
    allocator.free(extra)

    assert _C.stage_segments_to_host() == 6 * MiB
    _C.release_source_backing()
    _C.begin_restore_order(0)
    assert fake.vmm_bytes_on(0) == 6 * MiB  # the new memory, not yet the segments'
    _C.abort_host_order()
    assert fake.vmm_bytes_on(0) == 0 and [s.mapped for s in _C.vmm_segments()] == [False, False]
    assert _C.restore_segments_from_host() == 6 * MiB  # in this process instead
    assert_contents(contents)
    _C.abort_host_order()  # none open: nothing to do


def test_a_stage_order_does_not_grow_the_staging(fake: FakeDriver, allocator: Allocator) -> None:
    contents = make_segments(allocator, [2 * MiB, 8 * MiB])
    _C.reserve_host_staging(2 * MiB, 0, chunk_bytes=2 * MiB, pin_here=False)
    with pytest.raises(ValueError, match="outgrew the host staging prepared for them"):
        _C.begin_stage_order()
    assert _C.host_staging_pool_bytes() == 2 * MiB
    assert _C.stage_segments_to_host(chunk_bytes=2 * MiB) == 10 * MiB  # this process's stage grows it
    _C.release_source_backing()
    assert _C.restore_segments_from_host() == 10 * MiB
    assert_contents(contents)


def test_memory_a_driver_restore_left_unexportable_is_owned_again(fake: FakeDriver, allocator: Allocator) -> None:
    contents = make_segments(allocator, [2 * MiB, 4 * MiB])
    _C.reserve_host_staging(6 * MiB, 0, pin_here=False)
    assert _C.vmm_mark_restored_by_driver() == 2 and _C.vmm_segments_to_own() == 2
    with pytest.raises(ValueError, match="came back from a driver checkpoint"):
        _C.begin_stage_order()
    assert _C.own_imported(0) == 6 * MiB and _C.vmm_segments_to_own() == 0
    assert_contents(contents)
    order = _C.begin_stage_order()
    assert order.bytes == 6 * MiB and len(order.segments) == 2
    _C.abort_host_order()
    # Memory a pause gives back is fresh too: nothing is left to own after a round trip in this process.
    _C.vmm_mark_restored_by_driver()
    assert _C.stage_segments_to_host() == 6 * MiB
    _C.release_source_backing()
    assert _C.restore_segments_from_host() == 6 * MiB
    assert _C.vmm_segments_to_own() == 0
    assert_contents(contents)


def test_the_copier_refuses_bad_orders(fake: FakeDriver, allocator: Allocator) -> None:
    make_segments(allocator, [2 * MiB])
    _C.reserve_host_staging(2 * MiB, 0, pin_here=False)
    copier = copier_for_staging()
    with pytest.raises(RuntimeError, match="asleep"):
        copier.copy(True, [], [])
    with pytest.raises(ValueError, match="no GPU with UUID GPU-00000000"):
        copier.wake("GPU-00000000-0000-0000-0000-000000000000", True, 0)
    copier.wake(fake.uuid(0), True, 0)
    order = _C.begin_stage_order()
    try:
        bad = [_C.CopierPiece(segment=0, segment_offset=0, chunk=0, chunk_offset=0, length=4 * MiB)]  # too long
        with pytest.raises(ValueError, match="lies outside its segment or chunk"):
            copier.copy(True, order.segments, bad)
    finally:
        _C.abort_host_order()
    with pytest.raises(ValueError, match="lies outside the staging's extents"):
        _C.HostCopier(_C.host_staging_layout().extents, [_C.CopierChunk(extent=0, offset=0, size=4 * MiB)])
    copier.sleep()
    assert fake.pinned_bytes() == 0


def test_a_wake_that_fails_leaves_the_copier_asleep(fake: FakeDriver) -> None:
    """The job takes a refused wake for a copier asleep: one that failed after it took its context lets it go."""
    copier = _C.HostCopier([], [])
    fake.fail("cuStreamCreate", "CUDA_ERROR_OUT_OF_MEMORY")
    with pytest.raises(RuntimeError, match="cuStreamCreate"):
        copier.wake(fake.uuid(0), True, 0)
    assert not copier.awake and fake.primary_ctx_refcount(0) == 0
    copier.wake(fake.uuid(0), True, 0)  # and it wakes again
    assert copier.awake
    copier.sleep()
    assert fake.primary_ctx_refcount(0) == 0


def test_a_copier_pinning_ahead_of_its_touching_goes_at_once(fake: FakeDriver) -> None:
    """Its pinner waits for chunks its touching threads have not reached: letting the copier go (the job quit or
    died) stops the pinner before the touching, which would otherwise leave it waiting minutes for a chunk."""
    fd = os.memfd_create("flexium-test-staging")
    try:
        os.ftruncate(fd, 4096 * MiB)
        chunks = [_C.CopierChunk(extent=0, offset=o, size=32 * MiB) for o in range(0, 4096 * MiB, 32 * MiB)]
        copier = _C.HostCopier([(fd, 4096 * MiB)], chunks)  # touches in the background
        copier.wake(fake.uuid(0), False, 0)  # pins as touched, no breaks: it catches up with the touching
        time.sleep(0.1)
        started = time.monotonic()
        del copier
        assert time.monotonic() - started < 5.0
    finally:
        os.close(fd)
    assert fake.primary_ctx_refcount(0) == 0
