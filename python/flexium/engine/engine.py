"""The engine: migrate / pause / resume of this process, each a transaction on the driver
checkpoint API (engine/transactions/, one module each).

The engine owns the lifecycle, the last-word checks before anything is touched (same model, free
memory on the target, host memory for a pause), the choice of path and the dispatch to a
transaction at a safe point. Every operation ends with the process RUNNING on its source GPU,
RUNNING on its target, or (pause, failed resume) checkpointed and paused. Anything else raises
RollbackFailedError and is logged at CRITICAL.

Two paths: the fast path moves the memory pool's segments itself at a safe point and leaves the
driver only the rest; the driver path lets the checkpoint carry everything. The fast path runs
when the pool is in use and a safe point comes within the bounded wait; otherwise, or when asked,
the driver path does.
"""

from __future__ import annotations

import contextlib
import logging
import os
import threading
from dataclasses import dataclass
from typing import Iterator, Literal, Mapping, Optional, Sequence, get_args

from flexium import _C
from flexium.engine import nvml, pinning_gate, uncheckpointable_memory
from flexium.engine.capabilities import Capabilities
from flexium.engine.distributed import cuda_graphs, job_operation, membership, nccl
from flexium.engine.distributed.job_operation import Deadlines, JobOperation, RankActions
from flexium.engine.distributed.rendezvous import JobAborted, Rendezvous, job_store
from flexium.engine.fast_path import FastPath, memory_elsewhere
from flexium.engine.host_memory import host_memory_available
from flexium.engine.identity import IdentityMap, MovePlan, Target
from flexium.engine.kept_staging import StagingKeeper
from flexium.engine.operations import EngineState, GpuIdentity, OperationKind, OperationResult
from flexium.engine.parking import Parking
from flexium.engine.safe_point import SafePointMissed, SafePoints
from flexium.engine.transactions.context import OperationContext, StateListener
from flexium.engine.transactions.driver_migrate import migrate_by_driver
from flexium.engine.transactions.driver_pause import pause_by_driver
from flexium.engine.transactions.fast_migrate import migrate_fast
from flexium.engine.transactions.fast_pause import pause_fast
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
from flexium.units import gib

log = logging.getLogger("flexium")

DEFAULT_LOCK_TIMEOUT_MS = 30_000
DEFAULT_SAFE_POINT_WAIT_SECONDS = 5.0
# Restore needs some room beyond the process's own bytes (driver bookkeeping on the target).
DEFAULT_MEMORY_MARGIN_BYTES = 512 << 20
# Host memory a pause leaves free beside what it stages.
HOST_MEMORY_MARGIN_BYTES = 1 << 30
# "auto": fast when possible; "fast": refuse otherwise; "driver": the checkpoint carries everything.
PathChoice = Literal["auto", "fast", "driver"]
PATHS: tuple[str, ...] = get_args(PathChoice)


@dataclass(frozen=True)
class TargetCandidate:
    gpu: GpuIdentity
    free_bytes: int


