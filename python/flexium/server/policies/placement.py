"""Placing a job that is not started yet (``flexium run``): on the GPU of its host with the most room
(or the one it names) once that GPU has the room it needs, in the queue's order (a higher priority
first, first come first served within one) and after the paused jobs waiting ahead of it
(``resume_when_free``): a placement takes a GPU that a wait or a placement before it waits for only
as ``waited_for`` allows. Placed, the room is held for it (a reservation, which the queue's waits
cannot take) until its job registers and takes it (``storage.placements.take_placement``) or the
reservation expires (each time its flexium run asks, the hold runs a full reservation time again). With
``make_room`` (an admin's), room is made at once as for a paused job (``make_room``): the fewest jobs
of lower priority on one GPU paused, the room held, the placement waiting for that GPU. Nothing is
placed on a drained GPU.

The host's lock is taken first (``reservations.lock_hosts``) and rows are read locked (``SKIP
LOCKED`` on PostgreSQL), so two servers never place one job twice, nor give one room twice."""

from __future__ import annotations

from dataclasses import dataclass

from sqlalchemy.orm import Session

from flexium import protocol, wire
from flexium.server.errors import Forbidden
from flexium.server.models import Placement, Reservation
from flexium.server.policies.make_room import Beneficiary, make_room, plan_room
from flexium.server.policies.resume_when_free import QueueOutcome, run_queue
from flexium.server.policies.room import HostRoom
from flexium.server.policies.waited_for import WaitedFor
from flexium.server.storage.devices import upsert_devices
from flexium.server.storage.drains import drain_refusal
from flexium.server.storage.placements import (
    create_placement,
    end_placement,
    find_placement,
    live_placements,
    placement_hosts,
    placement_view,
    release_placement_room,
)
from flexium.server.storage.reservations import hold_room, lock_hosts
from flexium.server.storage.staleness import silent
from flexium.server.storage.waits import since_room_not_made, standing_waits
from flexium.server.storage.workspaces import AuthInfo
from flexium.units import gib


@dataclass(frozen=True)
class PlacementOutcome:
    """A request answered: the placement as it is now, the pauses that make room for it, every
    placement of its host the request changed (placed, ended, or told why it waits anew), it
    included, as they are now, and what the queue's pass over the host did first (the report the
    request brought may give a paused job waiting before it its room)."""

    placement: wire.PlacementInfo
    pauses: tuple[wire.CommandInfo, ...] = ()
    changed: tuple[wire.PlacementInfo, ...] = ()
    queued: QueueOutcome = QueueOutcome(dispatched=(), cancelled=())  # the queue's pass that ran first


def place_job(
    *,
    session: Session,
    workspace_id: int,
    actor: AuthInfo,
    request: wire.PlacementRequest,
    now: float,
    stale_after: float,
    reservation_ttl: float,
    answering_since: float,
    backfill_patience: float,
) -> PlacementOutcome:
    """``flexium run``'s request: its host's GPUs stored as it read them, the placement written (room
    made for it when asked), and the placement pass over its host, which places it at once when it
    fits now."""
    if request.make_room and actor.role != protocol.ROLE_ADMIN:
        raise Forbidden("making room pauses other jobs: it takes an admin token (flexium run --make-room)")
    upsert_devices(session=session, workspace_id=workspace_id, host=request.host, devices=request.devices, now=now)
    row = create_placement(session=session, workspace_id=workspace_id, actor=actor, request=request, now=now)
    pauses: list[wire.CommandInfo] = []
    if request.make_room:
        pauses = _make_room(session=session, row=row, now=now, stale_after=stale_after, ttl=reservation_ttl)
    queued, changed = _passes(
        session=session,
        workspace_id=workspace_id,
        host=row.host,
        now=now,
        stale_after=stale_after,
        reservation_ttl=reservation_ttl,
        answering_since=answering_since,
        backfill_patience=backfill_patience,
    )
    shown = placement_view(session=session, row=row, now=now)
    return PlacementOutcome(shown, tuple(pauses), _with(changed, shown), queued)


