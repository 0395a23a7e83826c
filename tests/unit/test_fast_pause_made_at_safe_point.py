"""A fast pause whose host staging is not kept pinned (it does not fit the pinned host memory budget,
or nothing kept it yet) makes it at its safe point, with the job stopped, in its copy step: the
copier writes it through small pinned buffers as its copies come (or, with FLEXIUM_WRITTEN_STAGING=0,
touches it and pins each chunk as its copies reach it: docs/fast-path.md, "stop first, then stream").
Over the fake driver: where the time went is noted, and a failure at any point of that step (pinning,
copying, the copier dying) leaves the job paused by copies in this process, or running where it was
with nothing moved; never lost."""

from __future__ import annotations

import os
import re
import signal
from typing import Any

import pytest

torch = pytest.importorskip("torch")

from flexium import _C  # noqa: E402
from flexium.engine import EngineState  # noqa: E402
from flexium.engine.fast.host_copier import Copier  # noqa: E402
from support.engine import (  # noqa: E402,F401  (fixtures)
    MiB,
    driver,
    fake,
    make_engine,
    nvml_in_parent,
    step_summary,
    wait_until,
)
from support.fast_path import (  # noqa: E402,F401  (fixtures)
    CUDA_ERROR_UNKNOWN,
    FAST_PAUSE,
    Job,
    copier_processes,
    failure,
    job,
    names,
    staging_mapped_in,
)

WRITTEN = re.compile(
    r"made the host staging by the copier process \d+ at the safe point in \d+\.\d\d s \(0\.01 GiB of it newly "
    r"mapped and written, 0\.00 GiB found pinned, 0\.01 GiB streamed; files \d+\.\d\d s, attach \d+\.\d\d s\), "
    r"then wrote 0\.01 GiB through 1 MiB buffers as the copies came, nothing of it pinned, copies \d+\.\d\d s$"
)
TOUCHED = re.compile(
    r"made the host staging by the copier process \d+ at the safe point in \d+\.\d\d s \(0\.01 GiB of it newly "
    r"mapped and touched, 0\.00 GiB found pinned, 0\.01 GiB streamed; files \d+\.\d\d s, attach \d+\.\d\d s\), "
    r"then pinned "
    r"\d+\.\d\d GiB in \d+\.\d\d s as the copies reached it \(of which \d+\.\d\d s waiting for the touching\), "
    r"copies \d+\.\d\d s$"
)


@pytest.fixture
def unkept(monkeypatch: pytest.MonkeyPatch) -> None:
    """Nothing is kept pinned between pauses: every pause makes its staging."""
    monkeypatch.setenv("FLEXIUM_PINNED_HOST_MEMORY", "0")


@pytest.fixture
def touched(monkeypatch: pytest.MonkeyPatch) -> None:
    """The copier touches a staging made at the safe point and pins it as its copies reach it, rather than
    write it (the copier process, started at the pause, reads it from the job's environment)."""
    monkeypatch.setenv("FLEXIUM_WRITTEN_STAGING", "0")