def snapshot_gpus() -> list[GpuIdentity]:
    """The visible GPUs as the driver reports them now: call before any migration."""
    nvml_index = {gpu.uuid: gpu.index for gpu in nvml.host_gpus()}
    return [
        GpuIdentity(
            ordinal=d.ordinal,
            uuid=d.uuid,
            name=d.name,
            total_memory=int(d.total_memory),
            pci_bus_id=d.pci_bus_id,
            nvml_index=nvml_index.get(d.uuid),
        )
        for d in _C.list_devices()
    ]


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
        fast_path: Optional[FastPath] = None,
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
        self.last_result: Optional[OperationResult] = None
        self._keeper: Optional[StagingKeeper] = None
        # The communicators a whole-job pause suspended, for its resume.
        self._suspended_communicators: list[nccl.Communicator] = []

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
                placement=lambda: (self._ctx.logical, self._source().uuid),
                ready=lambda: (
                    self.state == EngineState.RUNNING
                    and not self._operation_lock.locked()
                    and self._safe_points.steps_seen > 0
                ),
                refused=self._pause_refusal,
            )
            self._keeper.start()

    def stop(self) -> None:
        """Unhooks; a job paused at shutdown is resumed in place so the process can exit."""
        self._safe_points.between_operations(None)
        self._safe_points.uninstall()
        if self.state == EngineState.PAUSED:
            try:
                self.resume()
            except Exception as exc:  # exiting anyway; say what happened
                log.error("could not resume the paused job in place at shutdown, so it exits paused: %s", exc)
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
        return self.logical_device, self._source()

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
        source = self._source()
        pid = self._ctx.pid
        # One NVML reading for all GPUs: while frozen each reading is a child process.
        on_host = {gpu.uuid: gpu for gpu in nvml.host_gpus()}
        if self.state == EngineState.PAUSED:
            needed = self._ctx.paused_bytes
        else:
            source_host = on_host.get(source.uuid)
            needed = (source_host.used_by(pid) or 0) if source_host is not None else 0
        candidates = []
        for gpu in self.gpus:
            host = on_host.get(gpu.uuid)
            if gpu.uuid == source.uuid or gpu.name != source.name or host is None:
                continue
            free = host.memory_free + (host.used_by(pid) or 0)
            if free >= needed + self.memory_margin_bytes:
                candidates.append(TargetCandidate(gpu=gpu, free_bytes=free))
        return sorted(candidates, key=lambda c: -c.free_bytes)

    def fast_path_blocker(self) -> Optional[str]:
        """Why a move now would take the driver path (None: the fast path can run at a safe point)."""
        if self._ctx.fast is None:
            return "the memory pool is not in use"
        return self._ctx.fast.blocker(self._ctx.logical) or self._memory_on_other_gpus()

    def _pause_refusal(self) -> Optional[str]:
        """Why a pause of this job would be refused whenever it came, by the rules its pause applies:
        its multi-process job's (job_operation.job_problem), then memory of this process the driver
        cannot checkpoint (uncheckpointable_memory.problem); None: it could run. The keeper asks
        from its own thread between operations: a look that meets a checkpoint waits in the driver
        until the restore, holding nothing the operation needs (the scan releases the GIL)."""
        job = membership.describe()
        if job.multi_process and (refusal := job_operation.job_problem(job)) is not None:
            return refusal
        return uncheckpointable_memory.problem()

    def _memory_on_other_gpus(self) -> Optional[str]:
        """The pool is on the job's own GPU only; memory the process holds on another (PyTorch's own
        allocator there: DataParallel, a model split over devices) only the driver path carries,
        all its GPUs at once. NVML says where it holds memory (nothing where it cannot see processes)."""
        own = self._source().uuid
        _total, by_gpu = self._ctx.held_now()
        elsewhere = [gpu.device for gpu in self.gpus if gpu.uuid != own and by_gpu.get(gpu.uuid, 0) > 0]
        return memory_elsewhere(elsewhere) if elsewhere else None

    # ---- operations ------------------------------------------------------------------------

    def migrate(
        self,
        target: Optional[Target] = None,
        *,
        path: PathChoice = "auto",
        moves: Optional[Mapping[str, Target]] = None,
    ) -> OperationResult:
        """Moves the job to `target`, a GPU UUID or a GpuIdentity of `gpus`. A process on several
        GPUs may name `moves` instead: the GPU (UUID) each of its devices is on now -> the GPU it goes
        to, for the devices that move (one left out stays, unless a named one moves onto its GPU:
        then it takes the GPU that one leaves, as with `target`)."""
        _check_path(path)
        with self._operation(OperationKind.MIGRATE, allowed=(EngineState.RUNNING,)):
            self._require(self.capabilities.migration, "migration to another GPU")
            _refuse_one_rank(OperationKind.MIGRATE)
            if target is not None and moves is None:
                source = self._source()
                dest = self._ctx.identity.resolve(target)
                notes = self._validate_target(source, dest, needed=self._bytes_on(source))
                plan = self._plan(dest)
            elif moves is not None and target is None:
                plan, notes = self._plan_moves(moves)
            else:
                raise TargetRefusedError(
                    "migrate takes a target GPU, or moves (the GPU each device is on -> where it goes): one of the two"
                )
            _refuse_uncheckpointable_memory(OperationKind.MIGRATE)
            self._copier_off_gpu()

            def work(at_safe_point: bool) -> OperationResult:
                return self._migrate_now(plan, path, notes, at_safe_point=at_safe_point)

            result, _ = self._safe_points.run(work)
            return self._finish(result)

    def pause(self, *, path: PathChoice = "auto") -> OperationResult:
        _check_path(path)
        with self._operation(OperationKind.PAUSE, allowed=(EngineState.RUNNING,)):
            self._require(self.capabilities.pause_resume, "pause")
            _refuse_one_rank(OperationKind.PAUSE)
            if self._safe_points.on_training_thread():
                raise InvalidStateError(
                    "pause() was called from the training thread: it would block at its next CUDA call "
                    "until resume(); call pause() from another thread (the flexium control thread does)"
                )
            _refuse_uncheckpointable_memory(OperationKind.PAUSE)
            source = self._source()
            pinned = self._prepare_host_staging(path, source)

            def work(at_safe_point: bool) -> OperationResult:
                return self._pause_now(source, path, pinned, at_safe_point=at_safe_point)

            result, at_safe_point = self._safe_points.run(work, then=self._park_while_paused)
            if not at_safe_point and result.ok:
                log.info("paused outside a safe point: the training thread waits in its next CUDA call")
            return self._finish(result)

    def resume(self, target: Optional[Target] = None) -> OperationResult:
        """Resumes the paused job on `target` (a GPU UUID or a GpuIdentity of `gpus`), or without
        one on the GPU it paused on. The engine never picks another GPU: the server chooses one
        (docs/design.md), and here it only has the last word on the one it is given."""
        with self._operation(OperationKind.RESUME, allowed=(EngineState.PAUSED,)):
            source = self._source()
            dest = source if target is None else self._ctx.identity.resolve(target)
            self._check_resume_target(source, dest, in_place=target is None)
            if dest.uuid != source.uuid:
                self._require(self.capabilities.migration, "resuming on another GPU")
            plan = self._plan(dest)

            def work() -> OperationResult:
                return resume(self._ctx, plan)

            result = self._parking.submit(work) if self._parking.occupied else work()
            return self._finish(result)

    def run_job_operation(
        self, op: JobOperation, *, path: PathChoice = "auto", deadlines: Optional[Deadlines] = None
    ) -> OperationResult:
        """This rank's part in a pause, resume or migration of its whole multi-process job
        (engine/distributed/job_operation.py). Blocks until every rank is done; the result
        is this rank's, with the protocol's steps around its transaction."""
        _check_path(path)
        limits = deadlines or Deadlines()
        allowed = (EngineState.PAUSED,) if op.kind == OperationKind.RESUME else (EngineState.RUNNING,)
        with self._operation(op.kind, allowed=allowed):
            job = membership.describe()
            problem = job_operation.refusal(job, op)
            if problem is not None:
                if job.initialized:  # the other ranks need not wait out their deadline for this one
                    _give_up_for_all(op, f"refused: {problem}")
                raise CapabilityError(f"cannot {op.kind.value} the job: {problem}")
            rv = _rendezvous(op)
            try:
                lands_on = self._lands_on(op)
            except Exception as exc:  # this rank refuses its part: the others need not wait for it
                rv.abort(f"refused: {exc}")
                raise
            if job.uses_nccl:
                try:
                    problem = job_operation.shared_gpu_problem(rv, self._source(), lands_on, deadline_s=limits.agree_s)
                except JobAborted as exc:
                    untouched = RankActions(source=self._source(), logical_device=self.logical_device)
                    return self._finish(
                        job_operation.untouched(
                            op.kind, untouched, f"the job's ranks did not meet, nothing changed: {exc}", "placement"
                        )
                    )
                if problem is not None:  # every rank reads the same placements, so every rank refuses
                    raise CapabilityError(f"cannot {op.kind.value} the job: {problem}")
            try:
                actions = self._rank_actions(op, path, lands_on)
            except Exception as exc:
                rv.abort(f"refused: {exc}")
                raise
            if op.kind == OperationKind.RESUME:
                return self._finish(self._resume_job(op, rv, actions, limits))

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
                    self._suspended_communicators = communicators
                return result

            park = self._park_while_paused if op.kind == OperationKind.PAUSE else None
            try:
                # Longer than the agreement's own deadline, which names the ranks that are late.
                wait = limits.agree_s + limits.meet_s
                result = self._safe_points.run_when(at_stop_step, ready=agreement.ready, deadline_s=wait, then=park)
            except (SafePointMissed, JobAborted) as exc:
                if isinstance(exc, SafePointMissed):
                    rv.abort(f"{exc}")
                if op.kind == OperationKind.PAUSE and self._ctx.fast is not None:
                    self._ctx.fast.done_with_host()
                result = job_operation.untouched(
                    op.kind, actions, f"the job's ranks did not agree on a step, nothing changed: {exc}", "agree"
                )
            return self._finish(result)

    def _lands_on(self, op: JobOperation) -> Optional[GpuIdentity]:
        """The GPU the driver restores this rank on in `op`: where it is (a pause), its target (a
        resume or a move), where it paused (a resume in place); None for a rank a migration
        leaves where it is, which is never checkpointed."""
        if op.kind == OperationKind.PAUSE or (op.kind == OperationKind.RESUME and op.target is None):
            return self._source()
        return None if op.target is None else self._ctx.identity.resolve(op.target)

    def _rank_actions(self, op: JobOperation, path: PathChoice, lands_on: Optional[GpuIdentity]) -> RankActions:
        """This rank's checks before the operation (as for one process) and what it will do."""
        if op.kind == OperationKind.PAUSE or (op.kind == OperationKind.MIGRATE and lands_on is not None):
            _refuse_uncheckpointable_memory(op.kind)  # only a rank the driver checkpoints
        if op.kind in (OperationKind.PAUSE, OperationKind.RESUME):
            self._require(self.capabilities.pause_resume, op.kind.value)
        if op.target is not None or op.kind == OperationKind.MIGRATE:
            self._require(self.capabilities.migration, "migration to another GPU")
        source = self._source()
        actions = RankActions(source=source, logical_device=self.logical_device)
        if op.kind == OperationKind.RESUME:
            assert lands_on is not None
            dest = lands_on
            self._check_resume_target(source, dest, in_place=op.target is None)
            actions.resume = lambda: resume(self._ctx, self._plan(dest))
            actions.pause_again = lambda: pause_by_driver(
                self._ctx, self._source(), ("paused again: the job's other ranks could not resume",), at_safe_point=True
            )
        elif op.kind == OperationKind.MIGRATE and lands_on is not None:
            dest = lands_on
            notes = self._validate_target(source, dest, needed=self._bytes_on(source))
            self._copier_off_gpu()
            actions.move = lambda: self._migrate_now(self._plan(dest), path, notes, at_safe_point=True)
            actions.move_back = lambda: self._migrate_now(
                self._plan(source), path, ("moving back",), at_safe_point=True
            )
        elif op.kind == OperationKind.PAUSE:
            pinned = self._prepare_host_staging(path, source)
            actions.pause = lambda: self._pause_now(source, path, pinned, at_safe_point=True)
            actions.resume_in_place = lambda: resume(self._ctx, self._plan(source))
        return actions

    def _resume_job(self, op: JobOperation, rv: Rendezvous, actions: RankActions, limits: Deadlines) -> OperationResult:
        suspended = self._suspended_communicators

        def work() -> OperationResult:
            return job_operation.resume(op, rv, actions, limits, find_communicators=lambda: suspended)

        result = self._parking.submit(work) if self._parking.occupied else work()
        if result.ok:
            self._suspended_communicators = []
        return result

    def _migrate_now(
        self, plan: MovePlan, path: PathChoice, notes: tuple[str, ...], *, at_safe_point: bool
    ) -> OperationResult:
        fast, why = self._choose_path(path, at_safe_point)
        if fast is not None:
            return migrate_fast(self._ctx, fast, plan, notes)
        return migrate_by_driver(
            self._ctx, plan, (*notes, *why), at_safe_point=at_safe_point, headroom=self.memory_margin_bytes
        )

    def _pause_now(
        self, source: GpuIdentity, path: PathChoice, pinned: tuple[str, ...], *, at_safe_point: bool
    ) -> OperationResult:
        fast, why = self._choose_path(path, at_safe_point)
        if fast is not None:
            return pause_fast(self._ctx, fast, source, pinned)
        if self._ctx.fast is not None:
            self._ctx.fast.release_host_now()  # pinned staging would slow the driver's checkpoint
        self._check_host_room(self.process_bytes(), fast=False)
        return pause_by_driver(self._ctx, source, why, at_safe_point=at_safe_point)

    def _copier_off_gpu(self) -> None:
        """Before a migration, outside its downtime: the copier keeping the staging pinned holds a
        context on the GPU the job leaves (the keeper wakes it on the new one later)."""
        if self._ctx.fast is not None:
            self._ctx.fast.copier_sleep_now()

    def _source(self) -> GpuIdentity:
        return self._ctx.identity.physical_of(self._ctx.logical)

    def _plan(self, dest: GpuIdentity) -> MovePlan:
        return self._ctx.identity.plan({self._ctx.logical: dest})

    def _plan_moves(self, moves: Mapping[str, Target]) -> tuple[MovePlan, tuple[str, ...]]:
        """The plan of a migration named GPU by GPU (a process on several GPUs), each move checked
        as a move of that device's own share of the process's memory."""
        identity = self._ctx.identity
        targets: dict[int, GpuIdentity] = {}
        notes: list[str] = []
        for now, after in moves.items():
            source, dest = identity.resolve(now), identity.resolve(after)
            logical = identity.logical_on(source.uuid)
            held = self._bytes_on(source)
            if logical is None or held == 0:
                raise TargetRefusedError(
                    f"{source.device} ({source.uuid}) holds nothing of this process: moves name the GPUs it uses"
                )
            notes.extend(self._validate_target(source, dest, needed=held))
            if dest in targets.values():
                raise TargetRefusedError(f"two devices of the process cannot both go to {dest.device} ({dest.uuid})")
            targets[logical] = dest
        if not targets:
            raise TargetRefusedError("moves names no GPU: give the GPU each moving device is on and where it goes")
        plan = identity.plan(targets)
        if len(targets) > 1:
            moved = ", ".join(f"{m.source.device} -> {m.target.device}" for m in plan.moves)
            notes.append(f"moved GPU by GPU: {moved}")
        return plan, tuple(dict.fromkeys(notes))

    # ---- validation ------------------------------------------------------------------------

    def _prepare_host_staging(self, path: PathChoice, source: GpuIdentity) -> tuple[str, ...]:
        """Before a pause that can take the fast path: refuses it when the host cannot hold the
        pool's live bytes, and touches and pins the staging before the safe point, while the job
        trains. A pause on the driver path is checked for host memory at its safe point."""
        fast = self._ctx.fast if path != "driver" and self.fast_path_blocker() is None else None
        if fast is None:
            return ()
        logical = self._ctx.logical
        wanted = fast.host_bytes_wanted(logical)
        to_map = fast.host_bytes_to_map(wanted)
        self._check_host_room(to_map, fast=True)
        try:
            reserved = fast.reserve_host(logical, wanted, source.uuid)
        except Exception as exc:
            fast.release_host_later()
            raise OperationFailedError(
                f"pause failed at step 'pin' before anything was touched: could not prepare host staging "
                f"({type(exc).__name__}: {exc}); the job keeps training",
                step="pin",
            ) from exc
        if reserved.pinned == 0:
            return ()
        phases = f"; {reserved.phases}" if reserved.phases else ""
        return (
            f"pinned {gib(reserved.pinned, 2)} of host staging {reserved.where} in {reserved.seconds:.2f} s before "
            f"the safe point ({gib(to_map, 2)} of it newly mapped and touched, {gib(reserved.newly_pinned, 2)} newly "
            f"pinned{phases})",
        )

    def _check_host_room(self, needed: int, *, fast: bool) -> None:
        """A pause stages the job's memory in host memory: pinned by us (fast) or by the driver."""
        available = host_memory_available()
        wanted = needed + HOST_MEMORY_MARGIN_BYTES
        if available is not None and available < wanted:
            what = "host memory to stage the job's pool" if fast else "host memory to hold the job's GPU memory"
            raise TargetRefusedError(
                f"pausing needs {gib(wanted, 2)} of {what} and this machine has {gib(available, 2)} available: "
                "free host memory, or migrate the job instead"
            )

    def _choose_path(self, requested: PathChoice, at_safe_point: bool) -> tuple[Optional[FastPath], tuple[str, ...]]:
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

    def _require(self, available: bool, feature: str) -> None:
        if not available:
            why = "; ".join(self.capabilities.problems) or "the driver does not support it"
            raise CapabilityError(f"{feature} is not available on this machine: {why}")

    def _bytes_on(self, gpu: GpuIdentity) -> Optional[int]:
        host = nvml.gpu_by_uuid(gpu.uuid)
        if host is None:
            return None
        return host.used_by(self._ctx.pid) or 0

    def _validate_target(self, source: GpuIdentity, dest: GpuIdentity, *, needed: Optional[int]) -> tuple[str, ...]:
        if dest.uuid == source.uuid:
            raise TargetRefusedError(f"the job is already on {dest.device} ({dest.uuid})")
        if dest.name != source.name:
            raise TargetRefusedError(
                f"{dest.device} is a {dest.name}, the job runs on a {source.name}: migration needs the same GPU model"
            )
        host = nvml.gpu_by_uuid(dest.uuid)
        if host is None or needed is None:
            return ("free memory on the target not checked: NVML unavailable",)
        # Whatever of ours already sits on the target moves to the source in the swap.
        available = host.memory_free + (host.used_by(self._ctx.pid) or 0)
        if available < needed + self.memory_margin_bytes:
            raise TargetRefusedError(
                f"{dest.device} ({dest.name}, nvidia-smi index {host.index}) has {gib(available, 2)} free; "
                f"the job needs {gib(needed, 2)} plus {gib(self.memory_margin_bytes, 2)} headroom: "
                "free memory there or choose another GPU"
            )
        return ()

    def _check_resume_target(self, source: GpuIdentity, dest: GpuIdentity, *, in_place: bool) -> None:
        """Same model, and room on every GPU the resume puts the job's memory on for what it held
        when it was paused (a paused job holds nothing on any GPU, so the free memory NVML reports
        is what it can have). A process on several GPUs needs each GPU's share on the GPU where
        the restore puts it. Back where it was, on a GPU no other process uses, a share needs no
        headroom (a job that filled its GPU comes back to it); beside other processes it does, as
        they may take more before the restore, and a restore without room loses the job
        (docs/facts.md fact 28)."""
        if dest.name != source.name:
            raise TargetRefusedError(
                f"{dest.device} is a {dest.name}, the job was paused on a {source.name}: resume needs the same model"
            )
        goes_to = dict(self._plan(dest).pairs)  # empty in place: every GPU maps to itself
        held = self._ctx.paused_by_gpu or {source.uuid: self._ctx.paused_bytes}
        # After a fast pause the pool comes back by flexium's own copies, which pause the job again
        # when they find no room: the headroom guards only what the driver restores.
        in_host = self._ctx.fast.waiting_bytes() if self._ctx.fast is not None else 0
        for old_uuid, needed in held.items():
            uuid = goes_to.get(old_uuid, old_uuid)
            host = nvml.gpu_by_uuid(uuid)
            if needed == 0 or host is None:
                continue
            moved = uuid != old_uuid
            shared = any(p.pid != self._ctx.pid for p in host.processes)
            guarded = needed if moved else max(0, needed - in_host)
            required = max(needed, guarded + self.memory_margin_bytes) if moved or shared else needed
            if host.memory_free >= required:
                continue
            margin = required - needed
            if uuid != dest.uuid:
                gpu = next((g for g in self.gpus if g.uuid == uuid), None)
                name = gpu.device if gpu is not None else uuid
                raise TargetRefusedError(
                    f"{name} has {gib(host.memory_free, 2)} free; the paused job held {gib(needed, 2)} there"
                    f"{f' plus {gib(margin, 2)} headroom' if margin else ''} (it uses several GPUs): it stays paused; "
                    "free memory there"
                )
            if not in_place:
                advice = "free memory there or choose another GPU"
            elif self.capabilities.migration:
                advice = (
                    "free memory there, or resume it with a target, e.g. from the dashboard or "
                    "`flexium resume JOB cuda:N`"
                )
            else:
                advice = "free memory there (this machine cannot resume it on another GPU)"
            headroom = f" plus {gib(margin, 2)} headroom" if margin else ""
            raise TargetRefusedError(
                f"{dest.device} has {gib(host.memory_free, 2)} free; the paused job needs {gib(needed, 2)}{headroom}: "
                f"it stays paused; {advice}"
            )

    # ---- bookkeeping -----------------------------------------------------------------------

    def _park_while_paused(self, result: OperationResult) -> None:
        if result.ok:
            self._parking.park(lambda: self.state == EngineState.PAUSED)

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


def _refuse_one_rank(kind: OperationKind) -> None:
    """Moving one rank of a multi-process job alone would break the whole job (membership.py).
    Resume is never refused: a job paused before must always be resumable."""
    reason = membership.describe().refusal()
    if reason is not None:
        raise CapabilityError(f"cannot {kind.value}: {reason}")


def _refuse_uncheckpointable_memory(kind: OperationKind) -> None:
    """A process holding memory the driver cannot checkpoint is never checkpointed (uncheckpointable_memory.py);
    prepare() looks again at the safe point."""
    reason = uncheckpointable_memory.problem()
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
