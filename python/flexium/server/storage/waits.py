"""The resume-when-free queue's rows: a wait is a paused job (one process, or a job of several
ranks, held by its lowest rank) to be resumed when its host has room. Queued by a person
(``create_wait``) or by the server making room (``queue_wait``); turned into an ordinary resume
command by the queue (``server/policies/resume_when_free.py``), back to waiting when the job
refuses that resume (its own room check), done when it succeeds; cancelled by a person, by a
plain pause or resume, or when the job cannot resume any more. Every change is audited in the
transaction that makes it."""

from __future__ import annotations

import bisect
from collections.abc import Container, Iterator
from dataclasses import dataclass
from typing import Any

from sqlalchemy import ColumnElement, and_, func, or_, select
from sqlalchemy.exc import IntegrityError
from sqlalchemy.orm import Session

from flexium import protocol, wire
from flexium.server.errors import Busy, InvalidRequest, InvalidState, NotFound, Stale, TargetRefused
from flexium.server.models import Command, Device, Placement, Process, Wait
from flexium.server.storage.audit import PolicyActor, given_why, record_wait
from flexium.server.storage.devices import device_indexes, held_by_gpu, host_devices
from flexium.server.storage.jobs import is_job_rank, job_ranks
from flexium.server.storage.processes import active_command, find_process
from flexium.server.storage.reservations import drop_room_not_made, release_room, reservation_of, reservation_view
from flexium.server.storage.staleness import is_stale
from flexium.server.storage.targets import require_capability, resolve_target, target_refusal
from flexium.server.storage.views import stored_capabilities
from flexium.server.storage.workspaces import AuthInfo

Actor = AuthInfo | PolicyActor


@dataclass(frozen=True)
class Need:
    """Room a wait needs: ``nbytes`` on GPU ``gpu`` (None: any GPU of its host ``process`` may
    resume on), for ``process`` (a rank of a job, or the process itself)."""

    process: Process
    gpu: str | None
    nbytes: int


def processes_of(holder: Process, needs: list[Need]) -> list[Process]:
    """The wait's holder and every process its job needs resumed, each once."""
    return list({holder.pk: holder, **{need.process.pk: need.process for need in needs}}.values())


def standing(*, session: Session, holder: Process, needs: list[Need], now: float, stale_after: float) -> bool:
    """Whether a wait counts now, in the queue's pass and before the placements of its host: none of its
    processes has a command under way (its pause made room, a person's command) or is silent. One that
    does not is passed over until it counts again."""
    return not any(
        active_command(session=session, process_pk=proc.pk) is not None
        or is_stale(proc, now=now, stale_after=stale_after)
        for proc in processes_of(holder, needs)
    )


def standing_waits(
    *, session: Session, workspace_id: int, host: str, now: float, stale_after: float
) -> Iterator[tuple[Wait, Process, list[str]]]:
    """The host's waiting waits that count now (``standing``), in the queue's order, each with the
    GPUs its job waits for (the one it asked for, else those it may resume on)."""
    devices = host_devices(session=session, workspace_id=workspace_id, host=host)
    query = (
        select(Wait, Process)
        .join(Process, Process.pk == Wait.process_pk)
        .where(Wait.workspace_id == workspace_id, Wait.host == host, Wait.state == "waiting")
        .order_by(*queue_order())
    )
    for wait, holder in session.execute(query):
        needs = needs_of(session=session, wait=wait, holder=holder)
        if standing(session=session, holder=holder, needs=needs, now=now, stale_after=stale_after):
            uuids = [
                u
                for need in needs
                for u in ([need.gpu] if need.gpu is not None else may_resume_on(need.process, devices))
            ]
            yield wait, holder, uuids


def _waited_gpus(need: Need, devices: Container[str]) -> list[str]:
    return [need.gpu] if need.gpu is not None else may_resume_on(need.process, devices)


