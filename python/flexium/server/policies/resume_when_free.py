"""The resume-when-free queue: paused jobs waiting for room on their host (``storage.waits``), each
resumed by an ordinary resume command once a GPU report shows the room it needs, a higher
priority first and first come first served within one. A later wait goes ahead of one that fits
nowhere yet only as ``waited_for`` allows (one of the same priority that fits now, until the
earlier has waited the server's backfill patience), or on a GPU where room is held for that later one
(``make_room``). A GPU's room counts only in a report newer than the job's last refusal of a
resume the queue sent, so a refused resume is not sent again on the report it was refused on.

``run_queue`` takes its hosts' lock first (``reservations.lock_hosts``, as every policy that counts a
host's room does), so two passes over one host, or a pass and a drain or a make-room, run one after
the other; it reads the waits it acts on locked and skips those another server holds (``FOR UPDATE
SKIP LOCKED`` on PostgreSQL; SQLite has one writer), and a job has one active command at most (a
unique index): two servers on one database never resume a job twice."""

from __future__ import annotations

import itertools
from dataclasses import dataclass

from sqlalchemy import select
from sqlalchemy.orm import Session

from flexium import wire
from flexium.server.errors import ApiError, CapabilityMissing, InvalidState
from flexium.server.models import Placement, Process, Wait
from flexium.server.policies.make_room import resume_making_room
from flexium.server.policies.room import HostRoom
from flexium.server.policies.waited_for import WaitedFor
from flexium.server.storage.audit import PolicyActor, given_why, record_commands_created
from flexium.server.storage.commands import create_commands
from flexium.server.storage.devices import host_devices
from flexium.server.storage.processes import active_command
from flexium.server.storage.reservations import lock_hosts, lock_process_host
from flexium.server.storage.targets import target_refusal
from flexium.server.storage.views import stored_capabilities
from flexium.server.storage.waits import (
    Need,
    create_wait,
    end_wait,
    needs_of,
    processes_of,
    queue_order,
    room_watches,
    standing,
    wait_view,
)
from flexium.server.storage.workspaces import AuthInfo
from flexium.units import gib

ACTOR = PolicyActor("resume when free")


@dataclass(frozen=True)
class Dispatched:
    """A wait the queue sent a resume for."""

    workspace_id: int
    wait: wire.WaitInfo
    commands: tuple[wire.CommandInfo, ...]


@dataclass(frozen=True)
class QueueOutcome:
    dispatched: tuple[Dispatched, ...] = ()
    cancelled: tuple[tuple[int, wire.WaitInfo], ...] = ()  # (workspace id, wait): the job cannot wait any more


@dataclass(frozen=True)
class Queued:
    """A person's request answered (the wait, and what it set going at once, and what its job
    watches while it waits) and the queue's pass over its host that followed in the same
    transaction; ``watches``: what each process of the job watches, for the server's view."""

    answer: wire.WaitCreated
    outcome: QueueOutcome
    watches: dict[tuple[int, str], wire.RoomWatch]


def queue_resume(
    *,
    session: Session,
    workspace_id: int,
    actor: AuthInfo,
    request: wire.WaitRequest,
    now: float,
    stale_after: float,
    reservation_ttl: float,
    backfill_patience: float,
) -> Queued:
    """``flexium resume JOB --when-free`` (or ``--make-room``): the job's wait, then the queue's
    pass over its host, which resumes it at once when it fits now."""
    lock_process_host(session=session, workspace_id=workspace_id, process_id=request.process_id)
    queued_before = None
    if request.make_room:
        row, pauses = resume_making_room(
            session=session,
            workspace_id=workspace_id,
            actor=actor,
            request=request,
            now=now,
            stale_after=stale_after,
            ttl=reservation_ttl,
        )
    else:
        row, queued_before = create_wait(
            session=session, workspace_id=workspace_id, actor=actor, request=request, now=now, stale_after=stale_after
        )
        pauses = []
    outcome = run_queue(
        session=session,
        now=now,
        stale_after=stale_after,
        backfill_patience=backfill_patience,
        workspace_id=workspace_id,
        host=row.host,
    )
    resumed = [command for done in outcome.dispatched if done.wait.id == row.id for command in done.commands]
    holder = session.get(Process, row.process_pk)
    wait = wait_view(session=session, row=row, holder=holder, now=now)
    watches = {}
    if row.state == "waiting" and holder is not None:
        host_gpus = host_devices(session=session, workspace_id=workspace_id, host=row.host)
        watches = room_watches(row, needs_of(session=session, wait=row, holder=holder), host_gpus)
    answer = wire.WaitCreated(
        wait=wait,
        commands=[*pauses, *resumed],
        watch=watches.get((workspace_id, request.process_id)),
        queued_before=queued_before,
    )
    return Queued(answer=answer, outcome=outcome, watches=watches)


