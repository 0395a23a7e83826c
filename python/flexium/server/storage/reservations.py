"""Room held on a GPU for one job: made for it by pausing others (``policies/make_room.py``), taken
by its resume, released when its wait ends, or dropped by the sweep when it expires. The queue
counts a reservation as taken for every wait but its own (``policies/room.py``)."""

from __future__ import annotations

from collections.abc import Iterable

from sqlalchemy import and_, delete, or_, select
from sqlalchemy.orm import Session

from flexium import wire
from flexium.server.models import Device, Reservation, Wait


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
    """The GPU rows of each (workspace id, host) read locked before a policy counts its room and acts
    on it: the queue's pass, the placements', a drain's, a make-room; two of them on one host (two
    servers on PostgreSQL) run one after the other, the second counting what the first did (SQLite
    has one writer). Taken first in its transaction, in one order (by host, then UUID, as a GPU
    report writes them; a pass over several hosts locks them in this order too): two transactions
    never each hold a row the other waits for."""
    wanted = sorted(set(hosts))
    if not wanted:
        return
    query = select(Device.id).where(or_(*(and_(Device.workspace_id == ws, Device.host == host) for ws, host in wanted)))
    session.execute(query.order_by(Device.workspace_id, Device.host, Device.uuid).with_for_update()).all()


def release_room(*, session: Session, wait_id: int) -> None:
    """The wait's reservations go: it resumed, or it waits no more."""
    session.execute(delete(Reservation).where(Reservation.wait_id == wait_id))


def held_on_host(*, session: Session, workspace_id: int, host: str, now: float) -> list[tuple[Reservation, str | None]]:
    """The host's reservations not expired, each with the state of the wait it is for (None: for
    a job not started yet)."""
    rows = session.execute(
        select(Reservation, Wait.state)
        .outerjoin(Wait, Wait.id == Reservation.wait_id)
        .where(Reservation.workspace_id == workspace_id, Reservation.host == host, Reservation.expires_at > now)
    )
    return [(row, state) for row, state in rows]


def reservation_of(*, session: Session, wait_id: int, now: float) -> Reservation | None:
    return session.scalar(
        select(Reservation).where(Reservation.wait_id == wait_id, Reservation.expires_at > now).limit(1)
    )


def expire_reservations(*, session: Session, now: float) -> list[tuple[int, str]]:
    """Drops the reservations past their time; (workspace id, host) of each, whose queue may now
    use that room."""
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
