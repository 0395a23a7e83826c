"""Operations at safe points, with a real (CPU) torch optimizer over the fake driver: a request
from another thread runs on the training thread at the end of optimizer.step(); pause parks that
thread until resume; without optimizer steps the caller's thread runs the operation after
safe_point_wait_seconds. Which thread made each driver call comes from the fake's call log.
Also: NVML goes to a child process while this process is frozen (the real child path)."""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Iterator
from typing import Any

import pytest

torch = pytest.importorskip("torch")

from flexium.engine import EngineState, nvml  # noqa: E402
from flexium.errors import InvalidStateError, OperationFailedError, OperationInProgressError  # noqa: E402
from support.engine import (  # noqa: E402,F401  (fixtures)
    Background,
    ChildReads,
    GiB,
    checkpoint_ops,
    driver,
    fake,
    make_engine,
    nvml_in_parent,
    wait_until,
)
from support.fake_driver import FakeDriver, ProcessState  # noqa: E402


class Trainer(threading.Thread):
    """A plain training loop on CPU tensors. `gate`, when given, must be set for each step."""

    def __init__(self, max_steps: int | None = None, gate: threading.Event | None = None) -> None:
        super().__init__(daemon=True, name="trainer")
        torch.manual_seed(0)
        self.model = torch.nn.Linear(8, 1)
        self.optimizer = torch.optim.SGD(self.model.parameters(), lr=0.05)
        self.data = torch.randn(64, 8)
        self.labels = self.data.sum(dim=1, keepdim=True)
        self.max_steps = max_steps
        self.gate = gate
        self.steps = 0
        self.losses: list[float] = []
        self.tid = 0
        self.error: BaseException | None = None
        self.stopping = threading.Event()

    def run(self) -> None:
        self.tid = threading.get_native_id()
        try:
            while not self.stopping.is_set() and (self.max_steps is None or self.steps < self.max_steps):
                if self.gate is not None:
                    if not self.gate.wait(0.05):
                        continue
                    self.gate.clear()
                loss = torch.nn.functional.mse_loss(self.model(self.data), self.labels)
                self.optimizer.zero_grad()
                loss.backward()
                self.optimizer.step()
                self.losses.append(float(loss.detach()))
                self.steps += 1
                time.sleep(0.001)
        except BaseException as exc:
            self.error = exc

    def stop(self) -> None:
        self.stopping.set()
        if self.gate is not None:
            self.gate.set()
        self.join(2)


@pytest.fixture
def trainers() -> Iterator[Callable[..., Trainer]]:
    started: list[Trainer] = []

    def start(**kwargs: Any) -> Trainer:
        trainer = Trainer(**kwargs)
        trainer.start()
        started.append(trainer)
        return trainer

    yield start
    for trainer in started:
        trainer.stop()
        assert trainer.error is None, trainer.error


def driver_call_threads(fake: FakeDriver) -> set[int]:
    """Native ids of the threads that made the state-changing checkpoint calls."""
    return {c.tid for c in fake.calls("cuCheckpointProcess") if not c.function.endswith(("GetState", "ThreadId"))}


def parked(engine: Any) -> bool:
    return bool(engine._parking.occupied)


# ----------------------------------------------------------------------------- at the end of optimizer.step()


@pytest.mark.usefixtures("nvml_in_parent")
def test_a_migration_requested_elsewhere_runs_on_the_training_thread(
    fake: FakeDriver, make_engine: Callable[..., Any], trainers: Callable[..., Trainer]
) -> None:
    fake.set_process_memory(0, 2 * GiB)
    engine = make_engine(safe_point_wait_seconds=5.0)
    where: list[tuple[int, bool]] = []
    engine.add_state_listener(
        lambda state: (
            where.append((threading.get_ident(), engine._safe_points.in_safe_point()))
            if state == EngineState.MIGRATING
            else None
        )
    )
    trainer = trainers()
    wait_until(lambda: trainer.steps >= 3, what="training to start")

    result = engine.migrate(engine.gpus[1])

    assert result.ok
    assert where == [(trainer.ident, True)]  # inside the optimizer step hook of the training thread
    assert driver_call_threads(fake) == {trainer.tid}
    assert checkpoint_ops(fake) == ["Lock", "Checkpoint", "Restore", "Unlock"]
    assert fake.blocked_calls() == 0 and fake.deadlocks() == 0
    assert fake.placement() == [1, 0] and engine.placement()[1].device == "cuda:1"
    steps = trainer.steps
    wait_until(lambda: trainer.steps > steps + 3, what="training to go on after the migration")
    assert trainer.losses[-1] < trainer.losses[0]


