"""A staging kept between pauses made of host memory the driver makes in the copier (fact
`driver-made-host-memory`, csrc/host_copier.cpp make_host_memory, vmm_host_staging.cpp adopt_host_memory),
over the fake driver with the real copier process: the job holds it by its fds only, so its checkpoint
finds none mapped (fact `cumem-host-memory-unrestorable`), and maps it only while its own copies run when
the copier is gone; a driver that cannot make it leaves the staging to memfds."""

from __future__ import annotations

import os
import signal
import time
from collections.abc import Callable
from typing import Any

import pytest

torch = pytest.importorskip("torch")

from flexium import _C  # noqa: E402
from flexium.engine.fast import kept_staging, path, pinned_budget  # noqa: E402
from flexium.engine.fast.host_copier import Copier  # noqa: E402
from flexium.engine.fast.host_staging import DRIVER_MEMORY_ENV  # noqa: E402
from support.engine import MiB, driver, fake, make_engine, nvml_in_parent, wait_until  # noqa: E402,F401
from support.fast_path import CUDA_ERROR_UNKNOWN, Job, copier_processes, job  # noqa: E402,F401  (fixtures)

SIZES = [2 * MiB, 4 * MiB, 6 * MiB]


@pytest.fixture
def kept(monkeypatch: pytest.MonkeyPatch) -> Callable[[Job, Any], None]:
    """The keeper on, looking often; waits until it keeps the job's staging pinned."""
    monkeypatch.setenv(pinned_budget.ENV, "1GiB")
    monkeypatch.setattr(kept_staging, "CHECK_S", 0.05)

    def until_kept(job: Job, engine: Any) -> None:
        wait_until(
            lambda: job.fast is not None and job.fast.keeping and (engine._keeper.note or "").startswith("keeps "),
            what="the keeper to keep the staging pinned",
        )

    return until_kept


def host_memory_mapped_here() -> list[str]:
    """What of the driver's host memory this process has mapped (what its checkpoint could not restore)."""
    return [repr(m) for m in _C.uncheckpointable_mappings()]


def test_the_kept_staging_is_driver_memory_the_job_holds_by_its_fds_alone(
    job: Job, kept: Callable[[Job, Any], None]
) -> None:
    engine = job.training(SIZES)
    kept(job, engine)
    layout = _C.host_staging_layout()
    assert layout.driver_made and all(layout.driver_made), layout
    assert host_memory_mapped_here() == []
    paused = engine.pause()
    assert paused.ok and paused.path == "fast", paused.error
    assert "0.00 GiB newly pinned" in paused.notes[0], paused.notes
    assert job.fake.pinned_at_last_checkpoint() == 0 and job.fake.vmm_mappings() == 0
    assert all(_C.host_staging_layout().driver_made)  # kept through the pause, the copier asleep
    resumed = engine.resume()
    assert resumed.ok and resumed.path == "fast", resumed.error
    assert any("beside the restore" in note for note in resumed.notes), resumed.notes
    job.assert_home(physical=0)
    assert host_memory_mapped_here() == [] and all(_C.host_staging_layout().driver_made)


def test_without_its_copier_the_job_maps_driver_memory_only_while_its_copies_run(
    job: Job, kept: Callable[[Job, Any], None], monkeypatch: pytest.MonkeyPatch
) -> None:
    engine = job.training(SIZES)
    kept(job, engine)
    copy = Copier.copy

    def killed_first(self: Copier, *args: Any, **kwargs: Any) -> Any:
        os.kill(self.pid, signal.SIGKILL)
        return copy(self, *args, **kwargs)

    monkeypatch.setattr(Copier, "copy", killed_first)
    paused = engine.pause()
    assert paused.ok and paused.path == "fast", paused.error
    assert any(note.startswith("the copies to and from host memory ran in this process") for note in paused.notes)
    assert job.fake.vmm_mappings() == 0  # mapped for the copies, let go of before the checkpoint
    layout = _C.host_staging_layout()
    assert all(layout.driver_made)
    resumed = engine.resume()
    assert resumed.ok and resumed.path == "fast", resumed.error
    job.assert_home(physical=0, held_by_fds=len(layout.extents))
    assert host_memory_mapped_here() == []


