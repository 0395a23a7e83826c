"""A pause on the fast path over the fake driver: the pool's segments staged to host memory and back
on a resume in place or on another GPU, a copy back that finds no room, the failures rolled back,
and a pause that ends on the driver path checked for its host memory."""

from __future__ import annotations

import re

import pytest

torch = pytest.importorskip("torch")

from flexium import _C  # noqa: E402
from flexium.engine import EngineState  # noqa: E402
from flexium.errors import (  # noqa: E402
    OperationFailedError,
    RollbackFailedError,
    TargetRefusedError,
)
from support.engine import (  # noqa: E402,F401  (fixtures)
    H200_BYTES,
    GiB,
    HostMemory,
    MiB,
    driver,
    fake,
    host_memory,
    make_engine,
    nvml_in_parent,
    step_summary,
    wait_until,
)
from support.fake_driver import ProcessState  # noqa: E402
from support.fast_path import (  # noqa: E402,F401  (fixtures)
    CUDA_ERROR_UNKNOWN,
    FAST_PAUSE,
    Job,
    copier_processes,
    failure,
    job,
    names,
    open_fds,
    rolled_back,
)

# ----------------------------------------------------------------------------- pause / resume


def test_fast_pause_and_resume_in_place_and_on_another_gpu(job: Job) -> None:
    fake = job.fake
    engine = job.training([2 * MiB, 4 * MiB, 6 * MiB])
    fds = open_fds()

    paused = engine.pause()
    assert paused.ok and paused.path == "fast" and names(paused) == FAST_PAUSE
    pin_note, copy_note = paused.notes
    # Nothing kept for it: the staging is made at the safe point, with the job stopped (stop first).
    assert re.match(r"made the host staging by the copier process \d+ at the safe point in ", pin_note), pin_note
    assert "0.01 GiB of it newly mapped" in pin_note
    assert copy_note == "fast path: copied 0.01 GiB in use of 0.01 GiB of pool segments to host memory"
    assert engine.state == EngineState.PAUSED and fake.state() == ProcessState.CHECKPOINTED
    assert [fake.process_bytes_on(g) for g in (0, 1)] == [0, 0] and fake.vmm_bytes_on(0) == 0
    # Room for an eighth more than the pool held (12 MiB), in whole huge pages: 14 MiB.
    assert _C.host_staged_segments() == 3 and _C.host_staging_pool_bytes() == 14 * MiB
    # Pinned by the copier process as its copies reached each chunk: never in this one.
    assert fake.pinned_at_last_checkpoint() == 0 and fake.call_count("cuMemHostRegister") == 0
    assert [s.mapped for s in _C.vmm_segments()] == [False] * 3

    resumed = engine.resume()
    assert resumed.ok and resumed.path == "fast" and names(resumed) == ["restore", "unlock", "copy_back", "verify"]
    assert engine.state == EngineState.RUNNING and fake.placement() == [0, 1]
    job.assert_home(physical=0)
    assert _C.host_staged_segments() == 0
    # The staging goes back to the host in the background; the copier stays, asleep, for the next pause.
    wait_until(
        lambda: _C.host_staging_pool_bytes() == 0 and open_fds() == fds, what="the host staging to be given back"
    )
    assert len(copier_processes()) == 1
    assert fake.pinned_bytes() == 0

    again = engine.pause()  # mapped, touched and pinned again
    assert again.ok and again.path == "fast" and again.notes[0].startswith("made the host staging by the copier")
    assert fake.pinned_bytes() == 0 and fake.pinned_at_last_checkpoint() == 0
    elsewhere = engine.resume(target=engine.gpus[1])
    assert elsewhere.ok and elsewhere.path == "fast" and elsewhere.target.device == "cuda:1"
    assert names(elsewhere) == ["restore", "unlock", "copy_back", "verify"]
    assert fake.placement() == [1, 0] and engine.placement()[1].device == "cuda:1"
    job.assert_home(physical=1)


