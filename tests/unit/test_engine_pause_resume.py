"""A pause that frees every GPU and its resume, in place or on another GPU, over the fake driver;
stop() resuming a paused job in place, or saying why it cannot."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import pytest

from flexium.engine import EngineState, OperationKind, nvml
from support.engine import (  # noqa: F401  (fixtures)
    H200_BYTES,
    ChildReads,
    GiB,
    checkpoint_ops,
    driver,
    fake,
    make_engine,
    nvml_in_parent,
    on_gpu,
    step_summary,
)
from support.fake_driver import FakeDriver, ProcessState

pytestmark = pytest.mark.usefixtures("nvml_in_parent")


def test_pause_frees_every_gpu_and_resume_in_place(
    fake: FakeDriver, make_engine: Callable[..., Any], nvml_in_parent: ChildReads
) -> None:
    fake.set_process_memory(0, 6 * GiB)
    engine = make_engine()
    seen: list[EngineState] = []
    engine.add_state_listener(seen.append)

    paused = engine.pause()
    assert paused.ok and paused.kind == OperationKind.PAUSE and paused.target is None
    assert step_summary(paused) == [("prepare", True, False), ("lock", True, False), ("checkpoint", True, False)]
    assert paused.bytes_moved == 6 * GiB
    assert engine.state == EngineState.PAUSED and fake.state() == ProcessState.CHECKPOINTED
    assert fake.used_bytes(0) == 0 and fake.used_bytes(1) == 0  # fact `zero-residue`: nothing left anywhere
    assert checkpoint_ops(fake) == ["Lock", "Checkpoint"]
    # While frozen the job holds nothing anywhere: answered without any NVML query (or torch call).
    assert nvml._frozen.is_set()
    reads_before = nvml_in_parent.count
    assert engine.process_bytes() == 0
    assert nvml_in_parent.count == reads_before
    assert engine.footprint_bytes() == 6 * GiB

    fake.clear_log()
    resumed = engine.resume()
    assert resumed.ok and resumed.kind == OperationKind.RESUME
    assert resumed.target.uuid == resumed.source.uuid == fake.uuid(0)
    assert step_summary(resumed) == [("restore", True, False), ("unlock", True, False)]
    assert resumed.bytes_moved == 6 * GiB
    assert checkpoint_ops(fake) == ["Restore", "Unlock"] and fake.last_pairs_count() == 0
    assert engine.state == EngineState.RUNNING
    on_gpu(fake, engine, 0)
    assert fake.process_bytes_on(0) == 6 * GiB
    assert not nvml._frozen.is_set()
    assert seen == [EngineState.PAUSING, EngineState.PAUSED, EngineState.RESUMING, EngineState.RUNNING]


def test_resume_on_another_gpu(fake: FakeDriver, make_engine: Callable[..., Any]) -> None:
    fake.set_process_memory(0, 6 * GiB)
    engine = make_engine()
    engine.pause()
    fake.clear_log()
    result = engine.resume(engine.gpus[1])
    assert result.ok and result.target.device == "cuda:1"
    assert fake.last_pairs() == [(0, 1), (1, 0)]
    on_gpu(fake, engine, 1)
    assert fake.process_bytes_on(1) == 6 * GiB and fake.used_bytes(0) == 0
    # And back through a migration, relative to the new place.
    assert engine.migrate(engine.gpus[0]).ok
    on_gpu(fake, engine, 0)


def test_stop_resumes_a_paused_job(fake: FakeDriver, make_engine: Callable[..., Any]) -> None:
    fake.set_process_memory(0, GiB)
    engine = make_engine()
    engine.pause()
    engine.stop()
    assert engine.state == EngineState.RUNNING and fake.state() == ProcessState.RUNNING
    on_gpu(fake, engine, 0)
    assert not nvml._frozen.is_set()


def test_stop_says_why_a_paused_job_it_cannot_resume_in_place_exits_paused(
    fake: FakeDriver, make_engine: Callable[..., Any], capsys: pytest.CaptureFixture[str]
) -> None:
    fake.set_process_memory(0, 30 * GiB)
    engine = make_engine()
    engine.pause()
    fake.set_other_memory(0, H200_BYTES - 10 * GiB)  # GPU 1 has room: stop() does not move the job there
    fake.clear_log()
    engine.stop()
    err = capsys.readouterr().err
    assert (
        "could not resume the paused job in place at shutdown, so it exits paused: "
        "cuda:0 has 10.00 GiB free; the paused job needs 30.00 GiB plus 0.50 GiB headroom; the process ends now, so "
        "nothing of it is left "
        "to resume" in err
    )
    assert "flexium resume" not in err and "free memory there" not in err  # advice for a process still there
    assert fake.calls("cu") == []
    assert engine.state == EngineState.PAUSED and fake.state() == ProcessState.CHECKPOINTED