def needs_of(*, session: Session, wait: Wait, holder: Process) -> list[Need]:
    """What the wait's job needs to resume: a process on one GPU, its memory on the GPU it waits
    for (or any); a process on several, each GPU's share back where it was; a job of several
    ranks, each rank's memory back on its own GPU."""
    ranks = None
    if wait.job_key is not None:
        ranks = list(
            session.scalars(
                select(Process)
                .where(Process.workspace_id == wait.workspace_id, Process.job_key == wait.job_key)
                .order_by(Process.job_rank, Process.pk)
            )
        )
    return _needs(wait, holder, ranks)


def _needs(wait: Wait, holder: Process, ranks: list[Process] | None) -> list[Need]:
    """``needs_of`` on the ranks of the wait's job, read (None for a wait of one process)."""
    if wait.job_key is not None:
        return [Need(rank, rank.gpu_uuid, _need_bytes(rank)) for rank in ranks or () if rank.gpu_uuid is not None]
    shares = held_by_gpu(holder.gpu_uuid, max(holder.footprint_bytes, holder.memory_bytes), holder.gpu_bytes)
    if len(shares) > 1:
        return [Need(holder, uuid, held) for uuid, held in shares.items()]
    return [Need(holder, wait.gpu_uuid, _need_bytes(holder))]


def _need_bytes(proc: Process) -> int:
    return max(proc.footprint_bytes, proc.memory_bytes)


def live_wait_of(*, session: Session, proc: Process, for_update: bool = False) -> Wait | None:
    """The live wait of the process, or of its job (a job's wait is held by one rank). Read locked
    (``for_update``) it is skipped while the queue's pass holds it: the pass locks a wait, then its
    process, and a person's command the other way round; the pass then finds the process busy."""
    query = select(Wait).where(Wait.workspace_id == proc.workspace_id, Wait.state.in_(protocol.LIVE_WAIT_STATES))
    if is_job_rank(proc):
        query = query.where(Wait.job_key == proc.job_key)
    else:
        query = query.where(Wait.process_pk == proc.pk)
    if for_update:
        query = query.with_for_update(skip_locked=True)
    return session.scalar(query.limit(1))


def queue_wait(
    *,
    session: Session,
    workspace_id: int,
    actor: Actor,
    holder: Process,
    gpu_uuid: str | None,
    priority: int,
    reason: str,
    now: float,
    why: str | None = None,
    queued_at: float | None = None,
) -> Wait:
    """A wait written as it is asked (the caller checked the job): audited, one live wait per job;
    ``why``: the reason its requester gave; ``queued_at``: its place in the queue's order, when the job
    was queued first (now by default)."""
    row = Wait(
        workspace_id=workspace_id,
        process_pk=holder.pk,
        job_key=holder.job_key if is_job_rank(holder) else None,
        host=holder.host,
        gpu_uuid=gpu_uuid,
        priority=priority,
        state="waiting",
        created_at=now if queued_at is None else queued_at,
        dispatches=0,
        requested_by=(actor.label if isinstance(actor, PolicyActor) else actor.token_name)[: protocol.MAX_SHORT_TEXT],
        token_id=None if isinstance(actor, PolicyActor) else actor.token_id,
        reason=reason[: protocol.MAX_LONG_TEXT],
        why=why or None,
    )
    session.add(row)
    try:
        session.flush()
    except IntegrityError:
        raise Busy(f"process {holder.process_id!r} is already waiting in the queue") from None
    shown = wait_view(session=session, row=row, holder=holder, now=now)
    record_wait(
        session=session,
        workspace_id=workspace_id,
        actor=actor,
        action="wait.created",
        wait=shown,
        detail=row.reason + given_why(row.why),
        now=now,
    )
    return row


