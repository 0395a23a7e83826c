"""A migration on the driver path: the checkpoint carries all of the job's GPU memory and the
restore puts it on the target."""

from __future__ import annotations

import time

from flexium import _C
from flexium.engine.identity import MovePlan
from flexium.engine.operations import EngineState, OperationKind, OperationResult
from flexium.engine.step_outcomes import own_restore_succeeded, timing_of
from flexium.engine.transactions import locked_section
from flexium.engine.transactions.context import OperationContext
from flexium.engine.transactions.own_memory import own_before_driver_checkpoint
from flexium.engine.transactions.results import ResultDraft, settle


def migrate_by_driver(
    ctx: OperationContext, plan: MovePlan, notes: tuple[str, ...], *, at_safe_point: bool, headroom: int
) -> OperationResult:
    started = time.perf_counter()
    own = plan.of(ctx.logical)  # the job's device: the result names its move
    source, dest = own.source, own.target
    owned = own_before_driver_checkpoint(ctx, OperationKind.MIGRATE, at_safe_point)
    ctx.set_state(EngineState.MIGRATING)
    prepare, moved, by_gpu = locked_section.prepare(ctx, OperationKind.MIGRATE)
    # The checkpoint of a large job takes seconds, in which another process may take a target's
    # memory; a restore without room would lose the job (fact `restore-without-room-loses-process`). So each target is
    # looked at again just before the restore, by the rule the target check applied.
    room = {new: by_gpu[old] + headroom for old, new in plan.pairs if old != new and by_gpu.get(old, 0) > 0}
    outcomes = locked_section.run(ctx, locked_section.migration_steps(ctx, plan), room=room)
    final = locked_section.process_state(ctx)
    restored = own_restore_succeeded(outcomes)
    if restored:
        ctx.identity.apply(plan)  # its memory is on the target now, whatever follows
    where = dest if restored else source
    draft = ResultDraft(
        OperationKind.MIGRATE,
        "driver",
        ctx.logical_device,
        source,
        dest,
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
        succeeded=final == _C.ProcessState.RUNNING and restored,
        on_success=EngineState.RUNNING,
        rolled_back={
            _C.ProcessState.RUNNING: (
                EngineState.RUNNING,
                f"rolled back: the job runs on {source.device} ({source.uuid}) as before",
            )
        },
        stuck=f", not RUNNING, its memory on {where.device} ({where.uuid})",
    )
