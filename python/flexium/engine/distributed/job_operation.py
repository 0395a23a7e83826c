"""A whole-job pause, resume or migration, as one rank carries it out (docs/design.md,
"Distributed jobs").

The server gives every rank of the job its own command with the operation's id. Each rank:

0. **checks the placement** (NCCL jobs): every rank posts the GPU it will be on, and all refuse
   alike when a rank the driver restores would share its GPU with another rank;
1. **agrees on a step**: at its next optimizer step it posts the step it is at and trains on;
   once every rank has posted, each computes the same stop step, the highest posted plus a
   margin (ranks in lockstep are at most a step apart, so every rank is still before it);
2. **meets** the others at the end of that step, with no collective in flight, and drains;
3. **suspends NCCL**: every communicator of every process group (collective);
4. **moves**: the ranks that change GPU run the engine's fast or driver transaction, the others
   wait; for a pause every rank checkpoints and the training thread parks;
5. **resumes NCCL** (collective) and checks it with a one-element all-reduce, then trains on.

Every meeting is a gather with a deadline (rendezvous.py). What any rank's failure does:
before the move nothing has changed and every rank trains on; a failed move rolls its rank
back by itself and the ranks that did move go back; a failed pause resumes the ranks that
paused; a failed resume pauses again the ranks that resumed. No rank is left locked or
checkpointed while another trains.
"""

from __future__ import annotations

import dataclasses
import logging
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass

from flexium import protocol
from flexium.engine import torch_bridge
from flexium.engine.distributed import cuda_graphs, nccl
from flexium.engine.distributed.membership import DistributedJob
from flexium.engine.distributed.rendezvous import OK, Gathered, JobAborted, Rendezvous
from flexium.engine.operations import GpuIdentity, OperationKind, OperationResult, StepTiming

log = logging.getLogger("flexium")

# Ranks in lockstep post their steps at most one step apart, and one of them may see the last
# post only a step later: stopping this many steps after the highest post leaves every rank
# before the stop step.
STOP_MARGIN_STEPS = 3
STOPPED_AT = "the job stopped at optimizer step"  # a result's note; bench/job_moves.py reads it
# torch's NCCL watchdog retires finished collectives at its next look, every 100 ms. One still
# listed when the rank locks for a checkpoint makes the watchdog's event query block for as long
# as the rank stays locked: its heartbeat stops, and torch's heartbeat monitor kills the rank
# (TORCH_NCCL_HEARTBEAT_TIMEOUT_SEC) in a long pause. Two looks after the drain none is listed
# (fact `nccl-ranks-sharing-gpu-fail`).
WATCHDOG_LOOKS_S = 0.25


@dataclass(frozen=True)
class JobOperation:
    operation_id: int  # the same in every rank's command
    kind: OperationKind
    rank: int
    world_size: int
    target: str | None = None  # this rank's GPU UUID; None: it stays (migrate), resumes where it paused


@dataclass(frozen=True)
class Deadlines:
    agree_s: float = 60.0  # every rank takes the operation up and reaches the stop step
    meet_s: float = 30.0  # each meeting that waits for no data movement
    move_s: float = 600.0  # the slowest rank's move, pause or resume


def refusal(job: DistributedJob, op: JobOperation) -> str | None:
    """Why this process cannot take its part in `op`, with what to do; None: it can."""
    if not job.multi_process:
        return "this process is not a rank of a multi-process job"
    if job.world_size != op.world_size or job.rank != op.rank:
        return (
            f"the command is for rank {op.rank} of {op.world_size}, this process is {job.describe_rank()}: "
            "the server's view of the job is out of date; wait for its ranks to register again"
        )
    return job_problem(job)


def job_problem(job: DistributedJob) -> str | None:
    """Why this rank's job cannot be paused, resumed or migrated as a whole; None: it can."""
    if job.multi_node:
        return (
            f"this process is {job.describe_rank()}: jobs spanning several hosts cannot be moved (a restore "
            "works on one host's GPUs); run it on one host to make it movable"
        )
    if not job.initialized:
        return "the job has not started its process group yet (init_process_group): wait until it trains"
    if job.uses_nccl:
        return nccl.suspend_problem() or cuda_graphs.problem()
    return None