def create_wait(
    *, session: Session, workspace_id: int, actor: AuthInfo, request: wire.WaitRequest, now: float, stale_after: float
) -> tuple[Wait, float | None]:
    """A person queues a paused job (``flexium resume JOB --when-free``): checked as its resume
    would be but for room. A job queued already keeps its place: its wait stays as it is when the same
    GPU is asked for (a new reason noted), and is replaced by one queued at the same time for another.
    The wait, and when the job was queued first where it was already (None: queued now)."""
    proc = find_process(session=session, workspace_id=workspace_id, process_id=request.process_id, for_update=True)
    holder, priority = paused_job(session=session, proc=proc, now=now, stale_after=stale_after)
    gpu = wanted_gpu(session=session, proc=proc, request=request, now=now, stale_after=stale_after)
    gpu_uuid = None if gpu is None else gpu.uuid
    who = actor.token_name or f"token {actor.token_id}"
    earlier = live_wait_of(session=session, proc=proc, for_update=True)
    queued_before = None
    if earlier is not None and earlier.state == "waiting":  # one whose resume is under way stays: queue_wait refuses
        if earlier.gpu_uuid == gpu_uuid:
            if request.reason:
                earlier.why = request.reason
            return earlier, earlier.created_at
        queued_before = earlier.created_at
        end_wait(session=session, row=earlier, state="cancelled", note=f"queued again by {who}", actor=actor, now=now)
    where = "any GPU of its host" if gpu is None else f"GPU {gpu.index if gpu.index is not None else gpu.uuid}"
    row = queue_wait(
        session=session,
        workspace_id=workspace_id,
        actor=actor,
        holder=holder,
        gpu_uuid=gpu_uuid,
        priority=priority,
        reason=f"queued by {who} to resume on {where} when free",
        now=now,
        why=request.reason,
        queued_at=queued_before,
    )
    return row, queued_before


def paused_job(*, session: Session, proc: Process, now: float, stale_after: float) -> tuple[Process, int]:
    """(the process that holds the job's wait, the job's priority) of a paused job that can be
    resumed now but for room; a job of several ranks is checked rank by rank, as its resume is."""
    if is_job_rank(proc):
        ranks = job_ranks(
            session=session,
            workspace_id=proc.workspace_id,
            addressed=proc,
            kind="resume",
            now=now,
            stale_after=stale_after,
        )
        return ranks[min(ranks)], max(rank.priority for rank in ranks.values())
    if is_stale(proc, now=now, stale_after=stale_after):
        raise Stale(
            f"process {proc.process_id!r} sent no heartbeat for {now - proc.last_seen:.0f} s; it is not listening"
        )
    active = active_command(session=session, process_pk=proc.pk)
    if active is not None:
        raise Busy(
            f"process {proc.process_id!r} has command {active.id} ({active.kind}, {active.state}) under way; queue it "
            "once that ended",
            detail={"command_id": active.id},
        )
    if proc.state != "PAUSED":
        hint = f"; pause it first (flexium pause {proc.process_id})" if proc.state == "RUNNING" else ""
        raise InvalidState(f"cannot queue a resume of process {proc.process_id!r}: it is {proc.state}{hint}")
    require_capability(proc, protocol.CAP_PAUSE_RESUME, "resume")
    return proc, proc.priority


def wanted_gpu(
    *, session: Session, proc: Process, request: wire.WaitRequest, now: float, stale_after: float
) -> Device | None:
    """The GPU a wait asks for (None: any), checked by the target rules but for room."""
    if request.host is not None and request.host != proc.host:
        raise TargetRefused(
            f"process {proc.process_id!r} is on host {proc.host!r}, not on host {request.host!r}: a job resumes only "
            f"on GPUs of its own host (leave --host out, or give --host {proc.host})"
        )
    if request.gpu is None or request.gpu in ("", *protocol.AUTO_TARGET_WORDS):
        return None
    if is_job_rank(proc):
        raise InvalidRequest(
            f"process {proc.process_id!r} is a rank of job {proc.job_key!r}: a job of several ranks resumes where its "
            "ranks paused, each on its own GPU; queue it without a GPU"
        )
    if len(held_by_gpu(proc.gpu_uuid, proc.footprint_bytes, proc.gpu_bytes)) > 1:
        raise InvalidRequest(
            f"process {proc.process_id!r} uses several GPUs: it resumes where each share paused; queue it without a GPU"
        )
    device = resolve_target(session=session, proc=proc, target=request.gpu)
    refusal = target_refusal(proc=proc, dev=device, kind="resume", now=now, stale_after=stale_after, room=False)
    if refusal is not None:
        if not stored_capabilities(proc).migration and device.uuid != proc.gpu_uuid:
            require_capability(proc, protocol.CAP_MIGRATION, "resume on another GPU")
        raise TargetRefused(f"GPU {device.uuid} cannot take process {proc.process_id!r}: {refusal}")
    return device


