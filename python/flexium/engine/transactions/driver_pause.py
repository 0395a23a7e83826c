"""A pause on the driver path: the checkpoint takes all of the job's GPU memory into host memory
and the process stays checkpointed until a resume."""

from __future__ import annotations

import time

from flexium import _C
from flexium.engine.operations import EngineState, GpuIdentity, OperationKind, OperationResult
from flexium.engine.step_outcomes import timing_of
from flexium.engine.transactions import locked_section
from flexium.engine.transactions.context import OperationContext
from flexium.engine.transactions.own_memory import own_before_driver_checkpoint
from flexium.engine.transactions.results import ResultDraft, settle


def pause_by_driver(
    ctx: OperationContext, source: GpuIdentity, notes: tuple[str, ...], *, at_safe_point: bool
) -> OperationResult:
    started = time.perf_counter()
    owned = own_before_driver_checkpoint(ctx, OperationKind.PAUSE, at_safe_point)
    ctx.set_state(EngineState.PAUSING)
    prepare, moved, by_gpu = locked_section.prepare(ctx, OperationKind.PAUSE)
    outcomes = locked_section.run(ctx, locked_section.pause_steps(ctx))
    final = locked_section.process_state(ctx)
    succeeded = final == _C.ProcessState.CHECKPOINTED and not any(o.code for o in outcomes)
    if succeeded:
        ctx.paused_bytes = moved
        ctx.paused_by_gpu = by_gpu
    draft = ResultDraft(
        OperationKind.PAUSE,
        "driver",
        ctx.logical_device,
        source,
        None,
        moved,
        started,
        notes,
        steps=[*owned, prepare, *map(timing_of, outcomes)],
    )
    return settle(
        ctx,
        draft,
        outcomes,
        final,
        succeeded=succeeded,
        on_success=EngineState.PAUSED,
        rolled_back={
            _C.ProcessState.RUNNING: (EngineState.RUNNING, f"rolled back: the job runs on {source.device} as before")
        },
    )