class StepAgreement:
    """Polled at each optimizer step of the rank (``ready(step)``): True at the stop step."""

    def __init__(self, rendezvous: Rendezvous, *, deadline_s: float, clock: Callable[[], float] = time.monotonic):
        self.rendezvous = rendezvous
        self.deadline_s = deadline_s
        self.clock = clock
        self.started: float | None = None
        self.stop_at: int | None = None

    def ready(self, step: int) -> bool:
        rv = self.rendezvous
        if self.started is None:
            self.started = self.clock()
            rv.post("step", str(step))
        reason = rv.aborted()
        if reason is not None:
            raise JobAborted(reason)
        if self.stop_at is None:
            if not rv.posted("step"):
                if self.clock() - self.started > self.deadline_s:
                    late = ", ".join(str(rank) for rank in rv.missing("step"))
                    reason = f"rank(s) {late} did not take the operation up within {self.deadline_s:g} s"
                    rv.abort(reason)
                    raise JobAborted(f"rank {rv.rank}: {reason}")
                return False
            steps = rv.words("step").words
            self.stop_at = max(int(word) for word in steps.values()) + STOP_MARGIN_STEPS
        if step > self.stop_at:
            reason = f"rank {rv.rank} was already at step {step}, past the agreed step {self.stop_at}"
            rv.abort(reason)
            raise JobAborted(reason)
        return step == self.stop_at


@dataclass
class RankActions:
    """What the engine does for this rank inside the protocol; each returns the transaction's
    result (which has rolled its own failure back) and never raises for a failed step."""

    source: GpuIdentity
    logical_device: str
    move: Callable[[], OperationResult] | None = None  # migrate: None when this rank stays
    move_back: Callable[[], OperationResult] | None = None  # after its move, to where it was
    pause: Callable[[], OperationResult] | None = None
    resume: Callable[[], OperationResult] | None = None  # from a pause: to its target or in place
    resume_in_place: Callable[[], OperationResult] | None = None  # undo this rank's pause
    pause_again: Callable[[], OperationResult] | None = None  # undo this rank's resume


class _Timeline:
    """The protocol's own steps, timed, around the rank's transaction."""

    def __init__(self) -> None:
        self.started = time.perf_counter()
        self.steps: list[StepTiming] = []
        self.notes: list[str] = []
        self.before_transaction = 0  # how many of steps came before the rank's transaction

    def mark_transaction(self) -> None:
        self.before_transaction = len(self.steps)

    def timed(self, step: str, work: Callable[[], object]) -> object:
        begun = time.perf_counter()
        try:
            value = work()
        except Exception as exc:
            self.steps.append(StepTiming(step, time.perf_counter() - begun, False, error=str(exc)))
            raise
        self.steps.append(StepTiming(step, time.perf_counter() - begun, True))
        return value

    def result(
        self, base: OperationResult, *, ok: bool, error: str | None = None, step: str | None = None
    ) -> OperationResult:
        """`base` (the rank's transaction) with the protocol's steps and notes around it; its
        clock runs from the meeting at the stop step."""
        split = self.before_transaction
        return dataclasses.replace(
            base,
            ok=ok,
            steps=(*self.steps[:split], *base.steps, *self.steps[split:]),
            seconds=time.perf_counter() - self.started,
            error=error if not ok else None,
            failed_step=step if not ok else None,
            notes=(*base.notes, *self.notes),
        )


def _own(kind: OperationKind, actions: RankActions, action: Callable[[], OperationResult]) -> OperationResult:
    """This rank's part, as a result even where its transaction raised (a refusal of its own before it
    changed anything: memory the driver cannot checkpoint made since, no host room, a sticky CUDA
    error): the protocol must go on to post this rank's word and bring its NCCL back, or every rank
    waits out its deadlines and trains on with its communicators suspended."""
    try:
        return action()
    except Exception as exc:
        return untouched(kind, actions, f"{type(exc).__name__}: {exc}", str(getattr(exc, "step", None) or kind.value))


def untouched(kind: OperationKind, actions: RankActions, error: str, step: str) -> OperationResult:
    """The result of an operation given up before this rank changed anything."""
    return OperationResult(
        kind=kind,
        path="none",
        ok=False,
        logical_device=actions.logical_device,
        source=actions.source,
        target=None,
        failed_step=step,
        error=error,
    )


def _stayed(actions: RankActions) -> OperationResult:
    return OperationResult(
        kind=OperationKind.MIGRATE,
        path="stayed",
        ok=True,
        logical_device=actions.logical_device,
        source=actions.source,
        target=actions.source,
        notes=("this rank stayed on its GPU while the job's other ranks moved",),
    )