def cancel_live_wait(
    *, session: Session, workspace_id: int, actor: Actor | None, proc: Process, why: str, now: float
) -> wire.WaitInfo | None:
    """Takes the job out of the queue (a wait whose resume is under way stays: it is what the
    job does now); None when it was not waiting."""
    row = live_wait_of(session=session, proc=proc, for_update=True)
    if row is None or row.state != "waiting":
        return None
    return end_wait(session=session, row=row, state="cancelled", note=why, actor=actor, now=now)


def end_wait(
    *, session: Session, row: Wait, state: str, note: str | None, actor: Actor | None, now: float
) -> wire.WaitInfo:
    """The wait done or cancelled, its room released; a cancellation is audited (``actor`` None:
    the server, on its own)."""
    row.state = state
    row.finished_at = now
    row.note = None if note is None else note[: protocol.MAX_LONG_TEXT]
    release_room(session=session, wait_id=row.id)
    holder = session.get(Process, row.process_pk)
    shown = wait_view(session=session, row=row, holder=holder, now=now)
    if state == "cancelled":
        record_wait(
            session=session,
            workspace_id=row.workspace_id,
            actor=actor,
            action="wait.cancelled",
            wait=shown,
            detail=note or "",
            now=now,
        )
    return shown


def cancel_wait(*, session: Session, workspace_id: int, actor: AuthInfo, wait_id: int, now: float) -> wire.WaitInfo:
    row = session.scalar(select(Wait).where(Wait.id == wait_id, Wait.workspace_id == workspace_id).with_for_update())
    if row is None:
        raise NotFound(f"wait {wait_id} not found")
    if row.state != "waiting":
        hint = f": its resume, command {row.command_id}, is under way" if row.state == "dispatched" else ""
        raise InvalidState(f"wait {wait_id} is {row.state}{hint}; only a waiting one can be cancelled")
    who = actor.token_name or f"token {actor.token_id}"
    return end_wait(session=session, row=row, state="cancelled", note=f"cancelled by {who}", actor=actor, now=now)


def command_ended(*, session: Session, cmd: Command, proc: Process, now: float) -> None:
    """What a command's end means to the queue, in its transaction. The resume a wait dispatched:
    done when it succeeded; refused by the job (its own room check) or never taken, the job waits
    again, judged only on GPU reports newer than now. A pause that fails leaves the job running:
    the wait made for it to resume (making room) means nothing any more."""
    wait = session.scalar(
        select(Wait).where(Wait.workspace_id == cmd.workspace_id, Wait.command_id == cmd.id, Wait.state == "dispatched")
    )
    if wait is not None:
        if cmd.state == "succeeded":
            end_wait(session=session, row=wait, state="done", note=None, actor=None, now=now)
        elif proc.state == "PAUSED":
            wait.state = "waiting"
            wait.refused_at = now
            wait.note = f"resume {cmd.id} {cmd.state}: {cmd.error or 'no reason given'}"[: protocol.MAX_LONG_TEXT]
        else:
            end_wait(
                session=session,
                row=wait,
                state="cancelled",
                note=f"resume {cmd.id} {cmd.state} and the job is {proc.state}: it cannot wait to resume",
                actor=None,
                now=now,
            )
    elif cmd.kind == "pause" and cmd.state != "succeeded":
        outcome = f"{cmd.state}: {cmd.error}" if cmd.error else cmd.state
        cancel_live_wait(
            session=session,
            workspace_id=cmd.workspace_id,
            actor=None,
            proc=proc,
            why=f"its pause, command {cmd.id}, {outcome}; it runs on",
            now=now,
        )
        _room_not_made(session=session, cmd=cmd, proc=proc, outcome=outcome)