def report_placement(
    *,
    session: Session,
    workspace_id: int,
    actor: AuthInfo,
    placement_id: int,
    report: wire.PlacementReport,
    now: float,
    stale_after: float,
    reservation_ttl: float,
    answering_since: float,
    backfill_patience: float,
) -> PlacementOutcome:
    """``flexium run`` asks again, with its host's GPUs as it reads them now: stored, then the
    placement pass over the host. A placed one's room is held a full ``reservation_ttl`` from each
    ask: its job is starting (a slow import, a large dataset to open), and the room must still be
    there when it registers; after a silence (the server, or its database, could not hear it:
    ``answering_since``) the hold's time ran on while its job could not start."""
    row = find_placement(session=session, workspace_id=workspace_id, placement_id=placement_id, actor=actor)
    upsert_devices(session=session, workspace_id=workspace_id, host=row.host, devices=report.devices, now=now)
    before = (row.state, row.note)
    if row.state in protocol.LIVE_PLACEMENT_STATES:
        if row.state == "placed":
            _hold(session=session, row=row, now=now, ttl=reservation_ttl)
        row.asked_at = now
    queued, changed = _passes(
        session=session,
        workspace_id=workspace_id,
        host=row.host,
        now=now,
        stale_after=stale_after,
        reservation_ttl=reservation_ttl,
        answering_since=answering_since,
        backfill_patience=backfill_patience,
    )
    shown = placement_view(session=session, row=row, now=now)
    return PlacementOutcome(
        shown, (), _with(changed, shown) if (row.state, row.note) != before else tuple(changed), queued
    )


def _passes(
    *,
    session: Session,
    workspace_id: int,
    host: str,
    now: float,
    stale_after: float,
    reservation_ttl: float,
    answering_since: float,
    backfill_patience: float,
) -> tuple[QueueOutcome, list[wire.PlacementInfo]]:
    """A request's passes over its host on the GPUs it brought: the queue's first, as after any report
    (a paused job waiting before a placement takes the room it fits), then the placements'."""
    queued = run_queue(
        session=session,
        now=now,
        stale_after=stale_after,
        backfill_patience=backfill_patience,
        workspace_id=workspace_id,
        host=host,
    )
    changed = run_placements(
        session=session,
        workspace_id=workspace_id,
        host=host,
        now=now,
        stale_after=stale_after,
        reservation_ttl=reservation_ttl,
        answering_since=answering_since,
        backfill_patience=backfill_patience,
    )
    return queued, changed


def _with(changed: list[wire.PlacementInfo], shown: wire.PlacementInfo) -> tuple[wire.PlacementInfo, ...]:
    return (shown, *(placement for placement in changed if placement.id != shown.id))


def _make_room(
    *, session: Session, row: Placement, now: float, stale_after: float, ttl: float
) -> list[wire.CommandInfo]:

    def candidates(room: HostRoom) -> dict[str, str | None]:
        uuids = [row.gpu_uuid] if row.gpu_uuid is not None else list(room.gpus)
        return {uuid: _gpu_refusal(session, room, uuid, now=now, stale_after=stale_after) for uuid in uuids}

    beneficiary = Beneficiary(label=_label(row), priority=row.priority, need=row.need_bytes, why=row.why)
    plan = plan_room(
        session=session,
        workspace_id=row.workspace_id,
        host=row.host,
        candidates=candidates,
        beneficiary=beneficiary,
        now=now,
        stale_after=stale_after,
    )
    made = make_room(
        session=session,
        workspace_id=row.workspace_id,
        plan=plan,
        beneficiary=beneficiary,
        now=now,
        stale_after=stale_after,
        ttl=ttl,
    )
    # Its GPU stays as asked (None: any): the room held brings it to the one chosen, and should that room not
    # come (a pause failed) it waits for any, as it did before.
    row.reservation_id = made.reservation.id
    row.note = f"room made on GPU {plan.device.index}, pausing {plan.paused}"
    return made.pauses


def _label(row: Placement) -> str:
    return f"placement {row.id} ({row.command or 'a job not started yet'})"[: protocol.MAX_SHORT_TEXT]


def _gpu_refusal(session: Session, room: HostRoom, uuid: str, *, now: float, stale_after: float) -> str | None:
    """Why a job cannot be placed on the GPU but for room, in a few words; None when it can."""
    gpu = room.gpus.get(uuid)
    if gpu is None:
        return "not reported by its host"
    drained = drain_refusal(session=session, dev=gpu.device)
    if drained is not None:
        return drained
    if gpu.device.health and gpu.device.health not in protocol.TARGETABLE_HEALTH:
        return f"health: {gpu.device.health}"
    if silent(gpu.device.updated_at, now=now, stale_after=stale_after):
        return "no fresh report from its host"
    return None


