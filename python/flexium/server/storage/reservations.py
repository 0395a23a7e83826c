"""Room held on a GPU for one job: made for it by pausing others (``policies/make_room.py``), taken
by its resume, released when its wait ends, or dropped by the sweep when it expires. A hold does not
run out while the pauses that make its room are under way (a job may take its pause late): the
sweep holds it a full time again. The queue counts a reservation as taken for every wait but its own
(``policies/room.py``)."""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

from sqlalchemy import Integer, and_, cast, delete, exists, func, select, update
from sqlalchemy.orm import Session

from flexium import protocol, wire
from flexium.server.models import Command, Placement, Process, Reservation, Wait
from flexium.server.storage.audit import PolicyActor

MAKE_ROOM = PolicyActor("make room")  # who sends the pauses that make a hold's room


def hold_room(
    *,
    session: Session,
    workspace_id: int,
    host: str,
    gpu_uuid: str,
    nbytes: int,
    wait_id: int | None,
    holder: str,
    now: float,
    ttl: float,
) -> Reservation:
    row = Reservation(
        workspace_id=workspace_id,
        host=host,
        gpu_uuid=gpu_uuid,
        bytes=nbytes,
        wait_id=wait_id,
        holder=holder,
        created_at=now,
        expires_at=now + ttl,
    )
    session.add(row)
    session.flush()
    return row


def lock_hosts(*, session: Session, hosts: Iterable[tuple[int, str]]) -> None:
    """The lock of each (workspace id, host), taken before a policy counts the host's room and acts
    on it: the queue's pass, the placements', a drain's, a make-room; two of them on one host (two
    servers on PostgreSQL) run one after the other, the second counting what the first did. A
    transaction-scoped advisory lock that only the policies take: a GPU report, which locks its
    process's row and then its host's GPU rows, never waits for a pass, and a pass (which locks
    a process's row when it sends it a command) never waits for a report while holding a lock the
    report waits for. Taken first in its transaction, hosts in one order. SQLite has one writer:
    a writing transaction runs alone."""
    if session.get_bind().dialect.name != "postgresql":
        return
    for workspace_id, host in sorted(set(hosts)):
        session.execute(select(func.pg_advisory_xact_lock(cast(workspace_id, Integer), func.hashtext(host))))


def lock_process_host(*, session: Session, workspace_id: int, process_id: str) -> None:
    """The lock of the host of a process a request acts on (lock_hosts), taken before that process's
    row is locked: a policy's pass on that host takes the host's lock, then rows (a process's when it
    sends it a command), so the other order would deadlock against it. A process stays on its host."""
    host = session.scalar(
        select(Process.host).where(Process.workspace_id == workspace_id, Process.process_id == process_id)
    )
    if host is not None:
        lock_hosts(session=session, hosts=[(workspace_id, host)])


def release_room(*, session: Session, wait_id: int) -> None:
    """The wait's reservations go: it resumed, or it waits no more."""
    session.execute(delete(Reservation).where(Reservation.wait_id == wait_id))


def drop_room_not_made(*, session: Session, cmd: Command, proc: Process) -> list[Reservation]:
    """A pause make-room sent that failed or expired leaves its job running on the GPU the room was to be
    made on: the holds there made with it (in its transaction: the same time) wait for room that will not
    come. They are dropped and returned, so that whom they held room for is told; another's hold on that
    GPU stays."""
    if cmd.sent_by != MAKE_ROOM.label or proc.gpu_uuid is None:
        return []
    rows = list(
        session.scalars(
            select(Reservation).where(
                Reservation.workspace_id == cmd.workspace_id,
                Reservation.host == proc.host,
                Reservation.gpu_uuid == proc.gpu_uuid,
                Reservation.created_at == cmd.created_at,
            )
        )
    )
    for row in rows:
        session.delete(row)
    session.flush()
    return rows


def held_on_host(*, session: Session, workspace_id: int, host: str, now: float) -> list[tuple[Reservation, str | None]]:
    """The host's reservations not expired, each with the state of the wait it is for (None: for
    a job not started yet)."""
    rows = session.execute(
        select(Reservation, Wait.state)
        .outerjoin(Wait, Wait.id == Reservation.wait_id)
        .where(Reservation.workspace_id == workspace_id, Reservation.host == host, Reservation.expires_at > now)
    )
    return [(row, state) for row, state in rows]


