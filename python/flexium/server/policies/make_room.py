"""Making room on one GPU for a job of a higher priority: pause the fewest running jobs of lower
priority there that free what it needs (the lowest priorities among equally few), hold that room
for it (a reservation the queue's other waits cannot take, until it resumes or the reservation
expires), and queue the jobs paused to resume when free. A job of equal or higher priority is never
paused for it; when no GPU can be made room on, the refusal says why, GPU by GPU, and nothing
changes.

``plan_room`` and ``make_room`` take "bytes on a GPU for someone" (``Beneficiary``): a paused job
(``resume_making_room``, ``flexium resume JOB --make-room``) or a job that is not started yet
(``policies/placement.py``)."""

from __future__ import annotations

import dataclasses
import itertools
from collections.abc import Callable, Mapping
from dataclasses import dataclass

from sqlalchemy import select
from sqlalchemy.orm import Session

from flexium import protocol, wire
from flexium.server.errors import InvalidRequest, TargetRefused
from flexium.server.models import Device, Placement, Process, Reservation, Wait
from flexium.server.policies.room import HostRoom
from flexium.server.storage.audit import given_why, record_commands_created
from flexium.server.storage.commands import create_commands
from flexium.server.storage.devices import held_by_gpu, host_devices
from flexium.server.storage.jobs import is_job_rank
from flexium.server.storage.processes import active_command, find_process
from flexium.server.storage.reservations import MAKE_ROOM, hold_room, lock_hosts
from flexium.server.storage.staleness import is_stale
from flexium.server.storage.targets import target_refusal
from flexium.server.storage.views import stored_capabilities
from flexium.server.storage.waits import (
    cancel_live_wait,
    live_wait_of,
    may_resume_on,
    paused_job,
    queue_order,
    queue_wait,
    standing_waits,
    wanted_gpu,
)
from flexium.server.storage.workspaces import AuthInfo
from flexium.units import gib

# Choices of victims are tried exhaustively up to this many candidates on one GPU, greedily past it.
_EXHAUSTIVE = 12


@dataclass(frozen=True)
class Beneficiary:
    """Whom room is made for: ``label`` in words, its ``priority``, the bytes it ``needs``, the
    processes that are its own (never paused for it), the GPU it paused on (no headroom back on an
    empty one), its wait (None: a job not started yet) and the reason its requester gave (``why``,
    which the pauses carry)."""

    label: str
    priority: int
    need: int
    own: frozenset[int] = frozenset()
    home: str | None = None
    wait_id: int | None = None
    why: str | None = None


@dataclass(frozen=True)
class Victim:
    """A running job whose pause frees ``frees`` bytes on the GPU: one process, or a job of several
    ranks (every rank pauses), addressed through ``addressed``."""

    addressed: Process
    processes: tuple[Process, ...]
    priority: int
    frees: int

    @property
    def label(self) -> str:
        if is_job_rank(self.addressed):
            return f"job {self.addressed.job_key!r}"
        return f"process {self.addressed.process_id!r}"


@dataclass(frozen=True)
class RoomPlan:
    device: Device
    victims: tuple[Victim, ...]
    required: int  # what the beneficiary takes there, headroom included

    @property
    def paused(self) -> str:
        """Whom it pauses, in words."""
        return ", ".join(victim.label for victim in self.victims) or "no job: the room is free"


@dataclass(frozen=True)
class RoomMade:
    """A plan carried out: the pauses sent, and the room held for the beneficiary."""

    pauses: list[wire.CommandInfo]
    reservation: Reservation