@pytest.mark.usefixtures("nvml_in_parent")
def test_pause_parks_the_training_thread_until_resume(
    fake: FakeDriver, make_engine: Callable[..., Any], trainers: Callable[..., Trainer]
) -> None:
    fake.set_process_memory(0, 2 * GiB)
    engine = make_engine(safe_point_wait_seconds=5.0)
    trainer = trainers()
    wait_until(lambda: trainer.steps >= 3, what="training to start")

    paused = engine.pause()
    assert paused.ok and engine.state == EngineState.PAUSED
    assert fake.state() == ProcessState.CHECKPOINTED and fake.used_bytes(0) == 0
    assert driver_call_threads(fake) == {trainer.tid}
    wait_until(lambda: parked(engine), what="the training thread to park")
    steps = trainer.steps
    time.sleep(0.2)
    assert trainer.steps == steps, "no optimizer step may run while paused"
    assert trainer.is_alive()

    fake.clear_log()
    resumed = engine.resume()
    assert resumed.ok
    assert driver_call_threads(fake) == {trainer.tid}  # the parked thread resumed itself
    assert checkpoint_ops(fake) == ["Restore", "Unlock"]
    assert engine.state == EngineState.RUNNING and fake.state() == ProcessState.RUNNING
    wait_until(lambda: trainer.steps > steps + 2, what="training to go on after resume")
    assert not parked(engine)


@pytest.mark.usefixtures("nvml_in_parent")
def test_a_parked_job_resumes_on_another_gpu(
    fake: FakeDriver, make_engine: Callable[..., Any], trainers: Callable[..., Trainer]
) -> None:
    fake.set_process_memory(0, 2 * GiB)
    engine = make_engine(safe_point_wait_seconds=5.0)
    trainer = trainers()
    wait_until(lambda: trainer.steps >= 2, what="training to start")
    engine.pause()
    wait_until(lambda: parked(engine), what="the training thread to park")
    fake.clear_log()
    result = engine.resume(engine.gpus[1])
    assert result.ok and result.target.device == "cuda:1"
    assert driver_call_threads(fake) == {trainer.tid}
    assert fake.placement() == [1, 0] and fake.process_bytes_on(1) == 2 * GiB
    steps = trainer.steps
    wait_until(lambda: trainer.steps > steps, what="training to go on")


@pytest.mark.usefixtures("nvml_in_parent")
def test_a_failed_resume_keeps_the_thread_parked(
    fake: FakeDriver, make_engine: Callable[..., Any], trainers: Callable[..., Trainer]
) -> None:
    engine = make_engine(safe_point_wait_seconds=5.0)
    trainer = trainers()
    wait_until(lambda: trainer.steps >= 2, what="training to start")
    engine.pause()
    wait_until(lambda: parked(engine), what="the training thread to park")
    fake.fail("cuCheckpointProcessRestore", "CUDA_ERROR_INVALID_VALUE")  # refused for its arguments: restorable
    with pytest.raises(OperationFailedError, match="still paused"):
        engine.resume()
    steps = trainer.steps
    time.sleep(0.1)
    assert parked(engine) and trainer.steps == steps
    assert engine.resume().ok
    wait_until(lambda: trainer.steps > steps, what="training to go on")


