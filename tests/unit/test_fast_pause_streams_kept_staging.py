"""A pause that comes while the keeper is still pinning the kept host staging ahead (a young job's
first pause; or one just after a resume) does not wait for that pinning: it takes its safe point at
once, copies the chunks found pinned at once and pins the rest as the copies reach them, with no
breaks (docs/fast-path.md, "stop first, then stream"); the staging stays kept afterwards. Over the
fake driver, whose calls to cuMemHostRegister the copier process makes slow (FAKE_CUDA_DELAY), so
that a pause finds the pinning ahead half way. Each new step's failure leaves the job running where
it was with nothing moved, or paused and resumable: the copier dying when asked how far it pinned,
its pinning ahead failing, its copies failing or the copier killed in the copy step."""

from __future__ import annotations

import logging
import os
import re
import signal
import threading
from collections.abc import Callable
from typing import Any

import pytest

torch = pytest.importorskip("torch")

from flexium import _C  # noqa: E402
from flexium.engine import EngineState  # noqa: E402
from flexium.engine.fast import kept_staging, pinned_budget  # noqa: E402
from flexium.engine.fast.host_copier import Copier  # noqa: E402
from flexium.engine.fast.host_staging import DRIVER_MEMORY_ENV, PinnedAhead  # noqa: E402
from support.engine import MiB, driver, fake, make_engine, nvml_in_parent, step_summary, wait_until  # noqa: E402,F401
from support.fast_path import (  # noqa: E402,F401  (fixtures)
    CUDA_ERROR_UNKNOWN,
    FAST_PAUSE,
    Job,
    copier_processes,
    failure,
    job,
    names,
)

PIN_DELAY_MS = 600  # per chunk in the copier: longer than a pause takes to reach its copy step
# A staging of 540 MiB (the live bytes and an eighth), in chunks of 256 MiB: a pause can find the
# first pinned, stop the pinning ahead once the second is, and stream the third.
SIZES = [160 * MiB] * 3


@pytest.fixture
def slow_pinning(monkeypatch: pytest.MonkeyPatch) -> None:
    """A budget that keeps the staging, and a copier (started with the engine, after this) whose
    pinning is slow; this process's fake was set up before and stays fast."""
    monkeypatch.setenv(pinned_budget.ENV, "1GiB")
    monkeypatch.setattr(kept_staging, "CHECK_S", 0.05)
    monkeypatch.setenv("FAKE_CUDA_DELAY", f"cuMemHostRegister:{PIN_DELAY_MS}")
    # The keeper's memfds, pinned ahead: a staging of driver-made host memory (the default) needs no pinning
    # (tests/unit/test_driver_made_staging.py has a pause while it is being made).
    monkeypatch.setenv(DRIVER_MEMORY_ENV, "0")


def pinning_ahead(job: Job, engine: Any) -> PinnedAhead:
    """Waits until the copier has pinned some of the kept staging ahead, not all; returns that."""
    seen: list[PinnedAhead] = []

    def half_way() -> bool:
        ahead = job.fast.kept_pinning(engine.gpus[0].uuid) if job.fast is not None else None
        if ahead is not None and ahead.pinning and 0 < ahead.pinned < ahead.staging:
            seen.append(ahead)
            return True
        return False

    wait_until(half_way, timeout=10.0, what="the keeper's copier to have pinned part of the staging")
    return seen[-1]


def found_and_streamed(note: str) -> tuple[float, float]:
    """GiB the pause found pinned ahead and GiB of the rest it pinned at its safe point."""
    match = re.search(
        r"\(0\.00 GiB of it newly mapped and touched, (\d+\.\d\d) GiB found pinned \(its pinning ahead: pinned \d+ "
        r"chunks \(\d+\.\d\d GiB\) in \d+\.\d\d s \(the slowest \d+ ms\), stopped\), (\d+\.\d\d) GiB streamed; files "
        r"\d+\.\d\d s, attach \d+\.\d\d s\), then pinned \d+\.\d\d GiB in \d+\.\d\d s as the copies reached it",
        note,
    )
    assert match is not None, note
    return float(match.group(1)), float(match.group(2))


def test_a_pause_while_the_keeper_pins_ahead_streams_the_rest_and_the_staging_stays_kept(
    job: Job, slow_pinning: None
) -> None:
    engine = job.training(SIZES)
    ahead = pinning_ahead(job, engine)
    staging = ahead.staging
    assert staging > 2 * 256 * MiB
    paused = engine.pause()
    assert paused.ok and paused.path == "fast" and names(paused) == FAST_PAUSE
    assert re.fullmatch(
        r"the staging kept for pauses was still being pinned ahead: 0\.25 GiB of 0\.53 GiB pinned when the pause "
        r"was asked for; the rest is pinned as the copies reach it, or written where not touched yet, at the safe "
        r"point",
        paused.notes[0],
    ), paused.notes
    found, streamed = found_and_streamed(paused.notes[1])
    # The keeper's chunks (the one it was pinning when the pause stopped it included) copied at once, the
    # rest pinned at the safe point.
    assert found in (0.5, 0.25) and streamed > 0 and abs(found + streamed - staging / (1 << 30)) <= 0.01
    assert job.fake.pinned_at_last_checkpoint() == 0 and job.fake.call_count("cuMemHostRegister") == 0
    assert job.fast is not None and job.fast._copier is not None and job.fast._copier.awake_on is None
    assert _C.gpu_memory_yielder() == 0  # asleep: the paused job holds nothing on any GPU
    resumed = engine.resume()
    assert resumed.ok and resumed.path == "fast"
    job.assert_home(physical=0)
    # The keeper's purpose stands: the staging stays, pinned by the copier, within the budget.
    assert job.fast.keeping and _C.host_staging_pool_bytes() == staging
    assert job.fast._copier is not None and job.fast._copier.awake_on == engine.gpus[0].uuid