ROOM_NOT_MADE = "room not made"


def since_room_not_made(old: str | None, note: str) -> str:
    """A note a queue's pass writes, followed by what a failed make-room said in the note before, if it did:
    flexium run and the dashboard show why the room it held is gone until the job is placed."""
    kept = "" if old is None or ROOM_NOT_MADE + ":" not in old else old[old.index(ROOM_NOT_MADE + ":") :]
    return (f"{note}; {kept}" if kept else note)[: protocol.MAX_LONG_TEXT]


def _room_not_made(*, session: Session, cmd: Command, proc: Process, outcome: str) -> None:
    """The room a failed make-room pause was making will not come: its holds go (drop_room_not_made), and the
    waits and placements they held it for say why; they wait on for room as any other."""
    for held in drop_room_not_made(session=session, cmd=cmd, proc=proc):
        note = (
            f"{ROOM_NOT_MADE}: pausing {proc.process_id} (command {cmd.id}) {outcome}; no room is held for it now, "
            "it waits in the queue for room to show"
        )[: protocol.MAX_LONG_TEXT]
        wait = None if held.wait_id is None else session.get(Wait, held.wait_id)
        if wait is not None and wait.state == "waiting":
            wait.note = note
        for placement in session.scalars(select(Placement).where(Placement.reservation_id == held.id)):
            placement.reservation_id = None
            placement.note = note


def get_wait(*, session: Session, workspace_id: int, wait_id: int, now: float) -> wire.WaitInfo:
    row = session.scalar(select(Wait).where(Wait.id == wait_id, Wait.workspace_id == workspace_id))
    if row is None:
        raise NotFound(f"wait {wait_id} not found")
    return wait_view(session=session, row=row, holder=session.get(Process, row.process_pk), now=now)


def wait_of_command(*, session: Session, workspace_id: int, command_id: int, now: float) -> wire.WaitInfo | None:
    """The wait whose resume ``command_id`` was, if any."""
    row = session.scalar(
        select(Wait).where(Wait.workspace_id == workspace_id, Wait.command_id == command_id).order_by(Wait.id.desc())
    )
    return (
        None
        if row is None
        else wait_view(session=session, row=row, holder=session.get(Process, row.process_pk), now=now)
    )


def list_waits(
    *,
    session: Session,
    workspace_id: int,
    now: float,
    process_id: str | None = None,
    live: bool = True,
    limit: int = 100,
) -> list[wire.WaitInfo]:
    """Live waits in queue order (host, then place: a higher priority first, first come first
    served within one), or with ``live=False`` every wait, newest first; ``process_id``: that
    process's job's."""
    query = select(Wait, Process).join(Process, Process.pk == Wait.process_pk).where(Wait.workspace_id == workspace_id)
    if process_id is not None:
        proc = find_process(session=session, workspace_id=workspace_id, process_id=process_id)
        query = query.where(Wait.job_key == proc.job_key if is_job_rank(proc) else Wait.process_pk == proc.pk)
    if live:
        query = query.where(Wait.state.in_(protocol.LIVE_WAIT_STATES)).order_by(*queue_order())
    else:
        query = query.order_by(Wait.id.desc())
    positions: dict[str, int] = {}
    placed: dict[str, list[tuple[int, float]]] = {}  # by host: its waiting placements' places in the queue's order
    indexes = device_indexes(session=session, workspace_id=workspace_id)
    shown = []
    for row, holder in session.execute(query.limit(limit)):
        position = None
        if row.state == "waiting":
            position = positions[row.host] = positions.get(row.host, 0) + 1
            if row.host not in placed:  # read once per host for the whole list
                placed[row.host] = _placement_places(session, workspace_id, row.host)
            position += _placements_ahead(placed[row.host], row)
        shown.append(wait_view(session=session, row=row, holder=holder, now=now, position=position, indexes=indexes))
    return shown