@pytest.mark.usefixtures("nvml_in_parent")
def test_a_failure_at_the_safe_point_reaches_the_caller_and_training_goes_on(
    fake: FakeDriver, make_engine: Callable[..., Any], trainers: Callable[..., Trainer]
) -> None:
    fake.set_lock_delay_ms(1000)
    engine = make_engine(safe_point_wait_seconds=5.0, lock_timeout_ms=30)
    trainer = trainers()
    wait_until(lambda: trainer.steps >= 2, what="training to start")
    with pytest.raises(OperationFailedError) as caught:
        engine.migrate(engine.gpus[1])
    assert caught.value.step == "lock" and "CUDA_ERROR_TIMEOUT" in str(caught.value)
    assert driver_call_threads(fake) == {trainer.tid}
    assert engine.state == EngineState.RUNNING and fake.placement() == [0, 1]
    steps = trainer.steps
    wait_until(lambda: trainer.steps > steps, what="training to go on")


@pytest.mark.usefixtures("nvml_in_parent")
def test_an_operation_waiting_for_a_safe_point_blocks_a_second_one(
    fake: FakeDriver, make_engine: Callable[..., Any], trainers: Callable[..., Trainer]
) -> None:
    gate = threading.Event()
    engine = make_engine(safe_point_wait_seconds=5.0)
    trainer = trainers(gate=gate)
    gate.set()
    wait_until(lambda: trainer.steps == 1, what="one step")
    # The trainer is between steps (waiting on the gate): the migration waits for its next step.
    migration = Background(lambda: engine.migrate(engine.gpus[1]))
    migration.start()
    wait_until(lambda: engine._safe_points._pending is not None, what="the request to be queued")
    with pytest.raises(OperationInProgressError):
        engine.pause()
    assert fake.calls("cuCheckpointProcessLock") == []
    gate.set()  # the next step comes
    assert migration.join_result().ok
    assert driver_call_threads(fake) == {trainer.tid}
    assert fake.placement() == [1, 0]


# ----------------------------------------------------------------------------- without a safe point


@pytest.mark.usefixtures("nvml_in_parent")
def test_without_any_optimizer_step_the_caller_runs_the_operation_at_once(
    fake: FakeDriver, make_engine: Callable[..., Any]
) -> None:
    engine = make_engine(safe_point_wait_seconds=5.0)
    started = time.monotonic()
    caller = Background(lambda: (threading.get_native_id(), engine.migrate(engine.gpus[1])))
    caller.start()
    native_id, result = caller.join_result()
    assert result.ok
    assert time.monotonic() - started < 2.0  # no wait for a step that never comes
    assert driver_call_threads(fake) == {native_id}


@pytest.mark.usefixtures("nvml_in_parent")
def test_when_steps_stop_the_caller_runs_the_operation_after_the_wait(
    fake: FakeDriver, make_engine: Callable[..., Any], trainers: Callable[..., Trainer]
) -> None:
    engine = make_engine(safe_point_wait_seconds=0.25)
    assert engine.safe_point_wait_seconds == 0.25
    trainer = trainers(max_steps=3)
    trainer.join(5)
    assert trainer.steps == 3 and not trainer.is_alive()
    started = time.monotonic()
    result = engine.migrate(engine.gpus[1])
    elapsed = time.monotonic() - started
    assert result.ok
    assert 0.25 <= elapsed < 2.0
    assert driver_call_threads(fake) == {threading.get_native_id()}
    # A pause the same way: no thread to park, the caller gets control back.
    paused = engine.pause()
    assert paused.ok and not parked(engine)
    assert engine.resume().ok
    assert fake.state() == ProcessState.RUNNING


