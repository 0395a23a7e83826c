"""Every fast move proves itself, over the fake driver: a bit flipped by a copy (the fake's
corrupt_copy) is caught by the checksums before the job goes on. A migration moves nothing and the
job trains on where it was; a copy back is made again from the staging, and a job whose bytes do not
come back right twice is paused again, resumable; with the checksum switched off the moves say so."""

from __future__ import annotations

import pytest

torch = pytest.importorskip("torch")

from flexium import _C  # noqa: E402
from flexium.engine import EngineState  # noqa: E402
from flexium.engine.fast import checksum  # noqa: E402
from support.engine import (  # noqa: E402,F401  (fixtures)
    MiB,
    driver,
    fake,
    make_engine,
    nvml_in_parent,
    wait_until,
)
from support.fake_driver import ProcessState  # noqa: E402
from support.fast_path import (  # noqa: E402,F401  (fixtures)
    FAST_MIGRATION,
    FAST_PAUSE,
    FAST_RESUME,
    Job,
    failure,
    job,
    names,
    open_fds,
)


def test_a_copy_corrupted_on_its_way_to_the_other_gpu_moves_nothing(job: Job) -> None:
    engine = job.training([2 * MiB, 4 * MiB, 2 * MiB])
    fds = open_fds()
    job.fake.corrupt_copy("cuMemcpyDtoDAsync", 2)  # the second segment's copy
    error = failure(lambda: engine.migrate(engine.gpus[1]))
    result = error.result
    assert error.step == "verify" and result.failed_step == "verify" and result.path == "fast"
    assert names(result) == ["prepare", "checksum", "copy", "verify"]
    second = sorted(job.contents)[1]
    assert result.error.startswith(
        f"phase 'verify' failed: ChecksumMismatch: the moved bytes do not match: segment {second:#x} summed 0x"
    )
    assert result.error.endswith(f"nothing moved: the job runs on cuda:0 as before. {checksum.ADVICE}")
    assert engine.state == EngineState.RUNNING and job.fake.state() == ProcessState.RUNNING
    assert job.fake.call_count("cuCheckpointProcessLock") == 0  # nothing was released or checkpointed
    job.assert_home(physical=0)  # bit for bit, the copies gone
    wait_until(lambda: open_fds() == fds, what="the copies' fds to close")
    again = engine.migrate(engine.gpus[1])
    assert again.ok and names(again) == FAST_MIGRATION
    job.assert_home(physical=1)


def test_a_copy_back_corrupted_once_is_made_again_from_the_staging(job: Job, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("FLEXIUM_HOST_COPIER", "0")  # the copies run here, where the fake corrupts them
    engine = job.training([2 * MiB, 4 * MiB])
    paused = engine.pause()
    assert paused.ok and names(paused) == FAST_PAUSE
    job.fake.corrupt_copy("cuMemcpyHtoDAsync", 1)
    resumed = engine.resume()
    assert resumed.ok and engine.state == EngineState.RUNNING
    assert [(s.step, s.ok, s.rollback) for s in resumed.steps] == [
        ("restore", True, False),
        ("unlock", True, False),
        ("copy_back", True, False),
        ("verify", False, False),
        ("release", True, True),
        ("copy_back", True, False),
        ("verify", True, False),
    ]
    job.assert_home(physical=0)
    assert _C.host_staged_segments() == 0


def test_a_copy_back_wrong_twice_pauses_the_job_again_and_it_resumes_later(
    job: Job, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("FLEXIUM_HOST_COPIER", "0")
    engine = job.training([2 * MiB, 4 * MiB])
    assert engine.pause().ok
    job.fake.corrupt_copy("cuMemcpyHtoDAsync", 1)
    job.fake.corrupt_copy("cuMemcpyHtoDAsync", 3)  # the second copy back's first copy
    error = failure(engine.resume)
    assert error.step == "verify" and engine.state == EngineState.PAUSED
    assert job.fake.state() == ProcessState.CHECKPOINTED and _C.host_staged_segments() == 2
    assert names(error.result) == [
        *["restore", "unlock", "copy_back", "verify", "release", "copy_back", "verify", "release"],
        *["lock", "checkpoint", "copier_sleep"],
    ]
    assert "the moved bytes do not match" in error.result.error
    assert error.result.error.endswith(
        "the bytes copied back from host memory differed twice from those the job paused with: the job is paused "
        "again, its memory still in host memory. Resume it again (on another GPU too); if it fails the same way, the "
        "host's memory no longer holds what the job paused with: restart the job from its last checkpoint"
    )
    assert job.fake.vmm_bytes_on(0) == 0  # nothing of the pool stays on the GPU while paused
    resumed = engine.resume()
    assert resumed.ok and names(resumed) == FAST_RESUME
    job.assert_home(physical=0)


def test_a_staging_corrupted_at_the_pause_keeps_the_job_paused(job: Job, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("FLEXIUM_HOST_COPIER", "0")
    engine = job.training([2 * MiB, 4 * MiB])
    job.fake.corrupt_copy("cuMemcpyDtoHAsync", 1)  # a byte of the staging differs from the GPU's
    assert engine.pause().ok
    for _ in range(2):  # as often as it is asked: never running on wrong bytes, never lost
        error = failure(engine.resume)
        assert error.step == "verify" and engine.state == EngineState.PAUSED
        assert job.fake.state() == ProcessState.CHECKPOINTED and _C.host_staged_segments() == 2
        assert "restart the job from its last checkpoint" in error.result.error


def test_the_copier_process_copies_are_checked_too(job: Job, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("FAKE_CUDA_CORRUPT", "cuMemcpyHtoDAsync:1")  # read by the copier process at its start
    engine = job.training([2 * MiB, 4 * MiB])
    paused = engine.pause()
    assert paused.ok and "by the copier process" in paused.notes[0]
    resumed = engine.resume()
    assert resumed.ok and names(resumed) == [*FAST_RESUME, "release", "copy_back", "verify"]
    job.assert_home(physical=0)


def test_moves_switched_off_are_not_checked_and_say_so(job: Job, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("FLEXIUM_MOVE_CHECKSUM", "0")
    engine = job.training([2 * MiB, 4 * MiB])
    note = "moves are not checksummed: FLEXIUM_MOVE_CHECKSUM=0"
    moved = engine.migrate(engine.gpus[1])
    assert moved.ok and names(moved) == [s for s in FAST_MIGRATION if s not in ("checksum", "verify")]
    assert note in moved.notes
    paused = engine.pause()
    assert paused.ok and names(paused) == [s for s in FAST_PAUSE if s != "checksum"] and note in paused.notes
    resumed = engine.resume()
    assert resumed.ok and names(resumed) == ["restore", "unlock", "copy_back"]
    assert job.fake.call_count("cuLaunchKernel") == 0
    job.assert_home(physical=1)
