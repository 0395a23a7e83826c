"""The copier process that runs a fast pause's copies (flexium.engine.fast.host_copier): a failing
or killed copier replaced by copies in this process without losing anything, the pool made
exportable again for it after a driver restore, and FLEXIUM_HOST_COPIER=0."""

from __future__ import annotations

import os
import signal

import pytest

torch = pytest.importorskip("torch")

from flexium import _C  # noqa: E402
from support.engine import (  # noqa: E402,F401  (fixtures)
    H200_BYTES,
    GiB,
    MiB,
    driver,
    fake,
    make_engine,
    nvml_in_parent,
    wait_until,
)
from support.fake_driver import ProcessState  # noqa: E402
from support.fast_path import (  # noqa: E402,F401  (fixtures)
    CUDA_ERROR_UNKNOWN,
    FAST_PAUSE,
    Job,
    copier_processes,
    job,
    names,
    open_fds,
    zombie,
)

# ----------------------------------------------------------------------------- the copier process

# Where the copier fails (its own fake driver, armed through the environment it starts with) ->
# the operation whose copies then run in this process instead.
COPIER_FAILURES = {
    "pin": ("cuMemHostRegister", "pause"),
    "copy_to_host": ("cuMemcpyDtoHAsync", "pause"),
    "copy_back": ("cuMemcpyHtoDAsync", "resume"),
}


@pytest.mark.parametrize("where", COPIER_FAILURES)
def test_a_failing_copier_is_replaced_by_copies_in_this_process(
    job: Job, monkeypatch: pytest.MonkeyPatch, where: str
) -> None:
    call, op = COPIER_FAILURES[where]
    monkeypatch.setenv("FAKE_CUDA_FAIL", f"{call}:{CUDA_ERROR_UNKNOWN}")  # read by the copier's fake at its start
    engine = job.training([2 * MiB, 4 * MiB, 6 * MiB])
    fds = open_fds()

    paused = engine.pause()
    assert paused.ok and paused.path == "fast" and names(paused) == FAST_PAUSE
    if op == "pause":  # the copier made the staging at the safe point; its pinning or copies failed
        assert paused.notes[0].startswith("made the host staging by the copier process")
        assert "then pinned and copied in this process" in paused.notes[0]
        assert paused.notes[-1].startswith("the copies to and from host memory ran in this process: ")
        assert call in paused.notes[-1]
    assert fake_state_paused(job)
    assert len(copier_processes()) == (0 if op == "pause" else 1)  # a failed copier is killed at once
    assert job.fake.pinned_at_last_checkpoint() == 0  # pinned here, but unpinned before the checkpoint

    resumed = engine.resume(target=engine.gpus[1])
    assert resumed.ok and resumed.path == "fast" and names(resumed) == ["restore", "unlock", "copy_back", "verify"]
    fell_back = [n for n in resumed.notes if n.startswith("the copies to and from host memory ran in this process")]
    assert len(fell_back) == (1 if op == "resume" else 0) and (op != "resume" or call in fell_back[0])
    job.assert_home(physical=1)
    # The failed copier was killed (its socket closed); a later pause starts another.
    wait_until(lambda: open_fds() == fds - 1 and copier_processes() == [], what="the copier and the staging to go")


def fake_state_paused(job: Job) -> bool:
    return job.fake.state() == ProcessState.CHECKPOINTED and _C.host_staged_segments() > 0


def test_a_copier_killed_while_the_job_is_paused_loses_nothing(job: Job) -> None:
    engine = job.training([2 * MiB, 4 * MiB, 6 * MiB])
    paused = engine.pause()
    assert paused.ok and paused.path == "fast"
    (copier,) = copier_processes()
    os.kill(copier, signal.SIGKILL)  # the staged bytes are this process's memfds: nothing goes with it
    wait_until(lambda: copier_processes() == [] or zombie(copier), what="the copier to die")

    resumed = engine.resume()
    assert resumed.ok and resumed.path == "fast"
    assert any(n.startswith("the copies to and from host memory ran in this process: ") for n in resumed.notes)
    job.assert_home(physical=0)
    again = engine.pause()  # a new copier serves the next pause
    assert again.ok and again.notes[0].startswith("made the host staging by the copier process")
    assert engine.resume().ok
    job.assert_home(physical=0)


def test_after_a_driver_restore_the_pool_is_made_exportable_again_for_the_copier(job: Job) -> None:
    engine = job.training([2 * MiB, 4 * MiB, 6 * MiB])
    assert engine.pause(path="driver").ok
    resumed = engine.resume()
    assert resumed.ok and resumed.path == "driver"
    # The driver's restore gives the segments memory it will not export; they get fresh memory of
    # the job's own at the next optimizer steps, and then the copier can import them again.
    wait_until(lambda: _C.vmm_segments_to_own() == 0, what="the restored memory to become exportable again")
    job.assert_home(physical=0)
    paused = engine.pause()
    assert paused.ok and paused.path == "fast"
    assert not any("ran in this process" in n for n in paused.notes), paused.notes
    assert engine.resume().ok
    job.assert_home(physical=0)


def test_a_pause_before_the_pool_is_exportable_again_copies_in_this_process(job: Job) -> None:
    job.segments([2 * MiB, 4 * MiB])
    engine = job.engine()  # no training thread: no optimizer step makes the memory exportable
    assert engine.pause(path="driver").ok and engine.resume().ok
    assert _C.vmm_segments_to_own() == 2
    engine._safe_points.between_operations(None)  # the slices wait, as if the pause came first
    trainer = job.train()
    paused = engine.pause()
    assert paused.ok and paused.path == "fast"
    assert any("came back from a driver checkpoint" in n for n in paused.notes), paused.notes
    assert engine.resume().ok and trainer.error is None
    job.assert_home(physical=0)


def test_copier_off_pins_and_copies_in_this_process(job: Job, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("FLEXIUM_HOST_COPIER", "0")
    engine = job.training([2 * MiB, 4 * MiB])
    paused = engine.pause()
    assert paused.ok and paused.path == "fast" and copier_processes() == []
    assert paused.notes[0].startswith("made the host staging in this process (the copier process is off")
    # Pinned here at the safe point, unpinned chunk by chunk as the copies finished.
    assert job.fake.call_count("cuMemHostRegister") > 0
    assert job.fake.pinned_at_last_checkpoint() == 0 and job.fake.pinned_bytes() == 0
    assert engine.resume().ok
    job.assert_home(physical=0)


def test_a_pause_on_a_gpu_without_room_for_the_copier_copies_here_and_keeps_the_copier(
    job: Job, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Too little room for the copier's context: the pause makes its staging and copies here, says why, and
    leaves the copier, never woken, as it was (it is not sent copies it would refuse)."""
    monkeypatch.setenv("FLEXIUM_PINNED_HOST_MEMORY", "0")
    engine = job.training([2 * MiB, 4 * MiB])
    wait_until(lambda: copier_processes() != [], what="the copier to start")
    (before,) = copier_processes()
    job.fake.set_other_memory(0, H200_BYTES - (600 << 20) - job.fake.used_bytes(0))  # 600 MiB free
    paused = engine.pause()
    assert paused.ok and paused.path == "fast" and names(paused) == FAST_PAUSE, paused.error
    assert any(
        n.startswith("the copies to and from host memory ran in this process: the GPU has ") for n in paused.notes
    )
    assert not any("the copier failed" in n for n in paused.notes), paused.notes
    assert copier_processes() == [before]
    job.fake.set_other_memory(0, 0)
    assert engine.resume().ok
    job.assert_home(physical=0)