def run_queue(
    *,
    session: Session,
    now: float,
    stale_after: float,
    backfill_patience: float,
    workspace_id: int | None = None,
    host: str | None = None,
) -> QueueOutcome:
    """Sends a resume for every waiting job that fits now, in queue order, host by host (all hosts
    of all workspaces by default: the sweep's pass)."""
    where = [Wait.state == "waiting"]
    if workspace_id is not None:
        where.append(Wait.workspace_id == workspace_id)
    if host is not None:
        where.append(Wait.host == host)
    if workspace_id is not None and host is not None:
        hosts = [(workspace_id, host)]
    else:
        waiting = select(Wait.workspace_id, Wait.host).where(*where).distinct()
        hosts = [(ws, on_host) for ws, on_host in session.execute(waiting)]
    lock_hosts(session=session, hosts=hosts)
    query = select(Wait, Process).join(Process, Process.pk == Wait.process_pk).where(*where)
    rows = session.execute(query.order_by(*queue_order()).with_for_update(of=Wait, skip_locked=True)).all()
    locked = set(hosts)  # a wait made on another host since the hosts were read waits for the next pass
    rows = [row for row in rows if (row[0].workspace_id, row[0].host) in locked]
    dispatched: list[Dispatched] = []
    cancelled: list[tuple[int, wire.WaitInfo]] = []
    for (ws, on_host), group in itertools.groupby(rows, key=lambda row: (row[0].workspace_id, row[0].host)):
        room = HostRoom.read(session=session, workspace_id=ws, host=on_host, now=now)
        waited_for = placements_waiting(session=session, workspace_id=ws, host=on_host, patience=backfill_patience)
        for wait, holder in group:
            outcome = _consider(
                session=session,
                wait=wait,
                holder=holder,
                room=room,
                waited_for=waited_for,
                now=now,
                stale_after=stale_after,
            )
            if isinstance(outcome, Dispatched):
                dispatched.append(outcome)
            elif outcome is not None:
                cancelled.append((ws, outcome))
    return QueueOutcome(dispatched=tuple(dispatched), cancelled=tuple(cancelled))


def placements_waiting(*, session: Session, workspace_id: int, host: str, patience: float) -> WaitedFor:
    """The GPUs the host's placements waiting for room wait for (flexium run's jobs not started yet):
    a paused job after one in the queue's order takes such a GPU only as ``waited_for`` allows, as a
    placement does with the paused jobs' waits (placement.py ``_waits_ahead``)."""
    waited_for = WaitedFor(patience=patience)
    devices = host_devices(session=session, workspace_id=workspace_id, host=host)
    query = select(Placement).where(
        Placement.workspace_id == workspace_id, Placement.host == host, Placement.state == "waiting"
    )
    for row in session.scalars(query):
        uuids = [row.gpu_uuid] if row.gpu_uuid is not None else list(devices)
        waited_for.add(uuids, priority=row.priority, queued_at=row.created_at)
    return waited_for


def _consider(
    *,
    session: Session,
    wait: Wait,
    holder: Process,
    room: HostRoom,
    waited_for: WaitedFor,
    now: float,
    stale_after: float,
) -> Dispatched | wire.WaitInfo | None:
    """The wait resumed (Dispatched), cancelled (its view), or left waiting (None)."""
    needs = needs_of(session=session, wait=wait, holder=holder)
    for proc in processes_of(holder, needs):
        if proc.state != "PAUSED" and active_command(session=session, process_pk=proc.pk) is None:
            why = f"process {proc.process_id!r} is {proc.state}: it does not wait to resume any more"
            return end_wait(session=session, row=wait, state="cancelled", note=why, actor=None, now=now)
    if not standing(session=session, holder=holder, needs=needs, now=now, stale_after=stale_after):
        return None
    gone = next((need.gpu for need in needs if need.gpu is not None and need.gpu not in room.gpus), None)
    if gone is not None:  # its host has not reported it for remove_after: forgotten, not coming back
        why = (
            f"the GPU it waits for ({gone}) is no longer reported by host {wait.host!r}: queue it again for a GPU "
            f"the host has (flexium resume {holder.process_id} --when-free)"
        )
        return end_wait(session=session, row=wait, state="cancelled", note=why, actor=None, now=now)
    placement = _place(wait=wait, needs=needs, room=room, waited_for=waited_for, now=now, stale_after=stale_after)
    if placement is None:
        return None
    single = wait.job_key is None and len(needs) == 1
    try:
        with session.begin_nested():
            commands = create_commands(
                session=session,
                workspace_id=wait.workspace_id,
                kind="resume",
                process_id=holder.process_id,
                target=placement[0][1] if single else None,
                now=now,
                stale_after=stale_after,
                reason=_reason(wait, placement, room, now),
            )
    except (InvalidState, CapabilityMissing) as exc:
        return end_wait(session=session, row=wait, state="cancelled", note=exc.message, actor=None, now=now)
    except ApiError as exc:  # busy, stale, a target refused for now: it waits on, for those GPUs
        wait.note = exc.message
        waited_for.add([uuid for _need, uuid in placement], priority=wait.priority, queued_at=wait.created_at)
        return None
    record_commands_created(session=session, workspace_id=wait.workspace_id, actor=ACTOR, commands=commands, now=now)
    wait.state = "dispatched"
    wait.command_id = commands[0].id
    wait.dispatches += 1
    wait.note = None
    for need, uuid in placement:
        room.take(uuid, need.nbytes, wait.id)
    shown = wait_view(session=session, row=wait, holder=holder, now=now)
    return Dispatched(workspace_id=wait.workspace_id, wait=shown, commands=tuple(commands))


