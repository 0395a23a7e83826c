"""flexium run's placements: a job not started yet that waits for room on a GPU of its host, a row
beside the queue's waits (``storage.waits``) and in the same order (``waits.queue_order``). Asked
for by ``flexium run`` (``create_placement``), which asks again while it waits, each time with its
host's GPUs as it reads them; placed by the placement policy (``server/policies/placement.py``)
with its room held (a reservation), which the job takes when it registers with the placement's id
(``take_placement``); ended by its flexium run, or when that stops asking. A person's changes are
audited in the transaction that makes them."""

from __future__ import annotations

from sqlalchemy import and_, exists, or_, select
from sqlalchemy.orm import Session

from flexium import protocol, wire
from flexium.server.errors import NotFound, TargetRefused
from flexium.server.models import Placement, Reservation, Token
from flexium.server.storage.audit import given_why, record_audit
from flexium.server.storage.devices import device_indexes, host_devices
from flexium.server.storage.listing import listed
from flexium.server.storage.reservations import reservation_view, started_still_holding
from flexium.server.storage.waits import queue_order, waits_ahead
from flexium.server.storage.workspaces import AuthInfo
from flexium.units import gib


def create_placement(
    *, session: Session, workspace_id: int, actor: AuthInfo, request: wire.PlacementRequest, now: float
) -> Placement:
    """The row as asked; the GPU it names must be one its host reported (the request's devices), and
    one of them (the one it names) must be able to hold what it needs once empty: else it would wait
    for ever, holding up every job of lower priority queued on the host."""
    devices = host_devices(session=session, workspace_id=workspace_id, host=request.host)
    if request.gpu_uuid is not None and request.gpu_uuid not in devices:
        raise TargetRefused(f"GPU {request.gpu_uuid} is not a GPU of host {request.host!r}")
    candidates = [devices[request.gpu_uuid]] if request.gpu_uuid is not None else list(devices.values())
    required = request.memory_bytes + protocol.ROOM_MARGIN_BYTES
    largest = max((d.memory_total for d in candidates), default=0)
    if request.memory_bytes and largest and required > largest:
        where = f"GPU {request.gpu_uuid} holds" if request.gpu_uuid is not None else "the largest GPU of the host holds"
        raise TargetRefused(
            f"no GPU of host {request.host!r} can ever hold {gib(required)} (its {gib(request.memory_bytes)} and "
            f"headroom): {where} {gib(largest)} in all; ask for less with --memory"
        )
    row = Placement(
        workspace_id=workspace_id,
        host=request.host,
        gpu_uuid=request.gpu_uuid,
        need_bytes=request.memory_bytes,
        priority=request.priority,
        state="waiting",
        created_at=now,
        asked_at=now,
        requested_by=(actor.token_name or f"token {actor.token_id}")[: protocol.MAX_SHORT_TEXT],
        token_id=actor.token_id,
        command=request.command,
        why=request.reason or None,
    )
    session.add(row)
    session.flush()
    record_audit(
        session=session,
        workspace_id=workspace_id,
        actor=actor,
        action="placement.created",
        target=f"placement {row.id} on host {row.host}",
        outcome="ok",
        detail=f"{row.command or 'a job'}: {_asked(row)}" + given_why(row.why),
        now=now,
    )
    return row


def _asked(row: Placement) -> str:
    gpu = row.gpu_uuid or "the GPU with the most room"
    need = f"{gib(row.need_bytes)}" if row.need_bytes else "no memory said"
    return f"{gpu}, {need}, priority {protocol.priority_name(row.priority)}"


def find_placement(
    *, session: Session, workspace_id: int, placement_id: int, actor: AuthInfo | None = None, for_update: bool = False
) -> Placement:
    """The row; a job token sees only the placements it asked for (others: not found)."""
    query = select(Placement).where(Placement.workspace_id == workspace_id, Placement.id == placement_id)
    if for_update:
        query = query.with_for_update()
    row = session.scalar(query)
    if row is None or (actor is not None and actor.role == protocol.ROLE_JOB and row.token_id != actor.token_id):
        raise NotFound(f"placement {placement_id} not found")
    return row