def test_a_driver_that_cannot_make_host_memory_leaves_the_staging_to_memfds(
    job: Job, kept: Callable[[Job, Any], None], monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("FAKE_CUDA_FAIL", f"cuMemCreate:{CUDA_ERROR_UNKNOWN}:0")  # every call, in the copier's fake
    engine = job.training(SIZES)
    kept(job, engine)
    assert job.fast is not None and "cuMemCreate" in job.fast.driver_memory_refused
    assert not any(_C.host_staging_layout().driver_made)
    assert engine.pause().ok and engine.resume().ok
    job.assert_home(physical=0)


def test_switched_off_the_kept_staging_is_memfds(
    job: Job, kept: Callable[[Job, Any], None], monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv(DRIVER_MEMORY_ENV, "0")
    engine = job.training(SIZES)
    kept(job, engine)
    assert _C.host_staging_layout().driver_made == [False] * len(_C.host_staging_layout().extents)
    assert engine.pause().ok and engine.resume().ok
    job.assert_home(physical=0)


def test_a_resume_without_its_copier_maps_the_driver_memory_here_for_its_copy_back(
    job: Job, kept: Callable[[Job, Any], None]
) -> None:
    engine = job.training(SIZES)
    kept(job, engine)
    assert engine.pause().ok
    (copier,) = copier_processes()
    os.kill(copier, signal.SIGKILL)  # asleep, holding nothing: the bytes are in the memory the job's fds hold
    resumed = engine.resume()
    assert resumed.ok and resumed.path == "fast", resumed.error
    assert any("ran in this process" in note for note in resumed.notes), resumed.notes
    layout = _C.host_staging_layout()
    job.assert_home(physical=0, held_by_fds=len(layout.extents))
    assert all(layout.driver_made)


def test_a_copier_told_not_to_fill_copies_the_driver_memory_back_after_the_restore(
    job: Job, kept: Callable[[Job, Any], None], monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("FLEXIUM_RESUME_OVERLAP", "0")  # read by the copier, which the job starts next
    engine = job.training(SIZES)
    kept(job, engine)
    assert engine.pause().ok
    resumed = engine.resume()
    assert resumed.ok and resumed.path == "fast", resumed.error
    assert any(note.startswith("copied back after the restore") for note in resumed.notes), resumed.notes
    job.assert_home(physical=0)


def test_a_pause_while_the_keeper_makes_driver_memory_streams_the_rest(
    job: Job, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The keeper makes the memory a piece at a time without the staging's lock: a pause that comes half way
    waits for one piece, keeps what was made and streams the rest as memfds."""
    monkeypatch.setenv(pinned_budget.ENV, "1GiB")
    monkeypatch.setattr(kept_staging, "CHECK_S", 0.05)
    monkeypatch.setattr(path, "DRIVER_MADE_PIECE", 2 * MiB)
    monkeypatch.setenv("FAKE_CUDA_DELAY", "cuMemCreate:150")  # in the copier's fake: a piece per 0.15 s
    engine = job.training(SIZES)
    wait_until(lambda: 0 < _C.host_staging_pool_bytes() <= 6 * MiB, what="the keeper to have made some pieces")
    paused = engine.pause()
    assert paused.ok and paused.path == "fast", paused.error
    layout = _C.host_staging_layout()
    assert True in layout.driver_made and False in layout.driver_made, layout  # made, then streamed
    made_ahead = sum(size for (_fd, size), made in zip(layout.extents, layout.driver_made, strict=True) if made)
    said = f"GiB of it newly mapped and written, {made_ahead / (1 << 30):.2f} GiB made by the driver ahead, "
    assert any(said in note for note in paused.notes), (said, paused.notes)
    assert job.fake.pinned_at_last_checkpoint() == 0 and job.fake.vmm_mappings() == 0
    assert engine.resume().ok
    job.assert_home(physical=0)


def test_a_copier_killed_while_it_makes_driver_memory_costs_the_job_nothing(
    job: Job, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv(pinned_budget.ENV, "1GiB")
    monkeypatch.setattr(kept_staging, "CHECK_S", 0.05)
    monkeypatch.setattr(path, "DRIVER_MADE_PIECE", 2 * MiB)
    monkeypatch.setenv("FAKE_CUDA_DELAY", "cuMemCreate:150")
    engine = job.training(SIZES)
    wait_until(lambda: _C.host_staging_pool_bytes() > 0, what="the keeper to have made a piece")
    for pid in copier_processes():
        os.kill(pid, signal.SIGKILL)
    paused = engine.pause()
    assert paused.ok and paused.path == "fast", paused.error
    assert engine.resume().ok
    # Copied by a new copier, or here (mapping the pieces made so far while its copies ran).
    job.assert_home(physical=0, held_by_fds=sum(_C.host_staging_layout().driver_made))


def test_a_job_short_of_open_files_keeps_memfds(
    job: Job, kept: Callable[[Job, Any], None], monkeypatch: pytest.MonkeyPatch
) -> None:
    """Each piece of driver-made memory is an fd the job holds as long as the staging: a job with too few files
    left for them and for a move's (one per segment) keeps memfds, a few files in all."""
    monkeypatch.setattr(path, "open_file_headroom", lambda: path.FD_RESERVE + 3)
    engine = job.training(SIZES)
    kept(job, engine)
    assert not any(_C.host_staging_layout().driver_made)
    assert engine.pause().ok and engine.resume().ok
    job.assert_home(physical=0)


def test_a_bad_switch_is_refused_when_the_job_starts(monkeypatch: pytest.MonkeyPatch) -> None:
    from flexium.api import runtime
    from flexium.errors import ConfigError

    monkeypatch.setenv(DRIVER_MEMORY_ENV, "sometimes")
    with pytest.raises(ConfigError, match=r"FLEXIUM_DRIVER_HOST_MEMORY\) is not valid; use true or false"):
        runtime._start(None)  # type: ignore[arg-type]  (refused before the config is read)
    assert runtime.current() is None


@pytest.mark.parametrize("why", ["crowded", "copier off"])
def test_a_pause_that_pins_here_before_its_safe_point_leaves_driver_memory_unmapped(
    job: Job, kept: Callable[[Job, Any], None], monkeypatch: pytest.MonkeyPatch, why: str
) -> None:
    """A pause that finds the staging kept pins it before its safe point; where that pinning runs in the
    job (the GPU short of room for a copier's context, or the copier off), driver-made memory, pinned by
    nature, is not mapped ahead: mapped, it would ride the job's checkpoint, which cannot restore it."""
    engine = job.training(SIZES)
    kept(job, engine)
    if why == "crowded":
        monkeypatch.setattr(path, "copier_room_problem", lambda uuid, coming=0: "the GPU has 700 MiB free")
    else:
        monkeypatch.setattr(path, "copier_enabled", lambda: False)
    paused = engine.pause()
    assert paused.ok and paused.path == "fast", paused.error
    assert job.fake.vmm_mappings() == 0 and host_memory_mapped_here() == []
    resumed = engine.resume()
    assert resumed.ok and resumed.path == "fast", resumed.error
    job.assert_home(physical=0, held_by_fds=len(_C.host_staging_layout().extents))
    assert engine.pause().ok and engine.resume().ok  # and the next pause is not refused
    job.assert_home(physical=0, held_by_fds=len(_C.host_staging_layout().extents))


def test_a_wake_the_copier_refused_does_not_switch_driver_memory_off(
    job: Job, kept: Callable[[Job, Any], None], monkeypatch: pytest.MonkeyPatch
) -> None:
    """The keeper wakes the copier without waiting, then asks it to make memory: a refused wake (no
    context to be had) is the copier failing, whose reply to the making must not be left for the next
    exchange; the keeper starts another copier and the staging is driver-made all the same."""
    wake = Copier.wake
    calls = []

    def refused_first(self: Copier, uuid: str, **kwargs: Any) -> Any:
        calls.append(uuid)
        if len(calls) == 1:  # a GPU the copier cannot find: it answers a refusal
            reply = wake(self, "GPU-00000000-0000-0000-0000-000000000000", **kwargs)
            self.awake_on = uuid
            return reply
        return wake(self, uuid, **kwargs)

    monkeypatch.setattr(Copier, "wake", refused_first)
    engine = job.training(SIZES)
    kept(job, engine)
    assert job.fast is not None and job.fast.driver_memory_refused == ""
    assert all(_C.host_staging_layout().driver_made)
    assert engine.pause().ok and engine.resume().ok
    job.assert_home(physical=0)


def test_the_keeper_stops_between_the_pieces_it_makes(job: Job, monkeypatch: pytest.MonkeyPatch) -> None:
    """The engine's stop waits for the piece under way, not for the whole staging."""
    monkeypatch.setenv(pinned_budget.ENV, "1GiB")
    monkeypatch.setattr(kept_staging, "CHECK_S", 0.05)
    monkeypatch.setattr(path, "DRIVER_MADE_PIECE", 2 * MiB)
    monkeypatch.setenv("FAKE_CUDA_DELAY", "cuMemCreate:400")  # in the copier's fake: 0.4 s a piece, 7 pieces
    engine = job.training(SIZES)
    wait_until(lambda: _C.host_staging_pool_bytes() > 0, what="the keeper's first piece")
    keeper = engine._keeper
    assert keeper is not None
    started = time.perf_counter()
    keeper.stop()
    assert time.perf_counter() - started < 1.5  # the whole staging takes 2.8 s
    assert _C.host_staging_pool_bytes() < 14 * MiB
