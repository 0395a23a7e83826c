"""This rank's part in a whole-job pause, resume or migration, from the command to its result
(`Engine.run_job_operation` is the entry; job_operation.py is the protocol the ranks run
together). Before anything changes, the rank refuses what concerns it alone (its job, its target,
its room, its memory, the capabilities: the same checks as one process's operations) and aborts
the operation for every rank when it does; NCCL ranks check their placement together. Then the
protocol runs at the agreed stop step on the training thread, or, for a resume, on the thread
the pause parked.

Functions over the OperationContext, like the transactions, and over `RankEngine`: the few
things of the engine a rank's part uses (Engine implements it).
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import Protocol

from flexium.engine import target_rules
from flexium.engine.capabilities import Capabilities
from flexium.engine.distributed import job_operation, membership, nccl
from flexium.engine.distributed.job_operation import Deadlines, JobOperation, RankActions
from flexium.engine.distributed.rendezvous import JobAborted, Rendezvous, job_store
from flexium.engine.guards import uncheckpointable_memory
from flexium.engine.identity import MovePlan
from flexium.engine.operations import GpuIdentity, OperationKind, OperationResult, PathChoice
from flexium.engine.safe_point import SafePointMissed
from flexium.engine.transactions.context import OperationContext
from flexium.engine.transactions.driver_pause import pause_by_driver
from flexium.engine.transactions.fast_pause import StagingPlan
from flexium.engine.transactions.resume import resume
from flexium.errors import CapabilityError

log = logging.getLogger("flexium")


class RankEngine(Protocol):
    """What a rank's part asks of its engine: the checks and transactions one process's
    operations use, so that a rank is held to the same rules."""

    @property
    def capabilities(self) -> Capabilities: ...

    @property
    def memory_margin_bytes(self) -> int: ...

    def migrate_now(
        self, plan: MovePlan, path: PathChoice, notes: tuple[str, ...], *, at_safe_point: bool
    ) -> OperationResult: ...

    def pause_now(
        self, source: GpuIdentity, path: PathChoice, staging: StagingPlan, *, at_safe_point: bool
    ) -> OperationResult: ...

    def prepare_host_staging(self, path: PathChoice, source: GpuIdentity) -> StagingPlan: ...

    def copier_off_gpu(self) -> None: ...

    def park_while_paused(self, result: OperationResult) -> None: ...

    def run_where_parked(self, work: Callable[[], OperationResult]) -> OperationResult: ...


def run_job_operation(
    ctx: OperationContext, engine: RankEngine, op: JobOperation, path: PathChoice, limits: Deadlines
) -> OperationResult:
    """This rank's part in `op`; blocks until every rank is done. Raises when this rank refuses
    its part (having told the others); otherwise the result, with the protocol's steps around
    this rank's transaction."""
    job = membership.describe()
    problem = job_operation.refusal(job, op)
    if problem is not None:
        if job.initialized:  # the other ranks need not wait out their deadline for this one
            _give_up_for_all(op, f"refused: {problem}")
        raise CapabilityError(f"cannot {op.kind.value} the job: {problem}")
    rv = _rendezvous(op)
    try:
        lands_on = _lands_on(ctx, op)
    except Exception as exc:  # this rank refuses its part: the others need not wait for it
        rv.abort(f"refused: {exc}")
        raise
    if job.uses_nccl:
        try:
            problem = job_operation.shared_gpu_problem(rv, ctx.source, lands_on, deadline_s=limits.agree_s)
        except JobAborted as exc:
            untouched = RankActions(source=ctx.source, logical_device=ctx.logical_device)
            return job_operation.untouched(
                op.kind, untouched, f"the job's ranks did not meet, nothing changed: {exc}", "placement"
            )
        if problem is not None:  # every rank reads the same placements, so every rank refuses
            raise CapabilityError(f"cannot {op.kind.value} the job: {problem}")
    try:
        actions = _rank_actions(ctx, engine, op, path, lands_on)
    except Exception as exc:
        rv.abort(f"refused: {exc}")
        raise
    if op.kind == OperationKind.RESUME:
        return _resume_job(ctx, engine, op, rv, actions, limits)
    return _at_stop_step(ctx, engine, op, rv, actions, limits)


def _lands_on(ctx: OperationContext, op: JobOperation) -> GpuIdentity | None:
    """The GPU the driver restores this rank on in `op`: where it is (a pause), its target (a
    resume or a move), where it paused (a resume in place); None for a rank a migration
    leaves where it is, which is never checkpointed."""
    if op.kind == OperationKind.PAUSE or (op.kind == OperationKind.RESUME and op.target is None):
        return ctx.source
    return None if op.target is None else ctx.identity.resolve(op.target)