def plan_room(
    *,
    session: Session,
    workspace_id: int,
    host: str,
    candidates: Callable[[HostRoom], Mapping[str, str | None]],
    beneficiary: Beneficiary,
    now: float,
    stale_after: float,
) -> RoomPlan:
    """The GPU to make room on and whom to pause there, counted on the host's room read locked (two
    make-rooms on one host count one after the other). ``candidates``: of the host's GPUs, UUID ->
    why the beneficiary cannot go there but for room (None: it can). TargetRefused says why no GPU
    will do, GPU by GPU."""
    lock_hosts(session=session, hosts=[(workspace_id, host)])
    room = HostRoom.read(session=session, workspace_id=workspace_id, host=host, now=now)
    gpus = candidates(room)
    units = _running_jobs(session=session, workspace_id=workspace_id, host=host, now=now, stale_after=stale_after)
    higher = _higher_priority_waiting(
        session=session, workspace_id=workspace_id, host=host, beneficiary=beneficiary, now=now, stale_after=stale_after
    )
    plans: list[RoomPlan] = []
    why_not: list[str] = []
    for uuid, refusal in gpus.items():
        gpu = room.gpus.get(uuid)
        if gpu is None:
            continue
        name = f"GPU {gpu.device.index if gpu.device.index is not None else uuid}"
        if refusal is not None:
            why_not.append(f"{name}: {refusal}")
            continue
        if uuid in higher:  # a higher priority is never delayed by a lower one
            why_not.append(f"{name}: {higher[uuid]} of a higher priority waits for it first")
            continue
        required = room.required(uuid, beneficiary.need, home=beneficiary.home)
        free = room.free_for(uuid, beneficiary.wait_id)
        holders = _holders(units, uuid, beneficiary)
        victims = _fewest(holders.lower, required - free)
        if victims is None:
            held = room.gpus[uuid].free - free  # for others: placed jobs not started, room made for others
            why_not.append(_why_not(name, free, required, holders, held))
        else:
            plans.append(RoomPlan(gpu.device, victims, required))
    if not plans:
        reasons = "; ".join(why_not) or "it reported no GPU"
        raise TargetRefused(
            f"cannot make room for {beneficiary.label} (priority {protocol.priority_name(beneficiary.priority)}) on "
            f"host {host!r}: {reasons}. Jobs of its priority or higher are never paused for it: give it a higher "
            "priority, or let it wait in the queue for room without pausing others (flexium resume --when-free; "
            "flexium run without --make-room)"
        )
    return min(plans, key=lambda plan: _cost(plan, beneficiary, room))


def _higher_priority_waiting(
    *, session: Session, workspace_id: int, host: str, beneficiary: Beneficiary, now: float, stale_after: float
) -> dict[str, str]:
    """GPU UUID -> the first job of a higher priority than the beneficiary's that waits for it (a paused
    job's wait the queue counts now, a flexium run placement): room made there would go to the
    beneficiary ahead of it."""
    found: dict[str, str] = {}
    for wait, holder, uuids in standing_waits(
        session=session, workspace_id=workspace_id, host=host, now=now, stale_after=stale_after
    ):
        if wait.priority > beneficiary.priority and holder.pk not in beneficiary.own:
            for uuid in uuids:
                found.setdefault(uuid, f"process {holder.process_id!r}")
    placements = select(Placement).where(
        Placement.workspace_id == workspace_id,
        Placement.host == host,
        Placement.state == "waiting",
        Placement.priority > beneficiary.priority,
    )
    devices = list(host_devices(session=session, workspace_id=workspace_id, host=host))
    for row in session.scalars(placements.order_by(*queue_order(Placement))):
        for uuid in [row.gpu_uuid] if row.gpu_uuid is not None else devices:
            found.setdefault(uuid, f"placement {row.id}")
    return found


def _cost(plan: RoomPlan, beneficiary: Beneficiary, room: HostRoom) -> tuple[object, ...]:
    """Fewest paused, then the lowest priorities, then where it paused, then the most room."""
    priorities = tuple(sorted((victim.priority for victim in plan.victims), reverse=True))
    uuid = plan.device.uuid
    return len(plan.victims), priorities, uuid != beneficiary.home, -room.free_for(uuid, beneficiary.wait_id)


def _running_jobs(
    *, session: Session, workspace_id: int, host: str, now: float, stale_after: float
) -> list[tuple[Victim, bool]]:
    """Every job of the host that holds GPU memory, as one unit each (a job of several ranks: all of
    them), with whether it can be paused now; ``frees`` is left 0 (``_holders`` reads it GPU by GPU)."""
    rows = list(
        session.scalars(
            select(Process)
            .where(Process.workspace_id == workspace_id, Process.host == host)
            .order_by(Process.job_rank, Process.pk)
        )
    )
    grouped: dict[str, list[Process]] = {}
    for row in rows:
        grouped.setdefault(f"job {row.job_key}" if is_job_rank(row) else f"pk {row.pk}", []).append(row)
    units = []
    for members in grouped.values():
        if any(p.state == "PAUSED" or is_stale(p, now=now, stale_after=stale_after) for p in members):
            continue  # holds nothing, or nothing known
        unit = Victim(
            addressed=members[0], processes=tuple(members), priority=max(p.priority for p in members), frees=0
        )
        units.append((unit, _pausable(session, unit)))
    return units


