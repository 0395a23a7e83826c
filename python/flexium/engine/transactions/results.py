"""An operation's result while it runs, and how a driver-path transaction settles the engine's
state from the way its locked section left the process."""

from __future__ import annotations

import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field

from flexium import _C
from flexium.engine.fast.device_moves import Staged
from flexium.engine.fast.path import FastPath
from flexium.engine.operations import EngineState, GpuIdentity, OperationKind, OperationResult, StepTiming
from flexium.engine.step_outcomes import describe_failure, first_failure, process_lost
from flexium.engine.transactions.context import OperationContext

GIB = 1 << 30


@dataclass
class ResultDraft:
    """Steps are added as they finish and notes as they are learnt; the clock runs from
    `started` until the result is built."""

    kind: OperationKind
    path: str  # "fast" or "driver"
    logical_device: str
    source: GpuIdentity
    target: GpuIdentity | None
    moved: int
    started: float
    notes: tuple[str, ...] = ()
    steps: list[StepTiming] = field(default_factory=list)

    def build(
        self,
        *,
        ok: bool = False,
        failed_step: str | None = None,
        error: str | None = None,
        notes: tuple[str, ...] = (),
    ) -> OperationResult:
        """The result now, with `notes` after the draft's own."""
        return OperationResult(
            kind=self.kind,
            path=self.path,
            ok=ok,
            logical_device=self.logical_device,
            source=self.source,
            target=self.target,
            steps=tuple(self.steps),
            bytes_moved=self.moved,
            seconds=time.perf_counter() - self.started,
            failed_step=failed_step,
            error=error,
            notes=(*self.notes, *notes),
        )


def settle(
    ctx: OperationContext,
    draft: ResultDraft,
    outcomes: Sequence[_C.StepOutcome],
    final: _C.ProcessState,
    *,
    succeeded: bool,
    on_success: EngineState,
    rolled_back: Mapping[_C.ProcessState, tuple[EngineState, str]],
    stuck: str = "",
) -> OperationResult:
    """The engine's state and the result's error from how the process ended up: where the
    operation wanted it, back where it was (rolled_back, by process state), or stuck."""
    if succeeded:
        ctx.set_state(on_success)
        return draft.build(ok=True)
    failure = first_failure(outcomes)
    lost = process_lost(outcomes) if final != _C.ProcessState.RUNNING else None
    if lost is not None:  # nothing to roll back to, whatever the state says
        stuck = f": {lost}"
    elif final in rolled_back:
        state, outcome = rolled_back[final]
        ctx.set_state(state)
        return draft.build(failed_step=failure.step, error=f"{describe_failure(failure)}; {outcome}")
    ctx.set_state(EngineState.FAILED)
    return draft.build(
        failed_step=failure.step,
        error=f"{describe_failure(failure)}; ROLLBACK FAILED: the process is {final.name}{stuck}",
    )


def copier_notes(fast: FastPath) -> tuple[str, ...]:
    """Says when the copies ran in this process because the copier failed, once."""
    why, fast.copier_fallback = fast.copier_fallback, ""
    return (f"the copies to and from host memory ran in this process: {why}",) if why else ()


def overlap_notes(fast: FastPath) -> tuple[str, ...]:
    """What the copy back beside the restore did, or why it was not made so, once."""
    overlap, why = fast.overlap, fast.overlap_fallback
    fast.overlap, fast.overlap_fallback = None, ""
    if why:
        return (f"copied back after the restore: the copier could not make the memory beside it ({why})",)
    return (overlap.note(),) if overlap is not None else ()


def note_copied(staged: Staged) -> str:
    return (
        f"fast path: copied {staged.copied_bytes / GIB:.2f} GiB in use of {staged.segment_bytes / GIB:.2f} GiB "
        f"in {len(staged.entries)} pool segments"
    )
