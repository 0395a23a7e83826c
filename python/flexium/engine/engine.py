"""The engine: migrate / pause / resume of this process, each a transaction on the driver
checkpoint API (engine/transactions/, one module each), and this rank's part in a whole-job
operation (engine/distributed/rank_part.py).

The engine owns the lifecycle, the choice of path and the dispatch to a transaction at a safe
point; the last-word checks before anything is touched are target_rules.py's (same model, room on
the target, host memory for a pause) and guards/ (memory the driver cannot checkpoint). Every
operation ends with the process RUNNING on its source GPU, RUNNING on its target, or (pause,
failed resume) checkpointed and paused. Anything else raises RollbackFailedError and is logged at
CRITICAL.

Two paths: the fast path (engine/fast/) moves the memory pool's segments itself at a safe point
and leaves the driver only the rest; the driver path lets the checkpoint carry everything. The
fast path runs when the pool is in use and a safe point comes within the bounded wait; otherwise,
or when asked, the driver path does.
"""

from __future__ import annotations

import contextlib
import logging
import os
import threading
from collections.abc import Callable, Iterator, Mapping, Sequence

from flexium.engine import nvml, target_rules
from flexium.engine.capabilities import Capabilities
from flexium.engine.distributed import cuda_graphs, job_operation, membership, rank_part
from flexium.engine.distributed.job_operation import Deadlines, JobOperation
from flexium.engine.fast.kept_staging import StagingKeeper
from flexium.engine.fast.path import FastPath, memory_elsewhere
from flexium.engine.guards import pinning_gate, uncheckpointable_memory
from flexium.engine.identity import IdentityMap, MovePlan, Target
from flexium.engine.operations import PATHS, EngineState, GpuIdentity, OperationKind, OperationResult, PathChoice
from flexium.engine.parking import Parking
from flexium.engine.safe_point import SafePoints
from flexium.engine.target_rules import DEFAULT_MEMORY_MARGIN_BYTES, TargetCandidate
from flexium.engine.transactions.context import OperationContext, StateListener
from flexium.engine.transactions.driver_migrate import migrate_by_driver
from flexium.engine.transactions.driver_pause import pause_by_driver
from flexium.engine.transactions.fast_migrate import migrate_fast
from flexium.engine.transactions.fast_pause import StagingPlan, pause_fast, prepare_host_staging
from flexium.engine.transactions.own_memory import own_in_slices
from flexium.engine.transactions.resume import resume
from flexium.errors import (
    CapabilityError,
    InvalidStateError,
    OperationFailedError,
    OperationInProgressError,
    RollbackFailedError,
    TargetRefusedError,
)

log = logging.getLogger("flexium")

DEFAULT_LOCK_TIMEOUT_MS = 30_000
DEFAULT_SAFE_POINT_WAIT_SECONDS = 5.0
# How long shutdown waits for an operation under way: a 64 GiB pause on the driver path takes tens of seconds.
STOP_WAIT_S = 120.0