def test_a_resume_with_room_for_the_job_but_not_the_copier_copies_back_in_this_process(job: Job) -> None:
    """The copier's context would take room the restore needs (a restore without room loses the job,
    fact `restore-without-room-loses-process`): it sleeps on, and this process copies back."""
    fake = job.fake
    fake.set_process_memory(0, 256 * MiB)  # what the driver restores; the pool comes back by copies
    engine = job.training([2 * MiB, 4 * MiB, 6 * MiB])
    paused = engine.pause()
    assert paused.ok and paused.path == "fast"
    # Beside another process the restore's 256 MiB get 512 MiB of headroom: 600 MiB more than the job
    # held are enough, but not with the copier's context as well.
    fake.set_other_memory(0, H200_BYTES - paused.bytes_moved - 600 * MiB)
    resumed = engine.resume()
    assert resumed.ok and resumed.path == "fast" and names(resumed) == ["restore", "unlock", "copy_back", "verify"]
    coming = paused.bytes_moved >> 20
    assert resumed.notes[-1] == (
        f"the copies to and from host memory ran in this process: the GPU has {coming + 600} MiB free, less than "
        f"the {coming + 1030} MiB the copier's context needs beside the {coming} MiB the job comes back with"
    )
    job.assert_home(physical=0)
    assert len(copier_processes()) == 1  # asleep, for the next pause
    # With room again, the copier copies back as before.
    fake.set_other_memory(0, 0)
    assert engine.pause().ok
    again = engine.resume()
    assert again.ok and not any(n.startswith("the copies to and from host memory ran in this") for n in again.notes)
    job.assert_home(physical=0)


def test_a_copy_back_that_finds_no_room_pauses_the_job_again(job: Job, monkeypatch: pytest.MonkeyPatch) -> None:
    """Another process takes the GPU after the room check: the restore (a small image after a fast
    pause) fits, the pool's memory does not, neither where the copier makes it beside the restore nor
    here after it. The driver checkpoints the job again and it stays paused, on the GPU it was resumed
    on, its memory in host memory; later it resumes."""
    fake = job.fake
    monkeypatch.setenv("FAKE_CUDA_FAIL", "cuMemCreate:2")  # CUDA_ERROR_OUT_OF_MEMORY in the copier's, from its start
    engine = job.training([2 * MiB, 4 * MiB, 6 * MiB])
    assert engine.pause().ok
    fake.fail("cuMemCreate", "CUDA_ERROR_OUT_OF_MEMORY", nth=0)
    error = failure(lambda: engine.resume(target=engine.gpus[1]))
    assert not isinstance(error, RollbackFailedError) and error.step == "copy_back"
    assert names(error.result) == ["restore", "unlock", "copy_back", "lock", "checkpoint", "copier_sleep"]
    assert "CUDA_ERROR_OUT_OF_MEMORY" in str(error)
    assert str(error).endswith(
        "another process took memory on cuda:1 after the room check; the job is paused again, its memory in host "
        f"memory: free {error.result.bytes_moved / GiB:.2f} GiB there and resume it, or resume it on another GPU"
    )
    assert engine.state == EngineState.PAUSED and fake.state() == ProcessState.CHECKPOINTED
    assert _C.host_staged_segments() == 3 and fake.vmm_bytes_on(1) == 0
    assert engine.placement()[1].device == "cuda:1"
    fake.clear_failures()
    resumed = engine.resume()
    assert resumed.ok and resumed.path == "fast"
    job.assert_home(physical=1)


def test_a_pause_that_ends_on_the_driver_path_gives_the_staging_back_first(job: Job) -> None:
    fake = job.fake
    job.segments([2 * MiB, 4 * MiB])
    engine = job.engine()
    paused = engine.pause()  # staging pinned, then no optimizer step comes: the driver path
    assert paused.ok and paused.path == "driver", paused.notes
    assert fake.pinned_at_last_checkpoint() == 0 and _C.host_staging_pool_bytes() == 0
    # The copier pinned the staging and let it go before the checkpoint; it waits, asleep.
    assert len(copier_processes()) == 1 and fake.call_count("cuMemHostRegister") == 0
    assert engine.resume().ok
    job.assert_home(physical=0)


