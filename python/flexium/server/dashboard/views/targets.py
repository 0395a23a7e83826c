"""The Migrate and Resume dialogs' forms: the GPUs of a process's host judged as targets by the
rules the API enforces (``storage.judge_targets``); for a process on several GPUs, a GPU for
each of its GPUs; for a job of several ranks, a GPU for each rank."""

from __future__ import annotations

from dataclasses import dataclass

from sqlalchemy.orm import Session

from flexium import wire
from flexium.server import storage
from flexium.server.dashboard.views.devices import hosts_of
from flexium.server.errors import NotFound


@dataclass(frozen=True)
class TargetForm:
    """fragments/targets.html: only the GPUs that can take the process are offered."""

    process: wire.ProcessInfo
    kind: str
    fits: tuple[wire.DeviceInfo, ...]
    refused: tuple[wire.TargetInfo, ...]  # each with why not
    gpu_indexes: dict[str, int | None]


@dataclass(frozen=True)
class ShareTarget:
    """A line of the migrate form of a process on several GPUs: what it holds on ``uuid`` may go
    to one of ``gpus``."""

    uuid: str
    gpus: tuple[wire.DeviceInfo, ...]


@dataclass(frozen=True)
class GpusForm:
    """fragments/gpus_migrate.html: a process on several GPUs, its own device's first."""

    process: wire.ProcessInfo
    gpu_targets: tuple[ShareTarget, ...]
    gpu_indexes: dict[str, int | None]


def target_form(
    *, session: Session, workspace_id: int, process_id: str, kind: str, now: float, stale_after: float
) -> TargetForm | GpusForm | None:
    """None: the process is gone."""
    try:
        process = storage.get_process(
            session=session, workspace_id=workspace_id, process_id=process_id, now=now, stale_after=stale_after
        )
    except NotFound:
        return None
    judged = storage.judge_targets(
        session=session, workspace_id=workspace_id, process_id=process_id, kind=kind, now=now, stale_after=stale_after
    )
    gpu_indexes = storage.device_indexes(session=session, workspace_id=workspace_id)
    if kind == "migrate" and process.other_gpus:
        seen = _seen_gpus(process, {t.device.uuid: t.device for t in judged})
        held_on = [process.gpu_uuid or "", *process.other_gpus]
        return GpusForm(
            process=process,
            gpu_targets=tuple(ShareTarget(uuid=uuid, gpus=seen) for uuid in held_on),
            gpu_indexes=gpu_indexes,
        )
    return TargetForm(
        process=process,
        kind=kind,
        fits=tuple(t.device for t in judged if t.refusal is None),
        refused=tuple(t for t in judged if t.refusal is not None),
        gpu_indexes=gpu_indexes,
    )


@dataclass(frozen=True)
class RankTarget:
    """A line of a job's migrate form: ``rank`` may go to one of ``gpus``."""

    rank: wire.ProcessInfo
    gpus: tuple[wire.DeviceInfo, ...]


@dataclass(frozen=True)
class JobMigrateForm:
    """fragments/job_migrate.html: a GPU for each rank, where it is by default."""

    job: wire.JobSummary
    rank_targets: tuple[RankTarget, ...]
    gpu_indexes: dict[str, int | None]


def job_migrate_form(
    *, session: Session, workspace_id: int, job_key: str, now: float, stale_after: float
) -> JobMigrateForm | None:
    """None: no job of several ranks has this key."""
    ranks = storage.list_processes(
        session=session, workspace_id=workspace_id, now=now, stale_after=stale_after, job_key=job_key
    )
    job = next(iter(storage.summarize_jobs(ranks)), None)
    if job is None:
        return None
    hosts = hosts_of(
        session=session,
        workspace_id=workspace_id,
        now=now,
        stale_after=stale_after,
        hosts=sorted({rank.host for rank in job.ranks}),
    )
    on_host = {h.host: {d.uuid: d for d in h.devices} for h in hosts}
    return JobMigrateForm(
        job=job,
        rank_targets=tuple(
            RankTarget(rank=rank, gpus=_seen_gpus(rank, on_host.get(rank.host, {}))) for rank in job.ranks
        ),
        gpu_indexes=storage.device_indexes(session=session, workspace_id=workspace_id),
    )


def _seen_gpus(process: wire.ProcessInfo, devices: dict[str, wire.DeviceInfo]) -> tuple[wire.DeviceInfo, ...]:
    """The GPUs of ``devices`` (its host's, by UUID) that ``process`` sees: where a migrate form
    may send it."""
    return tuple(devices[uuid] for uuid in process.visible_gpus if uuid in devices)