def holds_on_host(*, session: Session, workspace_id: int, host: str, now: float) -> list[tuple[str, int | None, int]]:
    """(GPU, wait id or None for a job not started yet, bytes) of the room held on the host now: a wait
    whose resume is under way holds none (its memory is on its way); for a job ``flexium run`` started,
    what its memory has not taken yet."""
    started = _started_placements(session=session, workspace_id=workspace_id, host=host)
    holds = []
    for reservation, wait_state in held_on_host(session=session, workspace_id=workspace_id, host=host, now=now):
        if wait_state == "dispatched":
            continue
        held: int | None = reservation.bytes
        if reservation.id in started:
            held = started_hold(reservation.bytes, *started[reservation.id])
        if held is not None:
            holds.append((reservation.gpu_uuid, reservation.wait_id, held))
    return holds


def started_hold(held: int, need: int, memory: int | None, state: str | None) -> int | None:
    """What a hold of ``held`` bytes for a job ``flexium run`` started still holds: what of the ``need``
    it asked for its memory has not taken yet. None: the job is gone or not running, so nothing of it
    is on its way. The one statement of the rule, for the room the queue counts and the queue's list."""
    if memory is None or state != "RUNNING":
        return None
    return max(0, min(held, need) - memory)


def _started_placements(
    *, session: Session, workspace_id: int, host: str
) -> dict[int, tuple[int, int | None, str | None]]:
    """The reservations still held for jobs ``flexium run`` started on this host, each with the memory the
    job asked for, what its reports show now and its state (None, None: the job is gone)."""
    rows = session.execute(
        _started_query(workspace_id).add_columns(Placement.reservation_id).where(Placement.host == host)
    )
    return {int(reservation_id): (int(need), memory, state) for need, memory, state, reservation_id in rows}


def started_still_holding(*, session: Session, workspace_id: int, placement_ids: Iterable[int], now: float) -> set[int]:
    """Those of these started placements whose job's room is still held: their reservation counts
    (``started_hold`` above 0), as ``holds_on_host`` counts it."""
    ids = list(placement_ids)
    if not ids:
        return set()
    rows = session.execute(
        _started_query(workspace_id)
        .add_columns(Placement.id, Reservation.bytes)
        .join(Reservation, Reservation.id == Placement.reservation_id)
        .where(Placement.id.in_(ids), Reservation.expires_at > now)
    )
    return {int(pid) for need, memory, state, pid, held in rows if (started_hold(held, need, memory, state) or 0) > 0}


def _started_query(workspace_id: int) -> Any:  # a Select, whose type parameters differ across SQLAlchemy 2.0 and 2.1
    """(need, the job's memory, its state) of the workspace's started placements that hold room."""
    return (
        select(Placement.need_bytes, Process.memory_bytes, Process.state)
        .outerjoin(
            Process,
            and_(Process.workspace_id == Placement.workspace_id, Process.process_id == Placement.process_id),
        )
        .where(
            Placement.workspace_id == workspace_id,
            Placement.state == "started",
            Placement.reservation_id.is_not(None),
        )
    )


def reservation_of(*, session: Session, wait_id: int, now: float) -> Reservation | None:
    return session.scalar(
        select(Reservation).where(Reservation.wait_id == wait_id, Reservation.expires_at > now).limit(1)
    )


def expire_reservations(*, session: Session, now: float, ttl: float) -> list[tuple[int, str]]:
    """Drops the reservations past their time; (workspace id, host) of each, whose queue may now
    use that room. One whose room is still being made (a pause make-room sent on its GPU since it
    was made, not ended) is held ``ttl`` from now instead, before it runs out (half its time
    left): the room it waits for has not shown yet."""
    making = exists().where(
        Command.workspace_id == Reservation.workspace_id,
        Command.kind == "pause",
        Command.state.in_(protocol.ACTIVE_COMMAND_STATES),
        Command.sent_by == MAKE_ROOM.label,
        Command.created_at >= Reservation.created_at,
        Process.pk == Command.process_pk,
        Process.host == Reservation.host,
        Process.gpu_uuid == Reservation.gpu_uuid,
    )
    session.execute(
        update(Reservation)
        .where(and_(Reservation.expires_at <= now + ttl / 2, making))
        .values(expires_at=now + ttl)
        .execution_options(synchronize_session=False)
    )
    expired = list(
        session.execute(
            select(Reservation.id, Reservation.workspace_id, Reservation.host).where(Reservation.expires_at <= now)
        )
    )
    if expired:
        session.execute(delete(Reservation).where(Reservation.id.in_([r.id for r in expired])))
    return sorted({(r.workspace_id, r.host) for r in expired})


def reservation_view(row: Reservation) -> wire.ReservationInfo:
    return wire.ReservationInfo(
        id=row.id,
        host=row.host,
        gpu_uuid=row.gpu_uuid,
        bytes=row.bytes,
        holder=row.holder,
        created_at=row.created_at,
        expires_at=row.expires_at,
    )
