"""GPUs, as the processes of each host report them through NVML. A host's report replaces
its previous one; memory held by this workspace's flexium jobs is computed from their own
reports, so the dashboard can tell ours from others'. A report that would store more GPUs for a
host, or more hosts, than the workspace's quotas allow is refused (``quotas.check_new_gpus``)."""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

from sqlalchemy import select
from sqlalchemy.dialects.postgresql import insert as pg_insert
from sqlalchemy.dialects.sqlite import insert as sqlite_insert
from sqlalchemy.orm import Session

from flexium import protocol, wire
from flexium.server.models import Device, Process, table_of
from flexium.server.storage import quotas
from flexium.server.storage.history import record_samples
from flexium.server.storage.reservations import holds_on_host
from flexium.server.storage.staleness import process_heard, silent

_FIELDS = ("index", "name", "memory_total", "memory_used", "utilization", "temperature", "health")


def upsert_devices(
    *,
    session: Session,
    workspace_id: int,
    host: str,
    devices: Iterable[wire.GpuReport],
    now: float,
    reporter: int | None = None,
    fresh_for: float = protocol.STALE_AFTER_S,
) -> None:
    """Insert or update a host's GPUs in one statement (and take the GPU history's samples). The
    jobs of one host report the same GPUs, often at the same moment: ON CONFLICT makes that race
    harmless on both databases.

    ``reporter``: the token of the process that reports. A GPU whose row holds another token's
    report, younger than ``fresh_for``, keeps it when this one calls the GPU less healthy: a
    token's job could otherwise make every GPU of a host look sick (refused as a target) while
    the jobs there report it well. A GPU really gone bad is said by those jobs too, and their
    report (or ours, once theirs is old) is taken."""
    devices = _not_sicker_than_others(
        session, workspace_id=workspace_id, host=host, devices=devices, reporter=reporter, since=now - fresh_for
    )
    rows = {}
    for report in devices:
        row: dict[str, Any] = {
            "workspace_id": workspace_id,
            "host": host,
            "uuid": report.uuid,
            "updated_at": now,
            "reported_by": reporter,
        }
        for name in _FIELDS:
            value = getattr(report, name)
            if value is None and name in _NOT_NULL:
                value = _NOT_NULL[name]
            row[name] = value
        rows[row["uuid"]] = row  # a GPU listed twice: the last one wins
    if not rows:
        return
    quotas.check_new_gpus(session=session, workspace_id=workspace_id, host=host, uuids=rows.keys())
    # In one order (by UUID) whatever order a job lists them in: two jobs' upserts then lock
    # the rows in the same order and cannot deadlock on PostgreSQL.
    session.execute(_upsert(session.get_bind().dialect.name), [rows[uuid] for uuid in sorted(rows)])
    record_samples(session=session, workspace_id=workspace_id, host=host, devices=devices, now=now)


def _not_sicker_than_others(
    session: Session,
    *,
    workspace_id: int,
    host: str,
    devices: Iterable[wire.GpuReport],
    reporter: int | None,
    since: float,
) -> list[wire.GpuReport]:
    devices = list(devices)
    if reporter is None or not devices:
        return devices
    kept = {
        row.uuid: row.health
        for row in session.execute(
            select(Device.uuid, Device.health).where(
                Device.workspace_id == workspace_id,
                Device.host == host,
                Device.uuid.in_([report.uuid for report in devices]),
                Device.reported_by.is_not(None),
                Device.reported_by != reporter,
                Device.updated_at >= since,
            )
        )
    }
    return [
        report
        for report in devices
        if report.uuid not in kept or _sickness(report.health) <= _sickness(kept[report.uuid])
    ]


def _sickness(health: str | None) -> int:
    if health in (None, protocol.HEALTH_OK):
        return 0
    return 1 if health == protocol.HEALTH_UNKNOWN else 2


_NOT_NULL: dict[str, Any] = {"name": "", "memory_total": 0, "memory_used": 0, "health": "ok"}
_UPSERTS: dict[str, Any] = {}


def _upsert(dialect: str) -> Any:
    """The upsert of a host's GPUs, built once per dialect: built and compiled for each report, it was
    most of the time the server spent storing GPU reports."""
    stmt = _UPSERTS.get(dialect)
    if stmt is None:
        insert = (sqlite_insert if dialect == "sqlite" else pg_insert)(table_of(Device))
        stmt = _UPSERTS[dialect] = insert.on_conflict_do_update(
            index_elements=["workspace_id", "host", "uuid"],
            set_={name: insert.excluded[name] for name in (*_FIELDS, "updated_at", "reported_by")},
        )
    return stmt