def end_placement(*, session: Session, row: Placement, state: str, note: str, now: float) -> None:
    """Waits no more (``cancelled``: never placed; ``ended``: placed, its job never took the room;
    ``started``: its job registered): the room held for it released, but for a started job's, which
    holds what its memory has not yet taken until it expires, STARTED_HOLD_S after the registration at
    the earliest (a job registers before it allocates: HostRoom.read counts the hold less what the
    job's reports show)."""
    row.state = state
    row.finished_at = now
    row.note = note[: protocol.MAX_LONG_TEXT]
    if state != "started":
        release_placement_room(session=session, row=row)


def release_placement_room(*, session: Session, row: Placement) -> None:
    if row.reservation_id is not None:
        reservation = session.get(Reservation, row.reservation_id)
        if reservation is not None:
            session.delete(reservation)
        row.reservation_id = None


def close_placement(
    *, session: Session, workspace_id: int, actor: AuthInfo, placement_id: int, now: float
) -> wire.PlacementInfo:
    """``flexium run`` is done with it (its job ended, or Ctrl-C while it waited): a live one ends
    and its room goes; a started one stays as it is, but for what is still held for its job, which
    goes with it."""
    row = find_placement(
        session=session, workspace_id=workspace_id, placement_id=placement_id, actor=actor, for_update=True
    )
    if row.state == "started":
        release_placement_room(session=session, row=row)
    if row.state in protocol.LIVE_PLACEMENT_STATES:
        who = actor.token_name or f"token {actor.token_id}"
        state = "cancelled" if row.state == "waiting" else "ended"
        end_placement(session=session, row=row, state=state, note=f"{state} by {who}", now=now)
        record_audit(
            session=session,
            workspace_id=workspace_id,
            actor=actor,
            action=f"placement.{state}",
            target=f"placement {row.id} on host {row.host}",
            outcome="ok",
            detail=row.command,
            now=now,
        )
    return placement_view(session=session, row=row, now=now)


def take_placement(
    *, session: Session, workspace_id: int, actor: AuthInfo, placement_id: int, process_id: str, now: float
) -> wire.PlacementInfo | None:
    """A job registered with the placement ``flexium run`` handed it: the room held for it is its
    own now (its memory shows in its GPU's reports). Only the token the placement was asked with,
    or the job token flexium run minted with it, takes it; another is refused in the audit log. A
    placement that is not live any more (ended, or of another workspace) is left as it is: the job
    runs, only without held room. The placement taken, as it is now (None: not taken)."""
    row = session.scalar(
        select(Placement).where(Placement.workspace_id == workspace_id, Placement.id == placement_id).with_for_update()
    )
    if row is None or row.state not in protocol.LIVE_PLACEMENT_STATES:
        return None
    if row.token_id is None or row.token_id not in (actor.token_id, _minted_by(session, actor.token_id)):
        record_audit(
            session=session,
            workspace_id=workspace_id,
            actor=actor,
            action="placement.taken",
            target=f"placement {row.id} on host {row.host}",
            outcome="refused",
            detail=f"process {process_id} registered with a token the placement was not made for",
            now=now,
            process_id=process_id,
        )
        return None
    row.process_id = process_id
    end_placement(session=session, row=row, state="started", note=f"process {process_id} registered", now=now)
    held = session.get(Reservation, row.reservation_id) if row.reservation_id is not None else None
    if held is not None:
        held.holder = f"placement {row.id}, process {process_id} started: until its memory shows"[
            : protocol.MAX_SHORT_TEXT
        ]
        held.expires_at = max(held.expires_at, now + protocol.STARTED_HOLD_S)
    return placement_view(session=session, row=row, now=now)


def _minted_by(session: Session, token_id: int) -> int | None:
    """The token that issued this one (flexium run mints its job's token with the caller's)."""
    return session.scalar(select(Token.minted_by).where(Token.id == token_id))


def get_placement(
    *, session: Session, workspace_id: int, actor: AuthInfo, placement_id: int, now: float
) -> wire.PlacementInfo:
    row = find_placement(session=session, workspace_id=workspace_id, placement_id=placement_id, actor=actor)
    return placement_view(session=session, row=row, now=now)