def _position(session: Session, row: Wait) -> int:
    """Its place in its host's queue (1: next), by ``queue_order``: the paused jobs' waits and flexium run's
    placements are one queue (_placements_ahead)."""
    ahead = session.scalar(
        select(func.count()).where(
            Wait.workspace_id == row.workspace_id,
            Wait.host == row.host,
            Wait.state == "waiting",
            or_(
                Wait.priority > row.priority,
                and_(
                    Wait.priority == row.priority,
                    or_(Wait.created_at < row.created_at, and_(Wait.created_at == row.created_at, Wait.id < row.id)),
                ),
            ),
        )
    )
    places = _placement_places(session, row.workspace_id, row.host)
    return int(ahead or 0) + _placements_ahead(places, row) + 1


def _placements_ahead(places: list[tuple[int, float]], row: Wait) -> int:
    """How many of the host's waiting placements (``_placement_places``) go before the wait in the queue's one
    order: a higher priority, or the same one asked for earlier (a paused job's wait goes first on a tie:
    waits_ahead)."""
    return bisect.bisect_left(places, (-row.priority, row.created_at))


def _placement_places(session: Session, workspace_id: int, host: str) -> list[tuple[int, float]]:
    """(-priority, asked at) of the host's waiting placements, sorted: the queue's order of them."""
    rows = session.execute(
        select(Placement.priority, Placement.created_at).where(
            Placement.workspace_id == workspace_id, Placement.host == host, Placement.state == "waiting"
        )
    )
    return sorted((-priority, created_at) for priority, created_at in rows)


def waits_ahead(session: Session, workspace_id: int, host: str, priority: int, created_at: float) -> int:
    """The paused jobs' waits waiting ahead of a placement of ``priority`` asked for at ``created_at``."""
    return int(
        session.scalar(
            select(func.count()).where(
                Wait.workspace_id == workspace_id,
                Wait.host == host,
                Wait.state == "waiting",
                or_(Wait.priority > priority, and_(Wait.priority == priority, Wait.created_at <= created_at)),
            )
        )
        or 0
    )


def queue_order(row: type[Wait] | type[Placement] = Wait) -> tuple[ColumnElement[Any], ...]:
    """The queue's one order, of waits and of flexium run's placements: by host, a higher priority
    first, first come first served within one."""
    return (
        row.workspace_id.expression,
        row.host.expression,
        row.priority.desc(),
        row.created_at.expression,
        row.id.expression,
    )


def wait_view(
    *,
    session: Session,
    row: Wait,
    holder: Process | None,
    now: float,
    position: int | None = None,
    indexes: dict[str, int | None] | None = None,
) -> wire.WaitInfo:
    """``indexes``: the workspace's GPU indexes (device_indexes), read once for a listing."""
    needs = [] if holder is None else needs_of(session=session, wait=row, holder=holder)
    if row.gpu_uuid is not None and indexes is None:
        indexes = device_indexes(session=session, workspace_id=row.workspace_id, host=row.host)
    reservation = reservation_of(session=session, wait_id=row.id, now=now)
    if position is None and row.state == "waiting":
        position = _position(session, row)
    return wire.WaitInfo(
        id=row.id,
        process_id=holder.process_id if holder is not None else "",
        job_key=row.job_key,
        host=row.host,
        gpu_uuid=row.gpu_uuid,
        gpu_index=None if row.gpu_uuid is None or indexes is None else indexes.get(row.gpu_uuid),
        priority=row.priority,
        state=row.state,  # type: ignore[arg-type]  # one of protocol.WAIT_STATES, written here only
        position=position,
        need_bytes=max((need.nbytes for need in needs), default=0),
        created_at=row.created_at,
        finished_at=row.finished_at,
        command_id=row.command_id,
        dispatches=row.dispatches,
        requested_by=row.requested_by,
        reason=row.reason,
        why=row.why,
        note=row.note or _not_paused_yet(row, holder),
        reservation=None if reservation is None else reservation_view(reservation),
    )


