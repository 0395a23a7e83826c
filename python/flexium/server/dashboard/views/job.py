"""A job's page: the process, or the job of several ranks it is a rank of, its GPUs, and its
timeline: every command its ranks received, who sent each, the commands refused for them, and
what the queue did to it (queued, taken out, its priority set), from the audit entries that name
its processes (``storage.command_senders``, ``storage.refused_commands``, ``queue_entries``)."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import ClassVar

from sqlalchemy.orm import Session

from flexium import wire
from flexium.server import storage
from flexium.server.dashboard.views.devices import Drains, GpuKey, HistoryChart, charts_of, drains_of, hosts_of
from flexium.server.dashboard.views.training import TrainingCharts, training_charts
from flexium.server.errors import NotFound
from flexium.server.storage.audit import POLICY_ROLE, SERVER_ACTOR, queue_entries

TIMELINE = 200  # commands shown on a job page, newest first; as many refused ones at most


@dataclass(frozen=True)
class SentCommand:
    """A command one of its ranks received; ``sent_by``: the token that sent it, when an audit
    entry says so; ``policy``: the server's policy that sent it instead (its reason is the
    command's)."""

    refused: ClassVar[bool] = False
    queue_event: ClassVar[bool] = False
    command: wire.CommandInfo
    sent_by: str | None
    policy: str | None = None

    @property
    def at(self) -> float:
        return self.command.created_at


@dataclass(frozen=True)
class RefusedCommand:
    """A command the server refused, never created: what was asked (``kind``, ``to`` the target
    named, if any) as its audit entry records it."""

    refused: ClassVar[bool] = True
    queue_event: ClassVar[bool] = False
    entry: wire.AuditEntry
    kind: str
    to: str | None

    @property
    def at(self) -> float:
        return self.entry.at


@dataclass(frozen=True)
class QueueEvent:
    """A wait queued or taken out of the queue, or a priority set, as its audit entry says: by a
    token (``by``) or by one of the server's policies (``policy``); ``why``: the wait's reason
    (who queued it, for which GPU, and the reason they gave) or why it left."""

    refused: ClassVar[bool] = False
    queue_event: ClassVar[bool] = True
    entry: wire.AuditEntry

    @property
    def at(self) -> float:
        return self.entry.at

    @property
    def what(self) -> str:
        if self.entry.action == "priority.set":  # its detail reads "normal -> high"
            return "priority " + self.entry.detail.replace(" -> ", " → ")
        return "queued to resume when free" if self.entry.action == "wait.created" else "taken out of the queue"

    @property
    def why(self) -> str | None:
        return None if self.entry.action == "priority.set" else self.entry.detail or None

    @property
    def policy(self) -> str | None:
        return self.entry.token_name.removeprefix(f"{POLICY_ROLE}: ") if self.entry.role == POLICY_ROLE else None

    @property
    def by(self) -> str:
        if self.entry.token_id is None and self.entry.token_name == SERVER_ACTOR:
            return "the server"  # the job left, or cannot resume any more
        return self.entry.token_name or f"token {self.entry.token_id}"


TimelineItem = SentCommand | RefusedCommand | QueueEvent


@dataclass(frozen=True)
class JobProgress:
    """fragments/job_progress.html: what a job's page shows of its training, again once a
    ``progress`` event says its ranks reported more (a few reads, not the whole page's)."""

    now: float
    process: wire.ProcessInfo
    job: wire.JobSummary | None
    ranks: tuple[wire.ProcessInfo, ...]
    charts: TrainingCharts  # its lead's: the process, or rank 0 of its job


def job_progress(
    *, session: Session, workspace_id: int, process_id: str, now: float, stale_after: float
) -> JobProgress:
    """The process, and the job of several ranks it is a rank of; ``NotFound`` when it is gone."""
    process = storage.get_process(
        session=session, workspace_id=workspace_id, process_id=process_id, now=now, stale_after=stale_after
    )
    if process.job is not None and process.job.world_size > 1:
        members = storage.list_processes(
            session=session, workspace_id=workspace_id, now=now, stale_after=stale_after, job_key=process.job.key
        )
        job = next(iter(storage.summarize_jobs(members)), None)
        if job is not None:
            charts = training_charts(session=session, workspace_id=workspace_id, process=job.ranks[0], now=now)
            return JobProgress(now=now, process=process, job=job, ranks=tuple(job.ranks), charts=charts)
    charts = training_charts(session=session, workspace_id=workspace_id, process=process, now=now)
    return JobProgress(now=now, process=process, job=None, ranks=(process,), charts=charts)