def list_placements(
    *,
    session: Session,
    workspace_id: int,
    actor: AuthInfo,
    now: float,
    host: str | None = None,
    live: bool = True,
    limit: int = 100,
) -> list[wire.PlacementInfo]:
    """Live placements by host in the queue's order (with the started ones whose room is still held:
    room the queue counts as taken), or with ``live=False`` every one, newest first; a job token's own
    only."""
    holding = exists().where(Reservation.id == Placement.reservation_id, Reservation.expires_at > now)
    rows = listed(
        Placement,
        session=session,
        workspace_id=workspace_id,
        host=host,
        live=live,
        limit=limit,
        live_where=or_(
            Placement.state.in_(protocol.LIVE_PLACEMENT_STATES), and_(Placement.state == "started", holding)
        ),
        live_order=queue_order(Placement),
        where=[Placement.token_id == actor.token_id] if actor.role == protocol.ROLE_JOB else [],
    )
    # A started job whose memory has shown holds nothing more, though its reservation lives on: the live
    # listing leaves it out, the whole one shows it without room held.
    started = [row.id for row in rows if row.state == "started"]
    holding_still = started_still_holding(session=session, workspace_id=workspace_id, placement_ids=started, now=now)
    if live:
        rows = [row for row in rows if row.state != "started" or row.id in holding_still]
    views = [placement_view(session=session, row=row, now=now) for row in rows]
    return [
        view.model_copy(update={"reservation": None})
        if view.state == "started" and view.id not in holding_still
        else view
        for view in views
    ]


def placement_hosts(*, session: Session) -> list[tuple[int, str]]:
    """(workspace id, host) of every host with a live placement: the sweep's placement pass."""
    query = select(Placement.workspace_id, Placement.host).where(Placement.state.in_(protocol.LIVE_PLACEMENT_STATES))
    return sorted((ws, host) for ws, host in session.execute(query.distinct()))


def live_placements(*, session: Session, workspace_id: int, host: str) -> list[Placement]:
    """The host's live placements in the queue's order, read locked (another server's pass skips
    them)."""
    query = select(Placement).where(
        Placement.workspace_id == workspace_id,
        Placement.host == host,
        Placement.state.in_(protocol.LIVE_PLACEMENT_STATES),
    )
    return list(session.scalars(query.order_by(*queue_order(Placement)).with_for_update(skip_locked=True)))


def _position(session: Session, row: Placement) -> int:
    """Its place in its host's queue (1: next), in the queue's one order of placements and paused jobs' waits."""
    waiting = session.scalars(
        select(Placement.id)
        .where(Placement.workspace_id == row.workspace_id, Placement.host == row.host, Placement.state == "waiting")
        .order_by(*queue_order(Placement))
    )
    return (
        list(waiting).index(row.id) + waits_ahead(session, row.workspace_id, row.host, row.priority, row.created_at) + 1
    )


def placement_view(*, session: Session, row: Placement, now: float) -> wire.PlacementInfo:
    reservation = None if row.reservation_id is None else session.get(Reservation, row.reservation_id)
    indexes = (
        {}
        if row.placed_uuid is None and row.gpu_uuid is None
        else device_indexes(session=session, workspace_id=row.workspace_id, host=row.host)
    )
    return wire.PlacementInfo(
        id=row.id,
        host=row.host,
        state=row.state,  # type: ignore[arg-type]  # one of protocol.PLACEMENT_STATES, written here only
        gpu_uuid=row.gpu_uuid,
        gpu_index=None if row.gpu_uuid is None else indexes.get(row.gpu_uuid),
        need_bytes=row.need_bytes,
        priority=row.priority,
        position=_position(session, row) if row.state == "waiting" else None,
        placed_uuid=row.placed_uuid,
        placed_index=None if row.placed_uuid is None else indexes.get(row.placed_uuid),
        process_id=row.process_id,
        created_at=row.created_at,
        placed_at=row.placed_at,
        finished_at=row.finished_at,
        requested_by=row.requested_by,
        command=row.command,
        why=row.why,
        note=row.note,
        reservation=None if reservation is None or reservation.expires_at <= now else reservation_view(reservation),
    )