def shared_gpu_problem(
    rv: Rendezvous, source: GpuIdentity, lands_on: GpuIdentity | None, *, deadline_s: float
) -> str | None:
    """Why the operation would leave a rank that the driver restores (`lands_on`: where; None: this
    rank stays on `source`, never checkpointed) on one GPU with another rank of its NCCL job, with
    what to do; None when each such rank has its GPU to itself. NCCL's next collective fails in a
    rank restored on a GPU it shares with another rank of its job (fact `nccl-ranks-sharing-gpu-fail`). Every
    rank posts where it will be, so every rank reaches the same verdict before anything changes."""
    own = f"restored {lands_on.uuid}" if lands_on is not None else f"stays {source.uuid}"
    words = rv.gather("placement", own, deadline_s=deadline_s, what="say which GPU it will be on").words
    placement: dict[int, str | None] = {}
    restored: set[int] = set()
    for rank, word in words.items():
        how, _, uuid = word.partition(" ")
        placement[rank] = uuid
        if how == "restored":
            restored.add(rank)
    return protocol.nccl_ranks_on_one_gpu(placement, restored)


def _word(result: OperationResult) -> str:
    return OK if result.ok else f"{result.failed_step or 'failed'}: {result.error}"


def _suspend(communicators: list[nccl.Communicator]) -> str:
    for comm in communicators:
        try:
            comm.suspend()
        except Exception as exc:
            return f"could not suspend NCCL ({comm.name}): {exc}"
    return OK


def _resume_suspended(communicators: list[nccl.Communicator]) -> str:
    for comm in communicators:
        try:
            if comm.is_suspended():
                comm.resume()
        except Exception as exc:
            return f"could not resume NCCL ({comm.name}): {exc}"
    return OK


def check_collective(world_size: int) -> str:
    """One all-reduce over the default group through the resumed communicators."""
    torch = sys.modules["torch"]
    dist = torch.distributed
    device = torch.device("cpu")
    if "nccl" in str(dist.get_backend()):
        device = torch.device("cuda", torch.cuda.current_device())
    probe = torch.ones(1, device=device)
    dist.all_reduce(probe)
    value = float(probe.item())
    return OK if value == float(world_size) else f"the check all-reduce gave {value:g}, not {world_size}"


def migrate_or_pause(
    op: JobOperation,
    rv: Rendezvous,
    actions: RankActions,
    deadlines: Deadlines,
    *,
    find_communicators: Callable[[], list[nccl.Communicator]] = nccl.communicators,
    check: Callable[[int], str] = check_collective,
    stop_step: int | None = None,
) -> OperationResult:
    """Steps 2-5 at the stop step, on the training thread. A pause that succeeds on every rank
    returns with NCCL still suspended (the resume resumes it)."""
    timeline = _Timeline()
    if stop_step is not None:
        timeline.notes.append(f"{STOPPED_AT} {stop_step} of this process (every rank of {op.world_size} at its own)")
    kind = op.kind
    try:
        timeline.timed("meet", lambda: rv.gather("at", OK, deadline_s=deadlines.meet_s, what="reach the stop step"))
    except JobAborted as exc:
        return untouched(kind, actions, f"the job's ranks did not meet, nothing changed: {exc}", "meet")
    torch_bridge.synchronize()
    drained_at = time.monotonic()
    try:
        communicators = find_communicators()
        suspended = str(timeline.timed("suspend_nccl", lambda: _suspend(communicators)))
    except Exception as exc:
        communicators, suspended = [], f"could not reach NCCL: {exc}"
    try:
        words = rv.gather("suspended", suspended, deadline_s=deadlines.meet_s, what="suspend NCCL")
    except JobAborted as exc:
        words = Gathered({op.rank: f"{exc}"})
    if not words.all_ok:
        resumed = _resume_suspended(communicators)
        error = f"NCCL could not be suspended on every rank, nothing moved ({words.describe_failures()})"
        if resumed != OK:
            error += f"; then {resumed}: the job's collectives may fail, restart it"
        return untouched(kind, actions, error, "suspend_nccl")

    if communicators and (kind == OperationKind.PAUSE or actions.move is not None):
        timeline.timed("watchdog", lambda: _let_watchdog_look(drained_at))
    if kind == OperationKind.PAUSE:
        assert actions.pause is not None and actions.resume_in_place is not None
        own = _own(kind, actions, actions.pause)
        timeline.mark_transaction()
        everyone = _gather_outcome(rv, "paused", own, deadlines, what="pause")
        if everyone.all_ok:
            timeline.notes.append(f"every rank of the {op.world_size} paused; NCCL stays suspended until the resume")
            return timeline.result(own, ok=True)
        undone = _own(kind, actions, actions.resume_in_place) if own.ok else own
        error = f"the job could not pause on every rank ({everyone.describe_failures()})"
        if own.ok:
            error += "; this rank was resumed where it was" if undone.ok else f"; resuming it failed: {undone.error}"
        return _attach(op, rv, timeline, own, communicators, deadlines, check, failure=(error, "pause"))

    own = _own(kind, actions, actions.move) if actions.move is not None else _stayed(actions)
    timeline.mark_transaction()
    everyone = _gather_outcome(rv, "moved", own, deadlines, what="move")
    if everyone.all_ok:
        return _attach(op, rv, timeline, own, communicators, deadlines, check)
    error = f"the job's move failed ({everyone.describe_failures()}); every rank is back on the GPU it was on"
    if own.ok and actions.move is not None and actions.move_back is not None:
        back = _own(kind, actions, actions.move_back)
        if not back.ok:
            error = f"{error}, except this rank, whose move back failed: {back.error}"
    return _attach(op, rv, timeline, own, communicators, deadlines, check, failure=(error, "move"))