PAUSE_FAILURES = {
    # stage_to_host unmaps nothing: the release's 2nd unmap fails, after the 1st segment went.
    "release": (("cuMemUnmap", 2), [("release", False, False)]),
    "checkpoint": (
        ("cuCheckpointProcessCheckpoint", 1),
        [("release", True, False), ("lock", True, False), ("checkpoint", False, False), ("unlock", True, True)],
    ),
}


@pytest.mark.parametrize("step", PAUSE_FAILURES)
def test_a_failed_fast_pause_is_rolled_back(job: Job, step: str) -> None:
    (call, nth), summary = PAUSE_FAILURES[step]
    job.segments([2 * MiB, 4 * MiB, 2 * MiB])
    engine = job.engine()
    trainer = job.train()
    fds = open_fds()
    job.fake.fail(call, "CUDA_ERROR_UNKNOWN", nth=nth)
    error = failure(engine.pause)
    result = rolled_back(job, engine, error, step, fds)
    assert step_summary(result) == [
        ("prepare", True, False),
        ("checksum", True, False),
        ("copy", True, False),
        *summary,
        ("rollback_copy", True, True),
    ]
    assert f"{call}" in result.error
    assert _C.host_staged_segments() == 0
    steps = trainer.steps
    wait_until(lambda: trainer.steps > steps, what="training to go on")  # not parked
    assert engine.pause().ok and engine.resume().ok  # the next pause goes through
    job.assert_home(physical=0)


def test_a_failed_restore_keeps_a_fast_pause_and_a_failed_copy_back_fails_the_job(
    job: Job, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("FLEXIUM_HOST_COPIER", "0")  # the copies run here, where the fake fails them
    fake = job.fake
    engine = job.training([2 * MiB, 4 * MiB])
    assert engine.pause().ok

    # The restore is refused for its arguments: still paused, the segments still wait in host memory.
    fake.fail("cuCheckpointProcessRestore", "CUDA_ERROR_INVALID_VALUE")
    error = failure(engine.resume)
    assert error.step == "restore" and error.result.path == "fast" and "still paused" in str(error)
    assert engine.state == EngineState.PAUSED and _C.host_staged_segments() == 2

    # The restore works, the copy back fails twice: the job cannot run.
    fake.fail("cuMemcpyHtoDAsync", "CUDA_ERROR_UNKNOWN", nth=0)
    error = failure(engine.resume, RollbackFailedError)
    assert error.step == "copy_back"
    assert names(error.result) == ["restore", "unlock", "copy_back", "copy_back"]
    assert error.result.error.endswith(
        "ROLLBACK FAILED: the job runs on cuda:0 but part of its memory is still in host memory; restart the job"
    )
    assert engine.state == EngineState.FAILED and fake.state() == ProcessState.RUNNING
    assert _C.host_staged_segments() == 2 and fake.vmm_bytes_on(0) == 0  # nothing half made stays
    # Nothing is lost: the host copies come back once the driver lets them.
    fake.clear_failures()
    assert _C.restore_segments_from_host(0) == job.total
    job.assert_home(physical=0)


# ----------------------------------------------------------------------------- host memory


def test_a_pause_that_ends_on_the_driver_path_is_checked_for_its_host_memory(job: Job, host_memory: HostMemory) -> None:
    job.segments([2 * MiB])
    job.fake.set_process_memory(0, 8 * GiB)  # outside the pool: only the checkpoint can carry it
    host_memory.available = 3 * GiB
    engine = job.engine()
    with pytest.raises(TargetRefusedError, match="pausing needs 9.00 GiB of host memory"):
        engine.pause(path="driver")
    # No optimizer step comes: "auto" ends on the driver path too, whose checkpoint needs the
    # same 8 GiB of host memory, and is refused as well.
    with pytest.raises((TargetRefusedError, OperationFailedError)):
        engine.pause()
    assert engine.state == EngineState.RUNNING