def test_a_copier_that_dies_when_asked_how_far_it_pinned_is_replaced_at_the_safe_point(
    job: Job, slow_pinning: None, monkeypatch: pytest.MonkeyPatch
) -> None:
    engine = job.training(SIZES)
    pinning_ahead(job, engine)
    (first,) = copier_processes()
    asked = Copier.pinning

    def dies(self: Copier) -> Any:
        os.kill(self.pid, signal.SIGKILL)
        return asked(self)

    monkeypatch.setattr(Copier, "pinning", dies)
    paused = engine.pause()
    assert paused.ok and paused.path == "fast" and names(paused) == FAST_PAUSE
    assert paused.notes[0] == (
        "the staging kept for pauses: its copier did not say how far it had pinned it (busy, or stopped as it "
        "failed): what is not pinned is pinned as the copies reach it, or written where not touched yet, at the safe "
        "point"
    )
    assert paused.notes[1].startswith("made the host staging by the copier process ")
    assert f"copier process {first} " not in paused.notes[1]  # a new one made it
    monkeypatch.setattr(Copier, "pinning", asked)
    resumed = engine.resume()
    assert resumed.ok and resumed.path == "fast"
    job.assert_home(physical=0)


def test_pinning_ahead_that_fails_gives_the_staging_back_and_the_keeper_keeps_it_again(
    job: Job, slow_pinning: None, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    monkeypatch.setenv("FAKE_CUDA_FAIL", f"cuMemHostRegister:{CUDA_ERROR_UNKNOWN}:3")  # the copier's third pin, once
    monkeypatch.setenv("FAKE_CUDA_DELAY", "cuMemHostRegister:5")
    caplog.set_level(logging.INFO, logger="flexium")
    engine = job.training(SIZES)
    keeper = engine._keeper
    assert keeper is not None
    wait_until(lambda: (keeper.note or "").startswith("keeps "), timeout=10.0, what="the staging kept again")
    stopped = [r.getMessage() for r in caplog.records if "pinning ahead stopped" in r.getMessage()]
    assert len(stopped) == 1 and re.fullmatch(
        r"the staging for a pause is prepared when one is asked for: the copier's pinning ahead stopped at 0\.50 of "
        r"0\.53 GiB \(pinned 2 chunks \(0\.50 GiB\) in \d+\.\d\d s \(the slowest \d+ ms\), failed: .*"
        r"cuMemHostRegister.*\)",
        stopped[0],
    ), stopped
    paused = engine.pause()
    assert paused.ok and paused.path == "fast"
    assert engine.resume().ok
    job.assert_home(physical=0)


def nothing_moved(job: Job, engine: Any, call: str) -> None:
    """The pause failed in its copy step: the job trains on where it was, whole; the staging is
    kept again and the next pause goes through once the driver lets it."""
    error = failure(engine.pause)
    result = error.result
    assert error.step == "copy" and call in result.error, result.error
    assert result.notes[0].startswith("the staging kept for pauses was still being pinned ahead: "), result.notes
    assert result.error.endswith("nothing moved: the job runs on cuda:0 as before"), result.error
    assert step_summary(result) == [("prepare", True, False), ("checksum", True, False), ("copy", False, False)]
    assert engine.state == EngineState.RUNNING and _C.host_staged_segments() == 0 and job.fake.pinned_bytes() == 0
    job.assert_home(physical=0)
    trainer = job.trainers[-1]
    steps = trainer.steps
    wait_until(lambda: trainer.steps > steps, what="training to go on")
    job.fake.clear_failures()


def test_copies_failing_in_the_copier_and_here_while_streaming_a_kept_staging_move_nothing(
    job: Job, slow_pinning: None, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("FAKE_CUDA_FAIL", f"cuMemcpyDtoHAsync:{CUDA_ERROR_UNKNOWN}:0")  # every copy, in the copier
    engine = job.training(SIZES)
    pinning_ahead(job, engine)
    job.fake.fail("cuMemcpyDtoHAsync", "CUDA_ERROR_UNKNOWN", nth=0)  # and here, where the copies run next
    nothing_moved(job, engine, "cuMemcpyDtoHAsync")
    monkeypatch.delenv("FAKE_CUDA_FAIL")  # the next copier copies
    wait_until(lambda: job.fast is not None and job.fast.keeping, timeout=10.0, what="the staging kept again")
    assert engine.pause().ok and engine.resume().ok
    job.assert_home(physical=0)


def test_a_copier_killed_while_streaming_a_kept_staging_leaves_the_copies_to_this_process(
    job: Job, slow_pinning: None, monkeypatch: pytest.MonkeyPatch
) -> None:
    engine = job.training(SIZES)
    pinning_ahead(job, engine)
    copy: Callable[..., Any] = Copier.copy

    def killed_first(self: Copier, *args: Any, **kwargs: Any) -> Any:
        os.kill(self.pid, signal.SIGKILL)  # after it was woken at the safe point, with part of the staging pinned
        return copy(self, *args, **kwargs)

    monkeypatch.setattr(Copier, "copy", killed_first)
    paused = engine.pause()
    assert paused.ok and paused.path == "fast" and names(paused) == FAST_PAUSE
    assert paused.notes[0].startswith("the staging kept for pauses was still being pinned ahead: ")
    assert "then pinned and copied in this process" in paused.notes[1]
    assert paused.notes[-1].startswith("the copies to and from host memory ran in this process: ")
    assert job.fake.pinned_at_last_checkpoint() == 0  # pinned here chunk by chunk, unpinned once copied
    monkeypatch.setattr(Copier, "copy", copy)
    resumed = engine.resume()
    assert resumed.ok and resumed.path == "fast"
    job.assert_home(physical=0)


def test_copiers_that_cannot_take_a_context_leave_the_keeping_undone_and_the_pause_to_this_process(
    job: Job, slow_pinning: None, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    """The keeper's copier fails to wake (its context refused) in the background: the next look, or
    the pause asking how far it pinned, hears it, stops it and says so; the pause then copies here."""
    monkeypatch.setenv("FAKE_CUDA_FAIL", f"cuDevicePrimaryCtxRetain:{CUDA_ERROR_UNKNOWN}:0")  # in every copier
    monkeypatch.setenv("FAKE_CUDA_DELAY", "cuMemHostRegister:5")
    caplog.set_level(logging.WARNING, logger="flexium")
    engine = job.training(SIZES)
    wait_until(
        lambda: any("it failed pinning the staging ahead" in r.getMessage() for r in caplog.records),
        timeout=10.0,
        what="the keeper to hear that its copier failed",
    )
    paused = engine.pause()
    assert paused.ok and paused.path == "fast" and names(paused) == FAST_PAUSE
    assert paused.notes[-1].startswith("the copies to and from host memory ran in this process: "), paused.notes
    assert "cuDevicePrimaryCtxRetain" in paused.notes[-1] or "wake" in paused.notes[-1], paused.notes
    assert job.fake.pinned_at_last_checkpoint() == 0
    resumed = engine.resume()
    assert resumed.ok and resumed.path == "fast"
    job.assert_home(physical=0)
    monkeypatch.delenv("FAKE_CUDA_FAIL")  # before the teardown's reset of this process's fake reads it


def test_asking_how_far_the_copier_pinned_while_a_pause_or_resume_runs_waits_its_turn(
    job: Job, slow_pinning: None, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The keeper asks from its own thread; a move's orders come from another. One socket: each
    exchange waits for the one under way, so no reply goes to the wrong asker (which would stop the
    copier and leave the copies to this process)."""
    monkeypatch.setenv("FAKE_CUDA_DELAY", "cuMemHostRegister:5")
    engine = job.training([2 * MiB, 4 * MiB, 6 * MiB])
    uuid = engine.gpus[0].uuid
    wait_until(lambda: job.fast is not None and job.fast.kept_on(uuid), timeout=10.0, what="the staging kept")
    (copier,) = copier_processes()
    fast = job.fast
    assert fast is not None
    stop = threading.Event()
    asked: list[BaseException | PinnedAhead | None] = []

    def ask() -> None:
        while not stop.is_set():
            try:
                asked.append(fast.kept_pinning(uuid))
            except BaseException as exc:  # noqa: BLE001  (whatever it is, the test says it)
                asked.append(exc)

    asker = threading.Thread(target=ask, daemon=True)
    asker.start()
    try:
        for _ in range(3):
            paused = engine.pause()
            assert paused.ok and paused.path == "fast" and not any("ran in this process" in n for n in paused.notes)
            resumed = engine.resume()
            assert resumed.ok and resumed.path == "fast"
            # The copier's copy back is imported memory until the next optimizer steps make it the job's
            # own; a pause before that copies it here (docs/fast-path.md), which is not this test's point.
            wait_until(lambda: _C.vmm_imported_count() == 0, what="the memory to be the job's own")
    finally:
        stop.set()
        asker.join(10)
    assert not [a for a in asked if isinstance(a, BaseException)]
    assert any(isinstance(a, PinnedAhead) for a in asked)
    assert copier_processes() == [copier]  # never stopped for a reply that was not its asker's
    job.assert_home(physical=0)
