"""The locked section every transaction runs in one native call (csrc/checkpoint.cpp says why),
its step lists, and the preparation before it."""

from __future__ import annotations

import logging
import os
import time
from collections.abc import Mapping

from flexium import _C
from flexium.engine import nvml, torch_bridge
from flexium.engine.guards import pinning_gate, uncheckpointable_memory
from flexium.engine.identity import MovePlan
from flexium.engine.operations import EngineState, OperationKind, StepTiming
from flexium.engine.transactions.context import OperationContext
from flexium.errors import ConfigError, OperationFailedError

log = logging.getLogger("flexium")

# Pinning one batch takes milliseconds; a pin still under way after this is stuck elsewhere.
PIN_WAIT_S = 10.0
# How often the native layer names a checkpoint call that has not returned (csrc/slow_call_report.h).
REPORT_ENV = "FLEXIUM_DRIVER_CALL_REPORT_S"

Steps = tuple[list[_C.Step], list[list[_C.Step]]]  # the steps and each one's rollback


def check_report_setting() -> None:
    """Refuses a FLEXIUM_DRIVER_CALL_REPORT_S the native layer cannot read (it would report every
    60 s instead, unasked), naming what to give."""
    if _C.driver_call_report_setting() == 0:
        raise ConfigError(
            f"{REPORT_ENV}={os.environ.get(REPORT_ENV, '')!r} (from the environment) is not a whole number of "
            "seconds from 1 to 86400: give how often a checkpoint call that has not returned is reported, "
            "e.g. 60, or unset it"
        )


def prepare(ctx: OperationContext, kind: OperationKind) -> tuple[StepTiming, int, dict[str, int]]:
    """Before the lock; a failure here (a sticky CUDA error surfacing in synchronize, NVML
    gone, memory the driver cannot checkpoint made since the operation was taken up) touched nothing,
    so the job simply stays RUNNING. Returns the step and the bytes the operation moves, in all and
    by GPU UUID (OperationContext.held_now)."""
    started = time.perf_counter()
    try:
        torch_bridge.synchronize()
        torch_bridge.release_cached_memory()
        uncheckpointable = uncheckpointable_memory.problem()  # the last look, with the training thread stopped
        moved, by_gpu = ctx.held_now()
    except Exception as exc:
        ctx.set_state(EngineState.RUNNING)
        raise OperationFailedError(
            f"{kind.value} failed at phase 'prepare' before anything was locked: {type(exc).__name__}: {exc}",
            step="prepare",
        ) from exc
    if uncheckpointable is not None:
        ctx.set_state(EngineState.RUNNING)
        raise OperationFailedError(
            f"{kind.value} refused at phase 'prepare' before anything was locked: {uncheckpointable}", step="prepare"
        )
    return StepTiming("prepare", time.perf_counter() - started, ok=True), moved, by_gpu


def restore_step(plan: MovePlan) -> _C.Step:
    return _C.Step(_C.StepKind.RESTORE, pairs=[_C.GpuPair(old, new) for old, new in plan.pairs])


def migration_steps(ctx: OperationContext, plan: MovePlan) -> Steps:
    """A migration's locked section: a failed checkpoint or restore is recovered in place
    (fact `failed-restore-stays-checkpointed`), a failed unlock is tried again."""
    steps = [
        _C.Step(_C.StepKind.LOCK, timeout_ms=ctx.lock_timeout_ms),
        _C.Step(_C.StepKind.CHECKPOINT),
        restore_step(plan),
        _C.Step(_C.StepKind.UNLOCK),
    ]
    recover = [_C.Step(_C.StepKind.RECOVER)]
    return steps, [[], recover, recover, [_C.Step(_C.StepKind.UNLOCK)]]


def pause_steps(ctx: OperationContext) -> Steps:
    """A pause's locked section: a failed checkpoint is recovered in place."""
    steps = [_C.Step(_C.StepKind.LOCK, timeout_ms=ctx.lock_timeout_ms), _C.Step(_C.StepKind.CHECKPOINT)]
    return steps, [[], [_C.Step(_C.StepKind.RECOVER)]]


def resume_steps(plan: MovePlan) -> Steps:
    """A resume's: a failed restore leaves the process checkpointed (fact `failed-restore-stays-checkpointed`), still
    paused with nothing to undo; a failed unlock is tried again."""
    return [restore_step(plan), _C.Step(_C.StepKind.UNLOCK)], [[], [_C.Step(_C.StepKind.UNLOCK)]]


def run(
    ctx: OperationContext, steps: Steps, *, hold_gil: bool = False, room: Mapping[str, int] | None = None
) -> list[_C.StepOutcome]:
    """Runs a locked section; NVML queries go elsewhere and batches wait to be pinned until the
    process runs again. `room`: free bytes each GPU (by UUID) must still have just before the
    restore, asked of the NVML reader from inside the section (csrc/room_check.h); a GPU without
    them fails the section there, before the restore, with the restore's rollback."""
    if not pinning_gate.GATE.close(PIN_WAIT_S):
        log.warning("a DataLoader thread was still pinning a batch after %.0f s; locking anyway", PIN_WAIT_S)
    nvml.set_frozen(True)
    try:
        with nvml.reader_pipes() as pipes:
            if room and pipes is not None:
                steps = _with_room_checks(steps, room, pipes)
            outcomes = list(_C.run_steps(ctx.pid, *steps, hold_gil=hold_gil))
    finally:
        running = _C.process_state(ctx.pid) == _C.ProcessState.RUNNING
        nvml.set_frozen(not running)
        if running:
            pinning_gate.GATE.open()
    if ctx.fast is not None and any(o.step == "restore" and o.code == 0 for o in outcomes):
        # What the driver carried through its checkpoint comes back unexportable (fact `restored-memory-unexportable`).
        _C.vmm_mark_restored_by_driver()
    return outcomes


def _with_room_checks(steps: Steps, room: Mapping[str, int], pipes: tuple[int, int]) -> Steps:
    """The steps with a room check per GPU inserted before the restore, each undone as the restore is."""
    calls, rollbacks = steps
    at = next(i for i, step in enumerate(calls) if step.kind == _C.StepKind.RESTORE)
    checks = [_C.room_check_step(pipes[0], pipes[1], uuid, needed) for uuid, needed in room.items()]
    undo = rollbacks[at] if at < len(rollbacks) else []
    return [*calls[:at], *checks, *calls[at:]], [*rollbacks[:at], *([undo] * len(checks)), *rollbacks[at:]]


def process_state(ctx: OperationContext) -> _C.ProcessState:
    return _C.process_state(ctx.pid)