def run_placements(
    *,
    session: Session,
    workspace_id: int,
    host: str,
    now: float,
    stale_after: float,
    reservation_ttl: float,
    answering_since: float,
    backfill_patience: float,
) -> list[wire.PlacementInfo]:
    """Places every live placement of the host that fits now, in the queue's order; those whose
    flexium run stopped asking end. ``answering_since``: since when the server has answered without
    a gap (it started, or its database came back): flexium run's silence counts from then only, as
    it could not be heard before. The placements it changed, as they are now."""
    lock_hosts(session=session, hosts=[(workspace_id, host)])
    rows = live_placements(session=session, workspace_id=workspace_id, host=host)
    if not rows:
        return []
    room = HostRoom.read(session=session, workspace_id=workspace_id, host=host, now=now)
    waited_for = _waits_ahead(
        session=session,
        workspace_id=workspace_id,
        host=host,
        patience=backfill_patience,
        now=now,
        stale_after=stale_after,
    )
    changed: list[Placement] = []
    for row in rows:
        silent_since = max(row.asked_at, answering_since)
        if silent(silent_since, now=now, stale_after=stale_after):
            state = "cancelled" if row.state == "waiting" else "ended"
            why = f"its flexium run stopped asking {now - silent_since:.0f} s ago"
            end_placement(session=session, row=row, state=state, note=why, now=now)
            changed.append(row)
            continue
        if row.state == "placed":  # its room is held: the room counts it already
            if not _drained_before_it_started(session=session, row=row, room=room):
                continue
            changed.append(row)
        ahead = waited_for.closed(priority=row.priority, queued_at=row.created_at, now=now)
        gpu = _fitting_gpu(session=session, row=row, room=room, ahead=ahead, now=now, stale_after=stale_after)
        if gpu is None:
            uuids = [row.gpu_uuid] if row.gpu_uuid is not None else list(room.gpus)
            waited_for.add(uuids, priority=row.priority, queued_at=row.created_at)
            continue
        _place(session=session, row=row, uuid=gpu, room=room, now=now, ttl=reservation_ttl)
        if row not in changed:
            changed.append(row)
    return [placement_view(session=session, row=row, now=now) for row in changed]


def run_placement_pass(
    *,
    session: Session,
    now: float,
    stale_after: float,
    reservation_ttl: float,
    answering_since: float,
    backfill_patience: float,
    workspace_id: int | None = None,
    host: str | None = None,
) -> list[tuple[int, wire.PlacementInfo]]:
    """``run_placements`` over every host with a live placement (or the one given): the sweep's
    pass, which places a job whose room a job's report showed while its flexium run had not asked
    again, and ends those whose flexium run stopped asking; (workspace id, placement) of each it
    changed."""
    changed = []
    one = [(workspace_id, host)] if workspace_id is not None and host is not None else None
    for ws, on_host in one or placement_hosts(session=session):
        if (workspace_id is None or ws == workspace_id) and (host is None or on_host == host):
            placements = run_placements(
                session=session,
                workspace_id=ws,
                host=on_host,
                now=now,
                stale_after=stale_after,
                reservation_ttl=reservation_ttl,
                answering_since=answering_since,
                backfill_patience=backfill_patience,
            )
            changed += [(ws, placement) for placement in placements]
    return changed


def _waits_ahead(
    *, session: Session, workspace_id: int, host: str, patience: float, now: float, stale_after: float
) -> WaitedFor:
    """The GPUs the host's waiting paused jobs wait for: a placement after one in the queue's order
    takes such a GPU only as ``waited_for`` allows. A wait the queue passes over now (its job silent,
    or a command of its under way) holds up no placement either."""
    waited_for = WaitedFor(patience=patience)
    for wait, _holder, uuids in standing_waits(
        session=session, workspace_id=workspace_id, host=host, now=now, stale_after=stale_after
    ):
        waited_for.add(uuids, priority=wait.priority, queued_at=wait.created_at)
    return waited_for


def _drained_before_it_started(*, session: Session, row: Placement, room: HostRoom) -> bool:
    """Whether the GPU it was placed on has been drained since, before its flexium run started the job
    (which it does at its next ask): then it waits again, its room there given back, and is placed
    anew in this pass where it fits, as nothing is placed on a drained GPU."""
    gpu = room.gpus.get(row.placed_uuid or "")
    drained = None if gpu is None else drain_refusal(session=session, dev=gpu.device)
    if drained is None:
        return False
    release_placement_room(session=session, row=row)
    row.state, row.placed_uuid, row.placed_at = "waiting", None, None
    row.note = f"its GPU was drained before its job started ({drained}): waits again"
    session.flush()  # its place in line is read from the table
    return True