def _not_paused_yet(row: Wait, holder: Process | None) -> str | None:
    """A wait queued with the pause that frees its job's GPU (make room's, a drain's): its job still runs, and
    the queue counts it once that pause is done."""
    if row.state != "waiting" or holder is None or holder.state == "PAUSED":
        return None
    return f"not paused yet ({holder.state}): its pause is under way; it waits in the queue once paused"


@dataclass(frozen=True)
class QueueView:
    """The queue as a server keeps it in memory: what each waiting job's processes watch
    ((workspace id, process id) -> the GPUs it may resume on and the room it needs there), and the
    hosts (workspace id, host) with a job waiting (paused, or not started yet: flexium run's
    placements), whose GPU reports the queue runs on."""

    watches: dict[tuple[int, str], wire.RoomWatch]
    hosts: frozenset[tuple[int, str]]


def queue_view(*, session: Session) -> QueueView:
    """Read in four queries, however long the queue: the waits with their processes, the hosts with
    a placement, the GPUs of their hosts, the ranks of the jobs of several among them."""
    waits = session.execute(
        select(Wait, Process).join(Process, Process.pk == Wait.process_pk).where(Wait.state == "waiting")
    ).all()
    placing = select(Placement.workspace_id, Placement.host).where(Placement.state.in_(protocol.LIVE_PLACEMENT_STATES))
    hosts = frozenset((wait.workspace_id, wait.host) for wait, _holder in waits) | frozenset(
        (ws, host) for ws, host in session.execute(placing.distinct())
    )
    gpus: dict[tuple[int, str], set[str]] = {key: set() for key in hosts}
    if hosts:
        for workspace_id, host, uuid in session.execute(
            select(Device.workspace_id, Device.host, Device.uuid).where(Device.host.in_({host for _ws, host in hosts}))
        ):
            gpus.get((workspace_id, host), set()).add(uuid)
    ranks: dict[tuple[int, str], list[Process]] = {}
    job_keys = {wait.job_key for wait, _holder in waits if wait.job_key is not None}
    if job_keys:
        for rank in session.scalars(
            select(Process).where(Process.job_key.in_(job_keys)).order_by(Process.job_rank, Process.pk)
        ):
            ranks.setdefault((rank.workspace_id, rank.job_key or ""), []).append(rank)
    watches: dict[tuple[int, str], wire.RoomWatch] = {}
    for wait, holder in waits:
        job_ranks = None if wait.job_key is None else ranks.get((wait.workspace_id, wait.job_key), [])
        needs = _needs(wait, holder, job_ranks)
        watches.update(room_watches(wait, needs, gpus[(wait.workspace_id, wait.host)]))
    return QueueView(watches=watches, hosts=hosts)


def room_watches(wait: Wait, needs: list[Need], host_gpus: Container[str]) -> dict[tuple[int, str], wire.RoomWatch]:
    """What each process of a waiting job watches: (workspace id, process id) -> the GPUs of its host
    (``host_gpus``: their UUIDs) it may resume on and the room it needs there."""
    watches = {}
    for need in needs:
        uuids = [need.gpu] if need.gpu is not None else may_resume_on(need.process, host_gpus)
        watches[(wait.workspace_id, need.process.process_id)] = wire.RoomWatch(
            wait_id=wait.id, gpus=uuids, need_bytes=need.nbytes
        )
    return watches


def may_resume_on(proc: Process, devices: Container[str]) -> list[str]:
    """The GPUs of its host a paused process may resume on: those it sees, or its own alone when it
    cannot migrate."""
    if not stored_capabilities(proc).migration:
        return [proc.gpu_uuid] if proc.gpu_uuid else []
    visible = list(proc.visible_gpus or [])
    return [uuid for uuid in visible if uuid in devices] or ([proc.gpu_uuid] if proc.gpu_uuid else [])