@pytest.mark.usefixtures("nvml_in_parent")
def test_pause_from_the_training_thread_is_refused(fake: FakeDriver, make_engine: Callable[..., Any]) -> None:
    engine = make_engine(safe_point_wait_seconds=0.1)
    model = torch.nn.Linear(2, 1)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    model(torch.ones(1, 2)).sum().backward()
    optimizer.step()  # this thread is now the training thread
    fake.clear_log()
    with pytest.raises(InvalidStateError) as caught:
        engine.pause()
    assert str(caught.value) == (
        "pause() was called from the training thread: it would block at its next CUDA call until resume(); "
        "call pause() from another thread (the flexium control thread does)"
    )
    assert fake.calls("cu") == []
    assert engine.state == EngineState.RUNNING
    # From another thread it works (after the bounded wait: this thread makes no step meanwhile).
    other = Background(engine.pause)
    other.start()
    assert other.join_result().ok and engine.state == EngineState.PAUSED
    assert engine.resume().ok


@pytest.mark.usefixtures("nvml_in_parent")
def test_after_stop_no_operation_waits_for_the_optimizer(
    fake: FakeDriver, make_engine: Callable[..., Any], trainers: Callable[..., Trainer]
) -> None:
    engine = make_engine(safe_point_wait_seconds=5.0)
    trainer = trainers()
    wait_until(lambda: trainer.steps >= 2, what="training to start")
    engine.stop()
    assert engine.migrate(engine.gpus[1]).ok
    assert driver_call_threads(fake) == {threading.get_native_id()}


@pytest.mark.usefixtures("nvml_in_parent")
def test_stop_runs_a_pause_waiting_for_a_safe_point_at_once_then_resumes_it_before_going_on(
    fake: FakeDriver, make_engine: Callable[..., Any], trainers: Callable[..., Trainer]
) -> None:
    """flexium.shutdown() while a pause waits for the training thread's next step, which will not
    come: the pause runs at once on its caller's thread, and stop waits for it (what stop tears
    down is what it uses), then resumes the job in place."""
    fake.set_process_memory(0, GiB)
    gate = threading.Event()
    engine = make_engine(safe_point_wait_seconds=30.0)
    trainer = trainers(gate=gate)
    gate.set()
    wait_until(lambda: trainer.steps == 1, what="one step")
    pause = Background(engine.pause)
    pause.start()
    wait_until(lambda: engine._safe_points._pending is not None, what="the pause to wait for a safe point")
    started = time.monotonic()
    engine.stop()
    assert time.monotonic() - started < 10.0  # not the 30 s safe-point wait
    result = pause.join_result()
    assert result.ok and result.kind.value == "pause"
    assert engine.state == EngineState.RUNNING and fake.state() == ProcessState.RUNNING
    assert trainer.tid not in driver_call_threads(fake)


# ----------------------------------------------------------------------------- NVML while frozen (real child)