class Engine:
    def __init__(
        self,
        *,
        logical_ordinal: int,
        gpus: Sequence[GpuIdentity],
        capabilities: Capabilities,
        lock_timeout_ms: int = DEFAULT_LOCK_TIMEOUT_MS,
        safe_point_wait_seconds: float = DEFAULT_SAFE_POINT_WAIT_SECONDS,
        memory_margin_bytes: int = DEFAULT_MEMORY_MARGIN_BYTES,
        fast_path: FastPath | None = None,
    ) -> None:
        if not 0 <= logical_ordinal < len(gpus):
            raise ValueError(f"device cuda:{logical_ordinal} is not among the {len(gpus)} visible GPU(s)")
        self.capabilities = capabilities
        self.memory_margin_bytes = memory_margin_bytes
        self._safe_points = SafePoints(safe_point_wait_seconds)
        self._parking = Parking()
        self._operation_lock = threading.Lock()
        self._ctx = OperationContext(
            pid=os.getpid(),
            logical=logical_ordinal,
            identity=IdentityMap(gpus),
            safe_points=self._safe_points,
            fast=fast_path,
            lock_timeout_ms=lock_timeout_ms,
        )
        self.last_result: OperationResult | None = None
        self._keeper: StagingKeeper | None = None

    # ---- lifecycle -------------------------------------------------------------------------

    def start(self) -> None:
        self._safe_points.install()
        pinning_gate.install()
        cuda_graphs.install()
        nvml.start_reader()  # reads while the job is frozen (a resume's room check) take milliseconds
        fast = self._ctx.fast
        if fast is not None and fast.pool.active:
            fast.warm_up()  # the copier process starts now, not in a pause's preparation
            self._keeper = StagingKeeper(
                fast,
                placement=lambda: (self._ctx.logical, self._ctx.source.uuid),
                ready=lambda: (
                    self.state == EngineState.RUNNING
                    and not self._operation_lock.locked()
                    and self._safe_points.steps_seen > 0
                ),
                refused=self._pause_refusal,
            )
            self._keeper.start()

    def stop(self) -> None:
        """Unhooks; an operation under way ends first (one waiting for a safe point runs at once),
        as what stop tears down (the fast path, the keeper) is what it uses; a job paused at
        shutdown is resumed in place so the process can exit."""
        self._safe_points.between_operations(None)
        self._safe_points.uninstall()
        if self._operation_lock.locked():
            log.info("waiting for the operation under way (%s) before flexium stops", self.state.value)
        if self._operation_lock.acquire(timeout=STOP_WAIT_S):
            self._operation_lock.release()
        else:
            log.error(
                "an operation still runs %.0f s into flexium's shutdown (%s); stopping beside it",
                STOP_WAIT_S,
                self.state.value,
            )
        if self.state == EngineState.PAUSED:
            try:
                self.resume()
            except Exception as exc:  # exiting anyway; say what happened (its advice needs a process still there)
                why = str(exc).split(f": {target_rules.STAYS_PAUSED};", 1)[0]
                log.error(
                    "could not resume the paused job in place at shutdown, so it exits paused: %s; the process ends "
                    "now, so nothing of it is left to resume (what it trained since its last checkpoint of its own "
                    "goes with it)",
                    why,
                )
        self._parking.release()
        pinning_gate.uninstall()
        cuda_graphs.uninstall()
        if self._keeper is not None:
            self._keeper.stop()
        if self._ctx.fast is not None:
            self._ctx.fast.close()
        nvml.stop_reader()

    # ---- what the rest of flexium reads ----------------------------------------------------

    @property
    def state(self) -> EngineState:
        return self._ctx.state

    @property
    def gpus(self) -> tuple[GpuIdentity, ...]:
        return self._ctx.identity.gpus

    @property
    def logical_device(self) -> str:
        return self._ctx.logical_device

    @property
    def safe_point_wait_seconds(self) -> float:
        return self._safe_points.wait_seconds

    def placement(self) -> tuple[str, GpuIdentity]:
        return self.logical_device, self._ctx.source

    def is_busy(self) -> bool:
        return self.state in (EngineState.MIGRATING, EngineState.PAUSING, EngineState.RESUMING)

    def add_state_listener(self, listener: StateListener) -> None:
        self._ctx.add_state_listener(listener)

    def process_bytes(self) -> int:
        """GPU memory this process holds on every GPU (OperationContext.process_bytes says how)."""
        return self._ctx.process_bytes()

    def footprint_bytes(self) -> int:
        """What the job needs on a GPU: what it holds now, or what it held when it was paused."""
        return self._ctx.paused_bytes if self.state == EngineState.PAUSED else self.process_bytes()

    def candidate_targets(self) -> list[TargetCandidate]:
        """GPUs this job could move to now: same model, room for it; most free memory first."""
        return target_rules.candidates(self._ctx, margin=self.memory_margin_bytes)

    def fast_path_blocker(self) -> str | None:
        """Why a move now would take the driver path (None: the fast path can run at a safe point)."""
        if self._ctx.fast is None:
            return "the memory pool is not in use"
        return self._ctx.fast.blocker(self._ctx.logical) or self._memory_on_other_gpus()

    def _pause_refusal(self) -> str | None:
        """Why a pause of this job would be refused whenever it came, by the rules its pause applies:
        its multi-process job's (job_operation.job_problem), then memory of this process the driver
        cannot checkpoint (uncheckpointable_memory.problem); None: it could run. The keeper asks
        from its own thread between operations: a look that meets a checkpoint waits in the driver
        until the restore, holding nothing the operation needs (the scan releases the GIL)."""
        job = membership.describe()
        if job.multi_process and (refusal := job_operation.job_problem(job)) is not None:
            return refusal
        return uncheckpointable_memory.problem()

    def _memory_on_other_gpus(self) -> str | None:
        """The pool is on the job's own GPU only; memory the process holds on another (PyTorch's own
        allocator there: DataParallel, a model split over devices) only the driver path carries,
        all its GPUs at once. NVML says where it holds memory (nothing where it cannot see processes)."""
        own = self._ctx.source.uuid
        _total, by_gpu = self._ctx.held_now()
        elsewhere = [gpu.device for gpu in self.gpus if gpu.uuid != own and by_gpu.get(gpu.uuid, 0) > 0]
        return memory_elsewhere(elsewhere) if elsewhere else None

    # ---- operations ------------------------------------------------------------------------

    def migrate(
        self,
        target: Target | None = None,
        *,
        path: PathChoice = "auto",
        moves: Mapping[str, Target] | None = None,
    ) -> OperationResult:
        """Moves the job to `target`, a GPU UUID or a GpuIdentity of `gpus`. A process on several
        GPUs may name `moves` instead: the GPU (UUID) each of its devices is on now -> the GPU it goes
        to, for the devices that move (one left out stays, unless a named one moves onto its GPU:
        then it takes the GPU that one leaves, as with `target`)."""
        _check_path(path)
        with self._operation(OperationKind.MIGRATE, allowed=(EngineState.RUNNING,)):
            self.capabilities.require(self.capabilities.migration, "migration to another GPU")
            _refuse_one_rank(OperationKind.MIGRATE)
            margin = self.memory_margin_bytes
            if target is not None and moves is None:
                source = self._ctx.source
                dest = self._ctx.identity.resolve(target)
                needed = target_rules.bytes_on(self._ctx, source)
                notes = target_rules.check_move(self._ctx, source, dest, needed=needed, margin=margin)
                plan = self._ctx.plan_to(dest)
            elif moves is not None and target is None:
                plan, notes = target_rules.check_moves(self._ctx, moves, margin=margin)
            else:
                raise TargetRefusedError(
                    "migrate takes a target GPU, or moves (the GPU each device is on -> where it goes): one of the two"
                )
            uncheckpointable_memory.refuse(OperationKind.MIGRATE)
            self.copier_off_gpu()

            def work(at_safe_point: bool) -> OperationResult:
                return self.migrate_now(plan, path, notes, at_safe_point=at_safe_point)

            result, _ = self._safe_points.run(work)
            return self._finish(result)

    def pause(self, *, path: PathChoice = "auto") -> OperationResult:
        _check_path(path)
        with self._operation(OperationKind.PAUSE, allowed=(EngineState.RUNNING,)):
            self.capabilities.require(self.capabilities.pause_resume, "pause")
            _refuse_one_rank(OperationKind.PAUSE)
            if self._safe_points.on_training_thread():
                raise InvalidStateError(
                    "pause() was called from the training thread: it would block at its next CUDA call "
                    "until resume(); call pause() from another thread (the flexium control thread does)"
                )
            uncheckpointable_memory.refuse(OperationKind.PAUSE)
            source = self._ctx.source
            staging = self.prepare_host_staging(path, source)

            def work(at_safe_point: bool) -> OperationResult:
                return self.pause_now(source, path, staging, at_safe_point=at_safe_point)

            result, at_safe_point = self._safe_points.run(work, then=self.park_while_paused)
            if not at_safe_point and result.ok:
                log.info("paused outside a safe point: the training thread waits in its next CUDA call")
            return self._finish(result)

    def resume(self, target: Target | None = None) -> OperationResult:
        """Resumes the paused job on `target` (a GPU UUID or a GpuIdentity of `gpus`), or without
        one on the GPU it paused on. The engine never picks another GPU: the server chooses one
        (docs/design.md), and here it only has the last word on the one it is given."""
        with self._operation(OperationKind.RESUME, allowed=(EngineState.PAUSED,)):
            source = self._ctx.source
            dest = source if target is None else self._ctx.identity.resolve(target)
            target_rules.check_resume(
                self._ctx,
                source,
                dest,
                in_place=target is None,
                margin=self.memory_margin_bytes,
                can_migrate=self.capabilities.migration,
            )
            if dest.uuid != source.uuid:
                self.capabilities.require(self.capabilities.migration, "resuming on another GPU")
            plan = self._ctx.plan_to(dest)
            return self._finish(self.run_where_parked(lambda: resume(self._ctx, plan)))

    def run_job_operation(
        self, op: JobOperation, *, path: PathChoice = "auto", deadlines: Deadlines | None = None
    ) -> OperationResult:
        """This rank's part in a pause, resume or migration of its whole multi-process job
        (engine/distributed/rank_part.py). Blocks until every rank is done; the result
        is this rank's, with the protocol's steps around its transaction."""
        _check_path(path)
        allowed = (EngineState.PAUSED,) if op.kind == OperationKind.RESUME else (EngineState.RUNNING,)
        with self._operation(op.kind, allowed=allowed):
            limits = deadlines or Deadlines()
            return self._finish(rank_part.run_job_operation(self._ctx, self, op, path, limits))

    # ---- what an operation runs (rank_part.RankEngine) --------------------------------------

    def migrate_now(
        self, plan: MovePlan, path: PathChoice, notes: tuple[str, ...], *, at_safe_point: bool
    ) -> OperationResult:
        fast, why = self._choose_path(path, at_safe_point)
        if fast is not None:
            return migrate_fast(self._ctx, fast, plan, notes)
        return migrate_by_driver(
            self._ctx, plan, (*notes, *why), at_safe_point=at_safe_point, headroom=self.memory_margin_bytes
        )

    def pause_now(
        self, source: GpuIdentity, path: PathChoice, staging: StagingPlan, *, at_safe_point: bool
    ) -> OperationResult:
        fast, why = self._choose_path(path, at_safe_point)
        if fast is not None:
            return pause_fast(self._ctx, fast, source, staging)
        if self._ctx.fast is not None:
            self._ctx.fast.release_host_now()  # pinned staging would slow the driver's checkpoint
        target_rules.check_host_room(self.process_bytes(), fast=False)
        return pause_by_driver(self._ctx, source, why, at_safe_point=at_safe_point)

    def prepare_host_staging(self, path: PathChoice, source: GpuIdentity) -> StagingPlan:
        """Before a pause that can take the fast path, its staging checked for host room and, kept
        pinned, topped up while the job trains (fast_pause.prepare_host_staging); a pause on the
        driver path is checked for host memory at its safe point."""
        fast = self._ctx.fast if path != "driver" and self.fast_path_blocker() is None else None
        return prepare_host_staging(self._ctx, fast, source) if fast is not None else StagingPlan()

    def copier_off_gpu(self) -> None:
        """Before a migration, outside its downtime: the copier keeping the staging pinned holds a
        context on the GPU the job leaves (the keeper wakes it on the new one later)."""
        if self._ctx.fast is not None:
            self._ctx.fast.copier_sleep_now()

    def park_while_paused(self, result: OperationResult) -> None:
        if result.ok:
            self._parking.park(lambda: self.state == EngineState.PAUSED)

    def run_where_parked(self, work: Callable[[], OperationResult]) -> OperationResult:
        """Runs `work` on the training thread a pause parked, or here when none is parked."""
        return self._parking.submit(work) if self._parking.occupied else work()

    def _choose_path(self, requested: PathChoice, at_safe_point: bool) -> tuple[FastPath | None, tuple[str, ...]]:
        """The fast path to take, else None and the note saying why the driver path runs."""
        fast = self._ctx.fast
        if requested == "driver":
            return None, ("driver path: asked for",)
        if fast is None and requested == "auto":
            return None, ()  # no pool in this process (no CUDA torch): the driver path is the only one
        blocker = self.fast_path_blocker()
        if blocker is None and not at_safe_point:
            blocker = self._safe_points.missed()
        if blocker is None and fast is not None:
            return fast, ()
        if requested == "fast":
            raise CapabilityError(f"the fast path cannot run: {blocker}")
        return None, (f"driver path: {blocker}",)

    # ---- bookkeeping -----------------------------------------------------------------------

    @contextlib.contextmanager
    def _operation(self, kind: OperationKind, *, allowed: tuple[EngineState, ...]) -> Iterator[None]:
        if not self._operation_lock.acquire(blocking=False):
            raise OperationInProgressError(
                f"cannot {kind.value}: another operation is in progress ({self.state.value}); wait for it to finish"
            )
        try:
            state = self.state
            if state not in allowed:
                raise InvalidStateError(_state_refusal(kind, state))
            yield
        finally:
            self._operation_lock.release()

    def _finish(self, result: OperationResult) -> OperationResult:
        self.last_result = result
        if self.state == EngineState.RUNNING:
            own_in_slices(self._ctx)
        summary = ", ".join(f"{s.step} {s.seconds * 1e3:.0f} ms" for s in result.steps if not s.rollback)
        if result.ok:
            where = f" -> {result.target.device}" if result.target is not None else ""
            log.info(
                "%s %s%s done in %.2f s (%s)", result.kind.value, result.source.device, where, result.seconds, summary
            )
            return result
        message, step = f"{result.kind.value} failed: {result.error}", result.failed_step or "?"
        if self.state == EngineState.FAILED:
            log.critical("%s failed and could not be rolled back: %s", result.kind.value, result.error)
            raise RollbackFailedError(message, step=step, result=result)
        log.error("%s failed: %s", result.kind.value, result.error)
        raise OperationFailedError(message, step=step, result=result)


def _check_path(path: str) -> None:
    if path not in PATHS:
        raise ValueError(f"path must be one of {', '.join(PATHS)}, not {path!r}")


def _refuse_one_rank(kind: OperationKind) -> None:
    """Moving one rank of a multi-process job alone would break the whole job (membership.py).
    Resume is never refused: a job paused before must always be resumable."""
    reason = membership.describe().refusal()
    if reason is not None:
        raise CapabilityError(f"cannot {kind.value}: {reason}")


def _state_refusal(kind: OperationKind, state: EngineState) -> str:
    if state == EngineState.PAUSED:
        return f"cannot {kind.value}: the job is paused; resume it first (resume can take a target GPU)"
    if state == EngineState.RUNNING and kind == OperationKind.RESUME:
        return "cannot resume: the job is running, not paused"
    if state == EngineState.FAILED:
        return f"cannot {kind.value}: an earlier rollback failed and the process may be stuck; restart the job"
    return f"cannot {kind.value}: the job is {state.value}"
