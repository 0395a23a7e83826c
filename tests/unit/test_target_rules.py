"""The engine's last word on a target (engine/target_rules.py), through the Engine over the fake
driver: a migration's target (of this host, not the GPU the job is on, the same model, room for the
job plus headroom, the job's own memory there counted as room), the candidates `recoverable()`
chooses from, a resume's room on the GPUs it puts the job on, and a pause's host memory; each
refused before anything is touched, with what to do."""

from __future__ import annotations

import re
from collections.abc import Callable
from typing import Any

import pytest

from flexium.engine import EngineState
from flexium.errors import (
    FlexiumError,
    TargetRefusedError,
)
from support.engine import (  # noqa: F401  (fixtures)
    H200_BYTES,
    MARGIN,
    GiB,
    HostMemory,
    MiB,
    assert_untouched,
    checkpoint_ops,
    driver,
    fake,
    host_memory,
    make_engine,
    nvml_in_parent,
    on_gpu,
)
from support.fake_driver import FakeDriver, ProcessState

pytestmark = pytest.mark.usefixtures("nvml_in_parent")


# ----------------------------------------------------------------------------- target validation


def refused(engine: Any, target: Any) -> str:
    with pytest.raises(TargetRefusedError) as caught:
        engine.migrate(target)
    assert isinstance(caught.value, FlexiumError) and isinstance(caught.value, ValueError)
    return str(caught.value)


@pytest.mark.parametrize("target", ["cuda:1", "1", "gpu1"])
def test_a_device_name_is_refused_before_anything_is_touched(
    target: str, fake: FakeDriver, make_engine: Callable[..., Any]
) -> None:
    """The server resolves device names to a UUID; the engine takes a UUID or a GpuIdentity."""
    engine = make_engine()
    assert refused(engine, target) == (
        f"target '{target}' is not a GPU UUID: the engine takes a UUID ('GPU-...', as nvidia-smi -L prints it) "
        "or a GpuIdentity; names such as 'cuda:N' or an nvidia-smi index are resolved by the server"
    )
    assert_untouched(fake, engine)
    assert engine.last_result is None


def test_uuid_not_on_this_host_is_refused(fake: FakeDriver, make_engine: Callable[..., Any]) -> None:
    engine = make_engine()
    assert refused(engine, "GPU-00000000-1111-2222-3333-444444444444") == (
        "no GPU with UUID GPU-00000000-1111-2222-3333-444444444444 on this host"
    )
    assert_untouched(fake, engine)


def test_the_current_gpu_is_refused(fake: FakeDriver, make_engine: Callable[..., Any]) -> None:
    fake.set_process_memory(0, GiB)
    engine = make_engine()
    assert refused(engine, engine.gpus[0]) == f"the job is already on cuda:0 ({fake.uuid(0)})"
    assert_untouched(fake, engine)
    assert engine.migrate(engine.gpus[1]).ok
    fake.clear_log()
    # After the move the job is on the GPU that was cuda:1 at init.
    assert refused(engine, fake.uuid(1)) == f"the job is already on cuda:1 ({fake.uuid(1)})"
    assert_untouched(fake, engine, physical=1)