@pytest.fixture(params=["written", "touched"])
def way(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> str:
    """Each way the copier makes a staging at the safe point: the default (written) and touched."""
    monkeypatch.setenv("FLEXIUM_WRITTEN_STAGING", "1" if request.param == "written" else "0")
    return str(request.param)


def test_the_staging_made_at_the_safe_point_is_written_not_pinned(job: Job, unkept: None) -> None:
    """Written through the copier's small pinned buffers, the staging's pages are made by the writes:
    nothing of it is ever pinned, and the job resumes on the other GPU with its bytes intact. While the
    job is paused the copier maps the written pages in, so that the resume's pinning need not fault them
    in one by one. A second pause writes its staging again; the time each took is noted."""
    engine = job.training([2 * MiB, 4 * MiB, 6 * MiB])
    assert _C.host_staging_pool_bytes() == 0  # nothing made while the job trains
    for target in (1, 0):
        paused = engine.pause()
        assert paused.ok and paused.path == "fast" and names(paused) == FAST_PAUSE
        assert WRITTEN.match(paused.notes[0]), paused.notes
        assert job.fake.pinned_at_last_checkpoint() == 0 and job.fake.call_count("cuMemHostRegister") == 0
        assert copier_processes() != [] and job.fast is not None and job.fast._copier is not None
        assert job.fast._copier.awake_on is None  # asleep: the paused job holds nothing on any GPU
        staging, copier = _C.host_staging_pool_bytes(), job.fast._copier.pid
        wait_until(
            lambda pid=copier, size=staging: staging_mapped_in(pid) == size,
            what="the copier to map the written pages in",
        )
        resumed = engine.resume(target=engine.gpus[target])
        assert resumed.ok and resumed.path == "fast"
        job.assert_home(physical=target)
        wait_until(lambda: _C.host_staging_pool_bytes() == 0, what="the staging to be given back")
        # The memory the copier filled at the resume is the job's own after its next step (a pause before
        # that copies it in this process, which is not what this test is about).
        wait_until(lambda: _C.vmm_segments_to_own() == 0, what="the resumed job to make its memory its own")


def test_the_staging_made_at_the_safe_point_may_be_touched_and_pinned(job: Job, unkept: None, touched: None) -> None:
    engine = job.training([2 * MiB, 4 * MiB, 6 * MiB])
    assert _C.host_staging_pool_bytes() == 0
    paused = engine.pause()
    assert paused.ok and paused.path == "fast" and names(paused) == FAST_PAUSE
    assert TOUCHED.match(paused.notes[0]), paused.notes
    assert job.fake.pinned_at_last_checkpoint() == 0  # pinned while the copies ran, unpinned before the checkpoint
    assert job.fast is not None and job.fast._copier is not None and job.fast._copier.awake_on is None
    resumed = engine.resume(target=engine.gpus[1])
    assert resumed.ok and resumed.path == "fast"
    job.assert_home(physical=1)
    wait_until(lambda: _C.host_staging_pool_bytes() == 0, what="the staging to be given back")


@pytest.mark.parametrize("call", ["cuMemHostRegister", "cuMemcpyDtoHAsync"])
def test_a_staging_failing_in_the_copier_is_copied_here(
    job: Job, unkept: None, way: str, monkeypatch: pytest.MonkeyPatch, call: str
) -> None:
    """The copier cannot pin (its buffers, or the staging it touched) or copy: it is stopped and this process copies
    (touching and pinning the files itself), the job pausing and resuming whole; failing here too,
    nothing moves and the job trains on."""
    monkeypatch.setenv("FAKE_CUDA_FAIL", f"{call}:{CUDA_ERROR_UNKNOWN}:0")  # every call, in the copier's fake
    engine = job.training([2 * MiB, 4 * MiB])
    paused = engine.pause()
    assert paused.ok and paused.path == "fast" and names(paused) == FAST_PAUSE
    assert "then pinned and copied in this process" in paused.notes[0], paused.notes
    assert call in paused.notes[-1] and paused.notes[-1].startswith("the copies to and from host memory ran in this"), (
        paused.notes
    )
    monkeypatch.delenv("FAKE_CUDA_FAIL")  # the next copier copies
    resumed = engine.resume()
    assert resumed.ok and resumed.path == "fast"
    job.assert_home(physical=0)
    wait_until(lambda: _C.host_staging_pool_bytes() == 0, what="the staging to be given back")
    job.fake.fail(call, "CUDA_ERROR_UNKNOWN", nth=0)
    monkeypatch.setenv("FAKE_CUDA_FAIL", f"{call}:{CUDA_ERROR_UNKNOWN}:0")
    nothing_moved(job, engine, call)


def nothing_moved(job: Job, engine: Any, call: str) -> None:
    """The pause failed in its copy step: the job trains on where it was, whole, and the next pause
    goes through once the driver lets it."""
    error = failure(engine.pause)
    result = error.result
    assert error.step == "copy" and result.path == "fast" and call in result.error, result.error
    assert result.error.endswith("nothing moved: the job runs on cuda:0 as before"), result.error
    assert step_summary(result) == [("prepare", True, False), ("checksum", True, False), ("copy", False, False)]
    assert engine.state == EngineState.RUNNING and job.fake.placement() == [0, 1]
    assert _C.host_staged_segments() == 0 and job.fake.pinned_bytes() == 0
    job.assert_home(physical=0)
    trainer = job.trainers[-1]
    steps = trainer.steps
    wait_until(lambda: trainer.steps > steps, what="training to go on")
    wait_until(lambda: _C.host_staging_pool_bytes() == 0, what="the staging to be given back")
    job.fake.clear_failures()
    assert engine.pause().ok and engine.resume().ok
    job.assert_home(physical=0)


@pytest.mark.parametrize("call", ["cuMemHostRegister", "cuMemcpyDtoHAsync"])
def test_a_copy_step_failing_in_the_copier_and_here_moves_nothing(
    job: Job, unkept: None, way: str, monkeypatch: pytest.MonkeyPatch, call: str
) -> None:
    monkeypatch.setenv("FAKE_CUDA_FAIL", f"{call}:{CUDA_ERROR_UNKNOWN}:0")  # every call, in the copier's fake
    engine = job.training([2 * MiB, 4 * MiB])
    job.fake.fail(call, "CUDA_ERROR_UNKNOWN", nth=0)  # and here, where the copies run next
    nothing_moved(job, engine, call)


def test_a_copier_killed_in_the_copy_step_leaves_the_copies_to_this_process(
    job: Job, unkept: None, way: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    engine = job.training([2 * MiB, 4 * MiB, 6 * MiB])
    copy = Copier.copy

    def killed_first(self: Copier, *args: Any, **kwargs: Any) -> Any:
        os.kill(self.pid, signal.SIGKILL)  # after it touched the staging and took its context
        return copy(self, *args, **kwargs)

    monkeypatch.setattr(Copier, "copy", killed_first)
    paused = engine.pause()
    assert paused.ok and paused.path == "fast" and names(paused) == FAST_PAUSE
    assert paused.notes[0].startswith("made the host staging by the copier process")
    assert "then pinned and copied in this process" in paused.notes[0]
    assert paused.notes[-1].startswith("the copies to and from host memory ran in this process: ")
    assert job.fake.pinned_at_last_checkpoint() == 0  # pinned here chunk by chunk, unpinned once copied
    monkeypatch.setattr(Copier, "copy", copy)
    resumed = engine.resume()
    assert resumed.ok and resumed.path == "fast"
    job.assert_home(physical=0)