def _rank_actions(
    ctx: OperationContext, engine: RankEngine, op: JobOperation, path: PathChoice, lands_on: GpuIdentity | None
) -> RankActions:
    """This rank's checks before the operation (as for one process) and what it will do."""
    if op.kind == OperationKind.PAUSE or (op.kind == OperationKind.MIGRATE and lands_on is not None):
        uncheckpointable_memory.refuse(op.kind)  # only a rank the driver checkpoints
    capabilities = engine.capabilities
    if op.kind in (OperationKind.PAUSE, OperationKind.RESUME):
        capabilities.require(capabilities.pause_resume, op.kind.value)
    if op.target is not None or op.kind == OperationKind.MIGRATE:
        capabilities.require(capabilities.migration, "migration to another GPU")
    source = ctx.source
    margin = engine.memory_margin_bytes
    actions = RankActions(source=source, logical_device=ctx.logical_device)
    if op.kind == OperationKind.RESUME:
        assert lands_on is not None
        dest = lands_on
        target_rules.check_resume(
            ctx, source, dest, in_place=op.target is None, margin=margin, can_migrate=capabilities.migration
        )
        actions.resume = lambda: resume(ctx, ctx.plan_to(dest))
        actions.pause_again = lambda: pause_by_driver(
            ctx, ctx.source, ("paused again: the job's other ranks could not resume",), at_safe_point=True
        )
    elif op.kind == OperationKind.MIGRATE and lands_on is not None:
        dest = lands_on
        notes = target_rules.check_move(ctx, source, dest, needed=target_rules.bytes_on(ctx, source), margin=margin)
        engine.copier_off_gpu()
        actions.move = lambda: engine.migrate_now(ctx.plan_to(dest), path, notes, at_safe_point=True)
        actions.move_back = lambda: engine.migrate_now(ctx.plan_to(source), path, ("moving back",), at_safe_point=True)
    elif op.kind == OperationKind.PAUSE:
        staging = engine.prepare_host_staging(path, source)
        actions.pause = lambda: engine.pause_now(source, path, staging, at_safe_point=True)
        actions.resume_in_place = lambda: resume(ctx, ctx.plan_to(source))
    return actions


def _at_stop_step(
    ctx: OperationContext,
    engine: RankEngine,
    op: JobOperation,
    rv: Rendezvous,
    actions: RankActions,
    limits: Deadlines,
) -> OperationResult:
    """A pause or migration: the ranks agree on a stop step, and the protocol runs there on the
    training thread; a pause that succeeds keeps the communicators it suspended for its resume."""
    agreement = job_operation.StepAgreement(rv, deadline_s=limits.agree_s)

    def at_stop_step() -> OperationResult:
        communicators: list[nccl.Communicator] = []

        def find() -> list[nccl.Communicator]:
            communicators.extend(nccl.communicators())
            return communicators

        result = job_operation.migrate_or_pause(
            op, rv, actions, limits, find_communicators=find, stop_step=agreement.stop_at
        )
        if op.kind == OperationKind.PAUSE and result.ok:
            ctx.suspended_communicators = communicators
        return result

    park = engine.park_while_paused if op.kind == OperationKind.PAUSE else None
    try:
        # Longer than the agreement's own deadline, which names the ranks that are late.
        wait = limits.agree_s + limits.meet_s
        return ctx.safe_points.run_when(at_stop_step, ready=agreement.ready, deadline_s=wait, then=park)
    except (SafePointMissed, JobAborted) as exc:
        if isinstance(exc, SafePointMissed):
            rv.abort(f"{exc}")
        if op.kind == OperationKind.PAUSE and ctx.fast is not None:
            ctx.fast.done_with_host()
        return job_operation.untouched(
            op.kind, actions, f"the job's ranks did not agree on a step, nothing changed: {exc}", "agree"
        )


def _resume_job(
    ctx: OperationContext,
    engine: RankEngine,
    op: JobOperation,
    rv: Rendezvous,
    actions: RankActions,
    limits: Deadlines,
) -> OperationResult:
    suspended = ctx.suspended_communicators

    def work() -> OperationResult:
        return job_operation.resume(op, rv, actions, limits, find_communicators=lambda: suspended)

    result = engine.run_where_parked(work)
    if result.ok:
        ctx.suspended_communicators = []
    return result


def _rendezvous(op: JobOperation) -> Rendezvous:
    """The meetings of `op` in the job's store, as this rank."""
    return Rendezvous(job_store(), op.operation_id, rank=op.rank, world_size=op.world_size)


def _give_up_for_all(op: JobOperation, reason: str) -> None:
    """Aborts `op` for every rank of the job (Rendezvous.abort); a store that cannot be reached
    leaves them to their deadline, as before."""
    try:
        _rendezvous(op).abort(reason)
    except Exception as exc:  # the refusal stands whatever the store does
        log.debug("could not tell the job's other ranks that this one refused: %s: %s", type(exc).__name__, exc)