def test_another_gpu_model_is_refused(
    fake: FakeDriver, make_engine: Callable[..., Any], monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("FAKE_CUDA_MODELS", "NVIDIA H200,NVIDIA H100 80GB HBM3")
    fake.reset()
    engine = make_engine()
    assert refused(engine, engine.gpus[1]) == (
        "cuda:1 is a NVIDIA H100 80GB HBM3, the job runs on a NVIDIA H200: migration needs the same GPU model"
    )
    assert_untouched(fake, engine)
    assert engine.candidate_targets() == []


def test_a_target_without_room_is_refused(fake: FakeDriver, make_engine: Callable[..., Any]) -> None:
    fake.set_process_memory(0, 20 * GiB)
    fake.set_other_memory(1, H200_BYTES - 15 * GiB)
    engine = make_engine()
    message = refused(engine, engine.gpus[1])
    assert re.fullmatch(
        r"cuda:1 \(NVIDIA H200, nvidia-smi index 1\) has 15\.00 GiB free; the job needs 20\.00 GiB plus 0\.50 GiB "
        r"headroom: free memory there or choose another GPU",
        message,
    ), message
    assert_untouched(fake, engine)


def test_room_for_the_job_plus_headroom_is_the_limit(fake: FakeDriver, make_engine: Callable[..., Any]) -> None:
    fake.set_process_memory(0, 20 * GiB)
    fake.set_other_memory(1, H200_BYTES - 20 * GiB - MARGIN + 1)  # one byte short
    engine = make_engine()
    assert "the job needs 20.00 GiB plus 0.50 GiB headroom" in refused(engine, engine.gpus[1])
    assert_untouched(fake, engine)
    fake.set_other_memory(1, H200_BYTES - 20 * GiB - MARGIN)  # exactly enough
    assert engine.migrate(engine.gpus[1]).ok
    on_gpu(fake, engine, 1)


def test_our_own_memory_on_the_target_counts_as_room(fake: FakeDriver, make_engine: Callable[..., Any]) -> None:
    """In the swap, what this process holds on the target moves to the source."""
    fake.set_process_memory(0, 30 * GiB)
    fake.set_process_memory(1, 30 * GiB)
    fake.set_other_memory(1, H200_BYTES - 31 * GiB)  # 1 GiB free, but 30 GiB of it are ours
    engine = make_engine()
    assert engine.migrate(engine.gpus[1]).ok
    assert fake.placement() == [1, 0]


def test_the_headroom_is_configurable(fake: FakeDriver, make_engine: Callable[..., Any]) -> None:
    fake.set_process_memory(0, 10 * GiB)
    fake.set_other_memory(1, H200_BYTES - 12 * GiB)
    engine = make_engine(memory_margin_bytes=3 * GiB)
    assert "plus 3.00 GiB headroom" in refused(engine, engine.gpus[1])
    assert_untouched(fake, engine)


def test_candidate_targets_most_free_memory_first(
    fake: FakeDriver, make_engine: Callable[..., Any], monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("FAKE_CUDA_GPUS", "4")
    fake.reset()
    fake.set_process_memory(0, 10 * GiB)
    fake.set_other_memory(1, 100 * GiB)
    fake.set_other_memory(2, 20 * GiB)
    fake.set_other_memory(3, H200_BYTES - 10 * GiB)  # no room
    engine = make_engine()
    candidates = engine.candidate_targets()
    assert [c.gpu.device for c in candidates] == ["cuda:2", "cuda:1"]
    assert [c.free_bytes for c in candidates] == [H200_BYTES - 20 * GiB, H200_BYTES - 100 * GiB]


IN_PLACE_ADVICE = (
    "free memory there, or resume it with a target, e.g. from the dashboard or `flexium resume JOB cuda:N`"
)


def test_resume_without_a_target_stays_on_its_gpu_when_that_filled_up(
    fake: FakeDriver, make_engine: Callable[..., Any], monkeypatch: pytest.MonkeyPatch
) -> None:
    """The server chooses the GPU (it always sends one when it has device reports); the engine
    only rules on its own, and never moves a resume elsewhere by itself."""
    monkeypatch.setenv("FAKE_CUDA_GPUS", "3")
    fake.reset()
    fake.set_process_memory(0, 30 * GiB)
    engine = make_engine()
    assert engine.pause().ok
    fake.set_other_memory(0, H200_BYTES - 10 * GiB)  # someone took GPU 0 meanwhile
    fake.set_other_memory(1, 50 * GiB)
    fake.set_other_memory(2, 20 * GiB)
    assert [c.gpu.device for c in engine.candidate_targets()] == ["cuda:2", "cuda:1"]
    fake.clear_log()
    with pytest.raises(TargetRefusedError) as caught:
        engine.resume()
    assert str(caught.value) == (
        "cuda:0 has 10.00 GiB free; the paused job needs 30.00 GiB plus 0.50 GiB headroom: it stays paused; "
        + IN_PLACE_ADVICE
    )
    assert fake.calls("cu") == []
    assert engine.state == EngineState.PAUSED and fake.state() == ProcessState.CHECKPOINTED
    result = engine.resume(engine.gpus[2])
    assert result.ok and result.target.device == "cuda:2"
    assert sorted(fake.last_pairs()) == [(0, 2), (1, 1), (2, 0)]
    on_gpu(fake, engine, 2)


def test_pause_refused_when_the_host_cannot_hold_the_memory(
    fake: FakeDriver, make_engine: Callable[..., Any], host_memory: HostMemory
) -> None:
    fake.set_process_memory(0, 6 * GiB)
    host_memory.available = 4 * GiB
    engine = make_engine()
    with pytest.raises(TargetRefusedError, match=r"pausing needs 7\.00 GiB of host memory .* has 4\.00 GiB available"):
        engine.pause()
    assert engine.state == EngineState.RUNNING and checkpoint_ops(fake) == []
    host_memory.available = 8 * GiB
    assert engine.pause().ok


def test_a_job_on_the_simulated_host_pauses_whatever_the_machine_s_memory(
    fake: FakeDriver, make_engine: Callable[..., Any], host_memory: HostMemory, monkeypatch: pytest.MonkeyPatch
) -> None:
    """On flexium's simulated host (flexium demo) the memory a job holds is a count (hold_job_memory): its
    pause stages nothing, so a machine with less memory than that still pauses it."""
    from flexium import simulated

    monkeypatch.setattr(simulated, "active", lambda: True)  # as a process whose FLEXIUM_LIBCUDA is the package's
    fake.set_process_memory(0, 74 * GiB)
    host_memory.available = 4 * GiB
    engine = make_engine()
    assert engine.pause().ok and engine.resume().ok


def test_resume_without_room_anywhere_stays_paused(fake: FakeDriver, make_engine: Callable[..., Any]) -> None:
    fake.set_process_memory(0, 30 * GiB)
    engine = make_engine()
    engine.pause()
    fake.set_other_memory(0, H200_BYTES - 10 * GiB)
    fake.set_other_memory(1, H200_BYTES - 10 * GiB)
    fake.clear_log()
    with pytest.raises(TargetRefusedError) as caught:
        engine.resume()
    assert str(caught.value) == (
        "cuda:0 has 10.00 GiB free; the paused job needs 30.00 GiB plus 0.50 GiB headroom: it stays paused; "
        + IN_PLACE_ADVICE
    )
    with pytest.raises(TargetRefusedError) as caught:
        engine.resume(engine.gpus[1])
    assert str(caught.value) == (
        "cuda:1 has 10.00 GiB free; the paused job needs 30.00 GiB plus 0.50 GiB headroom: it stays paused; "
        "free memory there or choose another GPU"
    )
    assert fake.calls("cu") == []
    assert engine.state == EngineState.PAUSED and fake.state() == ProcessState.CHECKPOINTED
    fake.set_other_memory(1, 0)
    with pytest.raises(TargetRefusedError, match="it stays paused"):
        engine.resume()  # room elsewhere is the server's to find: in place is still refused
    assert fake.calls("cu") == [] and engine.state == EngineState.PAUSED
    # Back where it was beside another process, what the driver restores needs headroom: that process may take more
    # before the restore, and a restore without room loses the job (fact `restore-without-room-loses-process`).
    fake.set_other_memory(0, H200_BYTES - 30 * GiB)
    with pytest.raises(TargetRefusedError, match="needs 30.00 GiB plus 0.50 GiB headroom: it stays paused"):
        engine.resume()
    assert fake.calls("cu") == [] and engine.state == EngineState.PAUSED
    fake.set_other_memory(0, H200_BYTES - 30 * GiB - 512 * MiB)
    assert engine.resume().target.device == "cuda:0"
    on_gpu(fake, engine, 0)


def test_a_job_that_filled_its_gpu_resumes_back_on_it_alone(fake: FakeDriver, make_engine: Callable[..., Any]) -> None:
    """Back where it was, on a GPU no other process uses, a job needs only what it held there: no
    headroom, or a job that filled its GPU could never come back to it."""
    engine = make_engine()
    fake.set_process_memory(0, H200_BYTES - 100 * MiB)
    assert engine.pause().ok
    assert engine.resume().target.device == "cuda:0"
    on_gpu(fake, engine, 0)


def test_resume_on_another_model_is_refused(
    fake: FakeDriver, make_engine: Callable[..., Any], monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("FAKE_CUDA_MODELS", "NVIDIA H200,NVIDIA H100 80GB HBM3")
    fake.reset()
    engine = make_engine()
    engine.pause()
    fake.clear_log()
    with pytest.raises(TargetRefusedError, match="the job was paused on a NVIDIA H200: resume needs the same model"):
        engine.resume(engine.gpus[1])
    assert fake.calls("cu") == [] and engine.state == EngineState.PAUSED


def test_resume_on_a_device_name_is_refused_and_the_job_stays_paused(
    fake: FakeDriver, make_engine: Callable[..., Any]
) -> None:
    engine = make_engine()
    engine.pause()
    fake.clear_log()
    with pytest.raises(TargetRefusedError, match=r"^target 'cuda:1' is not a GPU UUID: "):
        engine.resume("cuda:1")
    assert fake.calls("cu") == [] and engine.state == EngineState.PAUSED
    assert engine.resume(fake.uuid(1)).ok
    on_gpu(fake, engine, 1)