def test_nvml_child_process_reports_what_this_process_reads(fake: FakeDriver, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("FAKE_CUDA_GPUS", "3")  # the child inherits it, and FLEXIUM_LIBNVML
    monkeypatch.setenv("FAKE_CUDA_MODELS", "NVIDIA H200,NVIDIA H200,NVIDIA H100 80GB HBM3")
    fake.reset()
    here = nvml.host_gpus()
    assert [g.uuid for g in here] == fake.uuids() and here[2].name == "NVIDIA H100 80GB HBM3"
    fake.clear_log()
    nvml.set_frozen(True)
    try:
        there = nvml.host_gpus()
    finally:
        nvml.set_frozen(False)
    assert fake.call_count("nvmlDeviceGetCount_v2") == 0, "read in this process although frozen"
    assert there == here
    assert nvml.gpu_by_uuid(fake.uuid(1)) == here[1]


def test_pause_and_resume_read_nvml_only_in_a_child_while_frozen(
    fake: FakeDriver, make_engine: Callable[..., Any]
) -> None:
    engine = make_engine()
    assert engine.pause().ok
    fake.clear_log()  # also zeroes the fake's per-function call counters
    assert engine.process_bytes() == 0
    result = engine.resume(engine.gpus[1])  # checks room on cuda:1 through NVML first
    assert result.ok
    for function in ("nvmlDeviceGetCount_v2", "nvmlDeviceGetMemoryInfo", "nvmlDeviceGetComputeRunningProcesses_v3"):
        assert fake.call_count(function) == 0, function
    assert fake.placement() == [1, 0]
    fake.clear_log()
    nvml.host_gpus()
    assert fake.call_count("nvmlDeviceGetCount_v2") >= 1  # running again: read here


def test_nvml_reads_while_frozen_are_counted_by_the_fixture(
    fake: FakeDriver, make_engine: Callable[..., Any], nvml_in_parent: ChildReads
) -> None:
    """The in-parent stand-in used by the other tests is taken exactly when the engine froze
    the process, and from the thread asking."""
    engine = make_engine()
    engine.migrate(engine.gpus[1])
    assert nvml_in_parent.count == 0  # nothing read NVML while locked
    engine.pause()
    engine.candidate_targets()
    assert nvml_in_parent.count >= 1 and set(nvml_in_parent.threads) == {threading.get_ident()}


@pytest.mark.usefixtures("nvml_in_parent")
def test_stop_resumes_a_parked_job_on_its_own_thread(
    fake: FakeDriver, make_engine: Callable[..., Any], trainers: Callable[..., Trainer]
) -> None:
    fake.set_process_memory(0, GiB)
    engine = make_engine(safe_point_wait_seconds=5.0)
    trainer = trainers()
    wait_until(lambda: trainer.steps >= 2, what="training to start")
    engine.pause()
    wait_until(lambda: parked(engine), what="the training thread to park")
    fake.clear_log()
    engine.stop()  # what flexium.shutdown() does
    assert engine.state == EngineState.RUNNING and fake.state() == ProcessState.RUNNING
    assert driver_call_threads(fake) == {trainer.tid}
    steps = trainer.steps
    wait_until(lambda: trainer.steps > steps, what="training to go on")


@pytest.mark.usefixtures("nvml_in_parent")
def test_resume_right_after_pause_never_strands_the_training_thread(
    fake: FakeDriver, make_engine: Callable[..., Any], trainers: Callable[..., Trainer]
) -> None:
    """resume() may come before the paused training thread has parked; it must neither hang nor
    leave the thread parked."""
    engine = make_engine(safe_point_wait_seconds=5.0)
    trainer = trainers()
    for round_ in range(8):
        steps = trainer.steps
        wait_until(lambda: trainer.steps > steps, what=f"a step before round {round_}")  # noqa: B023  (waited on here)
        assert engine.pause().ok
        assert engine.resume(engine.gpus[1] if round_ % 2 == 0 else engine.gpus[0]).ok
        assert engine.state == EngineState.RUNNING and fake.state() == ProcessState.RUNNING
    steps = trainer.steps
    wait_until(lambda: trainer.steps > steps + 2, what="training to go on")
    assert not parked(engine)
    assert fake.placement() == [0, 1]


@pytest.mark.usefixtures("nvml_in_parent")
def test_a_resume_whose_restore_failed_otherwise_says_the_job_may_be_lost_and_the_next_says_it_is(
    fake: FakeDriver, make_engine: Callable[..., Any]
) -> None:
    """Every restore failure measured but a refused argument left the process unrestorable (the
    simulated driver does the same): the first failure cannot know it, and says what the next resume
    will show; that one says the job is lost."""
    engine = make_engine(safe_point_wait_seconds=0.1)
    assert engine.pause().ok
    fake.fail("cuCheckpointProcessRestore", "CUDA_ERROR_UNKNOWN")
    with pytest.raises(OperationFailedError) as first:
        engine.resume()
    assert "resume it once more; if that fails with CUDA_ERROR_OPERATING_SYSTEM, the job is lost" in str(first.value)
    with pytest.raises(OperationFailedError) as second:
        engine.resume()
    assert "CUDA_ERROR_OPERATING_SYSTEM" in str(second.value) and "can never run CUDA again" in str(second.value)