def _pausable(session: Session, unit: Victim) -> bool:
    """Whether a pause of it would be taken now: running, free, able."""
    for proc in unit.processes:
        caps = stored_capabilities(proc)
        if proc.state != "RUNNING" or active_command(session=session, process_pk=proc.pk) is not None:
            return False
        if not caps.pause_resume or (is_job_rank(proc) and caps.job_operations is not True):
            return False
    return True


@dataclass(frozen=True)
class _Holders:
    """Who holds memory on one GPU, as making room sees them."""

    lower: list[Victim]  # of lower priority and pausable now, each with what it frees there
    busy: int  # held by jobs of lower priority that cannot be paused now
    above: int  # held by jobs of its priority or higher (or its own)


def _holders(units: list[tuple[Victim, bool]], uuid: str, beneficiary: Beneficiary) -> _Holders:
    lower: list[Victim] = []
    busy = above = 0
    for unit, pausable in units:
        frees = sum(held_by_gpu(p.gpu_uuid, p.memory_bytes, p.gpu_bytes).get(uuid, 0) for p in unit.processes)
        if frees == 0:
            continue
        if any(proc.pk in beneficiary.own for proc in unit.processes) or unit.priority >= beneficiary.priority:
            above += frees
        elif not pausable:
            busy += frees
        else:
            lower.append(Victim(unit.addressed, unit.processes, unit.priority, frees))
    return _Holders(lower, busy, above)


def _fewest(candidates: list[Victim], deficit: int) -> tuple[Victim, ...] | None:
    """The fewest candidates freeing ``deficit``, the lowest priorities among equally few (then the
    least memory paused); None when all of them together do not."""
    if deficit <= 0:
        return ()
    if sum(victim.frees for victim in candidates) < deficit:
        return None
    if len(candidates) > _EXHAUSTIVE:
        chosen: list[Victim] = []
        for victim in sorted(candidates, key=lambda v: (v.priority, -v.frees)):
            chosen.append(victim)
            if sum(v.frees for v in chosen) >= deficit:
                return tuple(chosen)
        return None
    largest = sorted((victim.frees for victim in candidates), reverse=True)
    count = next(k for k in range(1, len(largest) + 1) if sum(largest[:k]) >= deficit)
    enough = [combo for combo in itertools.combinations(candidates, count) if sum(v.frees for v in combo) >= deficit]
    return min(
        enough,
        key=lambda combo: (tuple(sorted((v.priority for v in combo), reverse=True)), sum(v.frees for v in combo)),
    )


def _why_not(name: str, free: int, required: int, holders: _Holders, held: int) -> str:
    pausable = sum(victim.frees for victim in holders.lower)
    parts = [f"{gib(free)} free of the {gib(required)} it needs"]
    if held > 0:
        parts.append(f"{gib(held)} more held for jobs not on it yet (`flexium queue` lists them)")
    if holders.lower:
        parts.append(f"pausing every job of lower priority there frees {gib(pausable)}")
    else:
        parts.append("no job of lower priority to pause there")
    if holders.busy:
        parts.append(f"jobs of lower priority that cannot be paused now hold {gib(holders.busy)}")
    if holders.above:
        parts.append(f"jobs of its priority or higher hold {gib(holders.above)}")
    return f"{name}: " + ", ".join(parts)


def make_room(
    *,
    session: Session,
    workspace_id: int,
    plan: RoomPlan,
    beneficiary: Beneficiary,
    now: float,
    stale_after: float,
    ttl: float,
) -> RoomMade:
    """Pauses the plan's victims (each queued to resume when free) and holds the room for the
    beneficiary. A pause refused now refuses it all (nothing changes)."""
    gpu = f"GPU {plan.device.index if plan.device.index is not None else plan.device.uuid}"
    pauses: list[wire.CommandInfo] = []
    for victim in plan.victims:
        why = (
            f"make room: {beneficiary.label} (priority {protocol.priority_name(beneficiary.priority)}) needs "
            f"{gib(plan.required)} on {gpu}; this job's priority is {protocol.priority_name(victim.priority)}"
        ) + given_why(beneficiary.why)
        commands = create_commands(
            session=session,
            workspace_id=workspace_id,
            kind="pause",
            process_id=victim.addressed.process_id,
            now=now,
            stale_after=stale_after,
            reason=why,
        )
        record_commands_created(session=session, workspace_id=workspace_id, actor=MAKE_ROOM, commands=commands, now=now)
        pauses += commands
        cancel_live_wait(
            session=session,
            workspace_id=workspace_id,
            actor=MAKE_ROOM,
            proc=victim.addressed,
            why="paused to make room",
            now=now,
        )
        queue_wait(
            session=session,
            workspace_id=workspace_id,
            actor=MAKE_ROOM,
            holder=victim.addressed,
            gpu_uuid=None,
            priority=victim.priority,
            reason=f"paused to make room for {beneficiary.label} on {gpu}: resumes when free",
            now=now,
        )
    held = hold_room(
        session=session,
        workspace_id=workspace_id,
        host=plan.device.host,
        gpu_uuid=plan.device.uuid,
        nbytes=plan.required,
        wait_id=beneficiary.wait_id,
        holder=beneficiary.label,
        now=now,
        ttl=ttl,
    )
    return RoomMade(pauses, held)