def _own_held(session: Session, row: Placement, now: float) -> Reservation | None:
    if row.reservation_id is None:
        return None
    reservation = session.get(Reservation, row.reservation_id)
    return reservation if reservation is not None and reservation.expires_at > now else None


def _free(room: HostRoom, uuid: str, own: Reservation | None) -> int:
    """What the placement may count on there: free, less what is held for others."""
    gpu = room.gpus[uuid]
    held = sum(gpu.held.values()) - (own.bytes if own is not None and own.gpu_uuid == uuid else 0)
    return max(0, gpu.free - held)


def _fitting_gpu(
    *, session: Session, row: Placement, room: HostRoom, ahead: set[str], now: float, stale_after: float
) -> str | None:
    """The GPU to place it on now (the one it names, else the one with the most room), or None
    with why in its note."""
    own = _own_held(session, row, now)
    names = [row.gpu_uuid] if row.gpu_uuid is not None else sorted(room.gpus, key=lambda uuid: _index(room, uuid))
    required = row.need_bytes + protocol.ROOM_MARGIN_BYTES if row.need_bytes else 0
    why: list[str] = []
    fitting: list[tuple[int, str]] = []
    for uuid in names:
        gpu = room.gpus.get(uuid)
        label = f"GPU {uuid if gpu is None or gpu.device.index is None else gpu.device.index}"
        refusal = _gpu_refusal(session, room, uuid, now=now, stale_after=stale_after)
        if refusal is not None:
            why.append(f"{label}: {refusal}")
            continue
        if uuid in ahead and not (own is not None and own.gpu_uuid == uuid):
            why.append(f"{label}: a job before it in the queue waits for it")
            continue
        free = _free(room, uuid, own)
        if free < required:
            why.append(f"{label}: {gib(free)} free")
            continue
        fitting.append((free, uuid))
    if fitting:
        return max(fitting)[1]
    need = f"{gib(required)} (its {gib(row.need_bytes)} and headroom)" if row.need_bytes else "a GPU"
    row.note = since_room_not_made(
        row.note, f"waits for {need}: " + ("; ".join(why) or f"host {row.host!r} reported no GPU")
    )
    return None


def _index(room: HostRoom, uuid: str) -> int:
    index = room.gpus[uuid].device.index
    return -1 if index is None else index


def _place(*, session: Session, row: Placement, uuid: str, room: HostRoom, now: float, ttl: float) -> None:
    """Placed on ``uuid``: the room held for it there until its job registers."""
    own = _own_held(session, row, now)
    free = _free(room, uuid, own)
    row.state = "placed"
    row.placed_uuid = uuid
    row.placed_at = now
    if own is not None and own.gpu_uuid == uuid:  # the room made for it: held from now, as it starts
        _hold(session=session, row=row, now=now, ttl=ttl)
    else:
        release_placement_room(session=session, row=row)
        held = _hold(session=session, row=row, now=now, ttl=ttl)
        if held is not None:
            room.gpus[uuid].held[None] = room.gpus[uuid].held.get(None, 0) + held.bytes
    index = room.gpus[uuid].device.index
    row.note = f"placed on GPU {uuid if index is None else index}: {gib(free)} free" + (
        f" for {gib(row.need_bytes)}" if row.need_bytes else ", the most room of its host"
    )


def _hold(*, session: Session, row: Placement, now: float, ttl: float) -> Reservation | None:
    """The room of a placed job held on its GPU for ``ttl`` from now (its hold renewed where it has
    one); None for a job that said no memory."""
    if not row.need_bytes or row.placed_uuid is None:
        return None
    held = None if row.reservation_id is None else session.get(Reservation, row.reservation_id)
    if held is not None and held.gpu_uuid == row.placed_uuid:
        held.expires_at = max(held.expires_at, now + ttl)
        return held
    held = hold_room(
        session=session,
        workspace_id=row.workspace_id,
        host=row.host,
        gpu_uuid=row.placed_uuid,
        nbytes=row.need_bytes + protocol.ROOM_MARGIN_BYTES,
        wait_id=None,
        holder=_label(row),
        now=now,
        ttl=ttl,
    )
    row.reservation_id = held.id
    return held