@dataclass(frozen=True)
class JobPage:
    """job.html and fragments/job_panel.html."""

    now: float
    process: wire.ProcessInfo  # the one the page is for
    job: wire.JobSummary | None
    ranks: tuple[wire.ProcessInfo, ...]  # the job's ranks, or the process alone
    gpu_indexes: dict[str, int | None]
    hosts: tuple[wire.HostInfo, ...]  # its ranks' hosts
    history: dict[GpuKey, HistoryChart]
    drains: Drains  # of its GPUs' hosts
    charts: TrainingCharts
    timeline: tuple[TimelineItem, ...]
    wait: wire.WaitInfo | None  # its place in the resume-when-free queue, while it waits


def job_page(*, session: Session, workspace_id: int, process_id: str, now: float, stale_after: float) -> JobPage:
    """``NotFound`` when the process is gone."""
    training = job_progress(
        session=session, workspace_id=workspace_id, process_id=process_id, now=now, stale_after=stale_after
    )
    ranks = training.ranks
    hosts = sorted({r.host for r in ranks})
    shown = hosts_of(session=session, workspace_id=workspace_id, now=now, stale_after=stale_after, hosts=hosts)
    return JobPage(
        now=now,
        process=training.process,
        job=training.job,
        ranks=ranks,
        gpu_indexes=storage.device_indexes(session=session, workspace_id=workspace_id),
        hosts=shown,
        history=charts_of(session=session, workspace_id=workspace_id, now=now, hosts=hosts),
        drains=drains_of(
            session=session, workspace_id=workspace_id, now=now, stale_after=stale_after, hosts=(h.host for h in shown)
        ),
        charts=training.charts,
        timeline=timeline(session=session, workspace_id=workspace_id, process_ids=[r.process_id for r in ranks]),
        wait=_wait(session=session, workspace_id=workspace_id, wait_id=training.process.wait_id, now=now),
    )


def _wait(*, session: Session, workspace_id: int, wait_id: int | None, now: float) -> wire.WaitInfo | None:
    if wait_id is None:
        return None
    try:
        return storage.get_wait(session=session, workspace_id=workspace_id, wait_id=wait_id, now=now)
    except NotFound:  # ended between the two reads
        return None


def timeline(*, session: Session, workspace_id: int, process_ids: Sequence[str]) -> tuple[TimelineItem, ...]:
    """The commands of these processes, those refused for them and what the queue did to them,
    newest first."""
    commands: list[wire.CommandInfo] = []
    for process_id in process_ids:
        commands += storage.list_commands(
            session=session, workspace_id=workspace_id, process_id=process_id, limit=TIMELINE
        )
    commands = sorted(commands, key=lambda c: c.id, reverse=True)[:TIMELINE]
    senders = storage.command_senders(
        session=session, workspace_id=workspace_id, process_ids=process_ids, command_ids=[c.id for c in commands]
    )
    refusals = storage.refused_commands(
        session=session, workspace_id=workspace_id, process_ids=process_ids, limit=TIMELINE
    )
    items: list[TimelineItem] = [_sent(c, senders.get(c.id)) for c in commands]
    items += [_refused(e) for e in refusals]
    queued = queue_entries(session=session, workspace_id=workspace_id, process_ids=process_ids, limit=TIMELINE)
    items += [QueueEvent(entry=e) for e in queued]
    return tuple(sorted(items, key=lambda item: item.at, reverse=True))


def _sent(command: wire.CommandInfo, entry: wire.AuditEntry | None) -> SentCommand:
    """Who sent it: a token, or one of the server's policies (its entry's name reads
    "policy: resume when free")."""
    if entry is None:
        return SentCommand(command=command, sent_by=None)
    if entry.role == POLICY_ROLE:
        return SentCommand(command=command, sent_by=None, policy=entry.token_name.removeprefix(f"{POLICY_ROLE}: "))
    return SentCommand(command=command, sent_by=entry.token_name or f"token {entry.token_id}")


def _refused(entry: wire.AuditEntry) -> RefusedCommand:
    """Its entry's target reads "pause gpu-1", "migrate gpu-1 to 2" (``storage.audit``)."""
    asked, to, target = entry.target.partition(" to ")
    return RefusedCommand(entry=entry, kind=asked.split(" ")[0], to=target if to else None)