def _place(
    *, wait: Wait, needs: list[Need], room: HostRoom, waited_for: WaitedFor, now: float, stale_after: float
) -> list[tuple[Need, str]] | None:
    """A GPU for each need, all fitting together; None: the GPUs it could use are waited for by it
    (``waited_for``: those after it may take them only as its rule allows)."""
    placement: list[tuple[Need, str]] = []
    claimed: dict[str, int] = {}
    wanted: list[str] = []
    for need in needs:
        names = _names(need, room)
        # Waited for even where it may not go now (refused since the last report, a GPU gone silent
        # for a while): a job of lower priority taking that room would delay it.
        wanted += names
        candidates = _candidates(wait=wait, need=need, names=names, room=room, now=now, stale_after=stale_after)
        if need.gpu is not None and need.gpu in names:
            wait.note = _pinned_note(wait=wait, need=need, room=room, now=now, stale_after=stale_after)
        for uuid in candidates:
            closed = waited_for.closed_to(uuid, priority=wait.priority, queued_at=wait.created_at, now=now)
            if closed and not room.holds_for(uuid, wait.id):
                continue
            required = room.required(uuid, need.nbytes, home=need.process.gpu_uuid) + claimed.get(uuid, 0)
            if room.free_for(uuid, wait.id) >= required:
                placement.append((need, uuid))
                claimed[uuid] = claimed.get(uuid, 0) + need.nbytes
                break
    if len(placement) < len(needs) or not needs:
        waited_for.add(wanted, priority=wait.priority, queued_at=wait.created_at)
        return None
    return placement


def _names(need: Need, room: HostRoom) -> list[str]:
    """The host's GPUs ``need`` may go to by what it is: the one it names; else the one it paused on
    first, then (a job that migrates) the others by free memory."""
    proc = need.process
    if need.gpu is not None:
        names = [need.gpu]
    else:
        names = [proc.gpu_uuid or ""]
        if stored_capabilities(proc).migration:
            others = [uuid for uuid in room.gpus if uuid != proc.gpu_uuid]
            names += sorted(others, key=lambda uuid: -room.gpus[uuid].free)
    return [uuid for uuid in names if uuid in room.gpus]


def _candidates(
    *, wait: Wait, need: Need, names: list[str], room: HostRoom, now: float, stale_after: float
) -> list[str]:
    """Those of ``names`` it may go to now: the target rules but room, on a report newer than the
    job's last refusal."""
    fitting = []
    for uuid in names:
        gpu = room.gpus[uuid]
        if wait.refused_at is not None and gpu.device.updated_at <= wait.refused_at:
            continue
        refusal = target_refusal(
            proc=need.process, dev=gpu.device, kind="resume", now=now, stale_after=stale_after, room=False
        )
        if refusal is None:
            fitting.append(uuid)
    return fitting


def _pinned_note(*, wait: Wait, need: Need, room: HostRoom, now: float, stale_after: float) -> str | None:
    """The wait's note where it names its GPU: why it cannot go there now but for room (a GPU gone
    silent, drained), said until it can again; any other note as it is."""
    assert need.gpu is not None
    prefix = f"GPU {_label(room, need.gpu)}: "
    refusal = target_refusal(
        proc=need.process, dev=room.gpus[need.gpu].device, kind="resume", now=now, stale_after=stale_after, room=False
    )
    if refusal is not None:
        return prefix + refusal
    return None if wait.note is not None and wait.note.startswith(prefix) else wait.note


def _reason(wait: Wait, placement: list[tuple[Need, str]], room: HostRoom, now: float) -> str:
    where = "; ".join(
        f"GPU {_label(room, uuid)} had {gib(room.free_for(uuid, wait.id))} free for {gib(need.nbytes)}"
        for need, uuid in placement
    )
    # Room held for it on the GPU it goes to was made for it (make room's pauses, the only holds of a wait).
    made = any(room.holds_for(uuid, wait.id) for _need, uuid in placement)
    policy = "make room: the room made for it" if made else "resume when free"
    return f"{policy}: {where}; waited {now - wait.created_at:.0f} s, queued by {wait.requested_by}" + given_why(
        wait.why
    )


def _label(room: HostRoom, uuid: str) -> str:
    index = room.gpus[uuid].device.index
    return uuid if index is None else str(index)