def device_view(
    row: Device, *, flexium_bytes: int, processes: list[str], reserved: int = 0, drained: str | None = None
) -> wire.DeviceInfo:
    return wire.DeviceInfo(
        uuid=row.uuid,
        index=row.index,
        name=row.name,
        memory_total=row.memory_total,
        memory_used=row.memory_used,
        memory_flexium=flexium_bytes,
        memory_other=max(0, row.memory_used - flexium_bytes),
        memory_reserved=reserved,
        memory_free=max(0, row.memory_total - row.memory_used),
        utilization=row.utilization,
        temperature=row.temperature,
        health=row.health,
        drained=drained,
        updated_at=row.updated_at,
        processes=processes,
    )


def list_devices(
    *, session: Session, workspace_id: int, now: float, stale_after: float, host: str | None = None
) -> wire.DevicesResponse:
    """Hosts by name, each with its devices by index: what is held there for jobs not on it yet, and
    the drain of each drained one."""
    from flexium.server.storage.drains import drain_refusal  # drains reads devices: imported here

    query = select(Device).where(Device.workspace_id == workspace_id)
    if host:
        query = query.where(Device.host == host)
    rows = list(session.scalars(query.order_by(Device.host, Device.index, Device.uuid)))
    on_gpu: dict[tuple[str, str], tuple[int, list[str]]] = {}
    for proc in session.execute(
        select(
            Process.process_id, Process.host, Process.gpu_uuid, Process.memory_bytes, Process.gpu_bytes, Process.state
        ).where(
            Process.workspace_id == workspace_id,
            process_heard(now=now, stale_after=stale_after),
            Process.gpu_uuid.is_not(None),
        )
    ):
        if proc.state == "PAUSED":  # gpu_uuid is where it paused from: it holds nothing there
            continue
        for uuid, held in held_by_gpu(proc.gpu_uuid, proc.memory_bytes, proc.gpu_bytes).items():
            used, names = on_gpu.get((proc.host, uuid), (0, []))
            on_gpu[(proc.host, uuid)] = (used + held, names + [proc.process_id])
    reserved: dict[tuple[str, str], int] = {}
    for on_host in {row.host for row in rows}:
        for uuid, _wait, held in holds_on_host(session=session, workspace_id=workspace_id, host=on_host, now=now):
            reserved[(on_host, uuid)] = reserved.get((on_host, uuid), 0) + held
    hosts: dict[str, wire.HostInfo] = {}
    for row in rows:
        entry = hosts.setdefault(
            row.host, wire.HostInfo(host=row.host, updated_at=row.updated_at, stale=True, devices=[])
        )
        entry.updated_at = max(entry.updated_at, row.updated_at)
        entry.stale = silent(entry.updated_at, now=now, stale_after=stale_after)
        used, names = on_gpu.get((row.host, row.uuid), (0, []))
        view = device_view(
            row,
            flexium_bytes=used,
            processes=names,
            reserved=reserved.get((row.host, row.uuid), 0),
            drained=drain_refusal(session=session, dev=row),
        )
        entry.devices.append(view)
    return wire.DevicesResponse(hosts=list(hosts.values()))


def held_by_gpu(gpu_uuid: str | None, memory_bytes: int, gpu_bytes: dict[str, int] | None) -> dict[str, int]:
    """What a process holds on each GPU: for a process on several, its own report by GPU; else
    (one GPU, an older client, a report from before it moved off those GPUs) all of its memory,
    as of its last heartbeat, on the GPU it is on."""
    if gpu_bytes and len(gpu_bytes) > 1 and gpu_uuid in gpu_bytes:
        return {str(uuid): int(held) for uuid, held in gpu_bytes.items()}
    return {gpu_uuid: memory_bytes} if gpu_uuid else {}


def host_devices(*, session: Session, workspace_id: int, host: str) -> dict[str, Device]:
    return {
        d.uuid: d
        for d in session.scalars(select(Device).where(Device.workspace_id == workspace_id, Device.host == host))
    }


def device_indexes(*, session: Session, workspace_id: int, host: str | None = None) -> dict[str, int | None]:
    """GPU UUID -> nvidia-smi index on its host (of ``host`` only, when given), for showing a
    GPU that processes and commands name by UUID only. A UUID names one GPU, so one map
    serves every host of a workspace."""
    query = select(Device.uuid, Device.index).where(Device.workspace_id == workspace_id)
    if host is not None:
        query = query.where(Device.host == host)
    return {uuid: index for uuid, index in session.execute(query)}


def find_device_hosts(*, session: Session, workspace_id: int, uuid: str) -> list[str]:
    return list(session.scalars(select(Device.host).where(Device.workspace_id == workspace_id, Device.uuid == uuid)))