def _room_held(*, session: Session, proc: Process, gpu_uuid: str | None, now: float) -> Wait | None:
    """The job's wait when room is held for it already (an earlier make-room, its pauses perhaps still
    under way) on ``gpu_uuid`` (None: any GPU). Asked again, that room is its own: counted as someone
    else's, it would pause more jobs for room the job has."""
    live = live_wait_of(session=session, proc=proc, for_update=True)
    if live is None or live.state != "waiting":
        return None
    held = session.scalar(
        select(Reservation.gpu_uuid).where(Reservation.wait_id == live.id, Reservation.expires_at > now).limit(1)
    )
    return live if held is not None and gpu_uuid in (None, held) else None


def resume_making_room(
    *,
    session: Session,
    workspace_id: int,
    actor: AuthInfo,
    request: wire.WaitRequest,
    now: float,
    stale_after: float,
    ttl: float,
) -> tuple[Wait, list[wire.CommandInfo]]:
    """``flexium resume JOB --make-room``: the paused job's wait, on the GPU room is made on, and the
    pauses that make it; the queue resumes it there once their room shows."""
    proc = find_process(session=session, workspace_id=workspace_id, process_id=request.process_id, for_update=True)
    if is_job_rank(proc) or len(held_by_gpu(proc.gpu_uuid, proc.footprint_bytes, proc.gpu_bytes)) > 1:
        raise InvalidRequest(
            f"room is made on one GPU, for a job on one GPU; process {proc.process_id!r} is part of a job on several: "
            f"queue it instead (flexium resume {proc.process_id} --when-free)"
        )
    holder, priority = paused_job(session=session, proc=proc, now=now, stale_after=stale_after)
    named = wanted_gpu(session=session, proc=proc, request=request, now=now, stale_after=stale_after)
    held = _room_held(session=session, proc=proc, gpu_uuid=named.uuid if named is not None else None, now=now)
    if held is not None:
        return held, []

    def candidates(room: HostRoom) -> dict[str, str | None]:
        devices = {uuid: gpu.device for uuid, gpu in room.gpus.items()}
        uuids = [named.uuid] if named is not None else may_resume_on(proc, devices)
        return {
            uuid: target_refusal(
                proc=proc, dev=devices[uuid], kind="resume", now=now, stale_after=stale_after, room=False
            )
            for uuid in uuids
            if uuid in devices
        }

    label = f"process {proc.process_id!r}"
    need = max(proc.footprint_bytes, proc.memory_bytes)
    beneficiary = Beneficiary(
        label=label, priority=priority, need=need, own=frozenset({proc.pk}), home=proc.gpu_uuid, why=request.reason
    )
    plan = plan_room(
        session=session,
        workspace_id=workspace_id,
        host=proc.host,
        candidates=candidates,
        beneficiary=beneficiary,
        now=now,
        stale_after=stale_after,
    )
    who = actor.token_name or f"token {actor.token_id}"
    cancel_live_wait(
        session=session, workspace_id=workspace_id, actor=actor, proc=proc, why=f"room made by {who}", now=now
    )
    wait = queue_wait(
        session=session,
        workspace_id=workspace_id,
        actor=actor,
        holder=holder,
        # The GPU as asked (None: any): the room held on the one chosen brings it there, and should that room
        # not come (a pause failed) it waits for any GPU, as a wait queued with --when-free would.
        gpu_uuid=named.uuid if named is not None else None,
        priority=priority,
        reason=f"room made by {who} on GPU {plan.device.index}, pausing {plan.paused}",
        now=now,
        why=request.reason,
    )
    made = make_room(
        session=session,
        workspace_id=workspace_id,
        plan=plan,
        beneficiary=dataclasses.replace(beneficiary, wait_id=wait.id),
        now=now,
        stale_after=stale_after,
        ttl=ttl,
    )
    return wait, made.pauses