def resume(
    op: JobOperation,
    rv: Rendezvous,
    actions: RankActions,
    deadlines: Deadlines,
    *,
    find_communicators: Callable[[], list[nccl.Communicator]],
    check: Callable[[int], str] = check_collective,
) -> OperationResult:
    """A paused job's resume, on the parked training thread. `find_communicators` are the ones
    the pause suspended."""
    assert actions.resume is not None and actions.pause_again is not None
    timeline = _Timeline()
    try:
        timeline.timed("meet", lambda: rv.gather("ready", OK, deadline_s=deadlines.agree_s, what="take the resume up"))
    except JobAborted as exc:
        return untouched(op.kind, actions, f"the job's ranks did not meet, every rank stays paused: {exc}", "meet")
    own = _own(op.kind, actions, actions.resume)
    timeline.mark_transaction()
    everyone = _gather_outcome(rv, "restored", own, deadlines, what="resume")
    if not everyone.all_ok:
        error = f"the job could not resume on every rank ({everyone.describe_failures()})"
        if own.ok:
            again = _own(op.kind, actions, actions.pause_again)
            error += (
                "; this rank was paused again, so the job stays paused: resume it again"
                if again.ok
                else f"; pausing this rank again failed: {again.error}"
            )
        return timeline.result(own, ok=False, error=error, step="resume")
    return _attach(op, rv, timeline, own, find_communicators(), deadlines, check)


def _gather_outcome(rv: Rendezvous, stage: str, own: OperationResult, deadlines: Deadlines, *, what: str) -> Gathered:
    try:
        return rv.gather(stage, _word(own), deadline_s=deadlines.move_s, what=what)
    except JobAborted as exc:
        return Gathered({rv.rank: f"{exc}"})


def _let_watchdog_look(drained_at: float) -> None:
    """Waits, before this rank locks, until torch's NCCL watchdog has looked at its collectives
    twice since the GPU drained (WATCHDOG_LOOKS_S): suspending NCCL usually takes longer."""
    left = WATCHDOG_LOOKS_S - (time.monotonic() - drained_at)
    if left > 0:
        time.sleep(left)


def _attach(
    op: JobOperation,
    rv: Rendezvous,
    timeline: _Timeline,
    own: OperationResult,
    communicators: list[nccl.Communicator],
    deadlines: Deadlines,
    check: Callable[[int], str],
    *,
    failure: tuple[str, str] | None = None,
) -> OperationResult:
    """Step 5 on every rank: NCCL resumed (collective) and checked, whatever happened before."""
    try:
        # Not abortable: a rank that gave up earlier comes here too, and a rank moving back may be slow.
        timeline.timed(
            "meet_again",
            lambda: rv.gather("attach", OK, deadline_s=deadlines.move_s, what="come back", abortable=False),
        )
        word = str(timeline.timed("resume_nccl", lambda: _resume_suspended(communicators)))
        if word == OK:
            word = str(timeline.timed("check_nccl", lambda: check(op.world_size)))
    except Exception as exc:  # JobAborted or a failed collective
        word = f"{exc}"
    if word != OK:
        log.critical("the job's NCCL did not come back after %s: %s", op.kind.value, word)
        error = f"{failure[0]}; " if failure else ""
        return timeline.result(
            own, ok=False, error=f"{error}NCCL did not come back ({word}): restart the job", step="resume_nccl"
        )
    if failure is not None:
        return timeline.result(own, ok=False, error=failure[0], step=failure[1])
    return timeline.result(own, ok=own.ok, error=own.error, step=own.failed_step)
