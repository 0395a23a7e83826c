"""Processes: register (an upsert, so a process re-attaches after a server restart or a
network cut), heartbeat, unregister, read."""

from __future__ import annotations

from collections.abc import Collection, Mapping
from dataclasses import dataclass, replace
from typing import Any

from sqlalchemy import bindparam, case, func, not_, or_, select, update
from sqlalchemy.orm import Session

from flexium import protocol, wire
from flexium.server.errors import Forbidden, InvalidRequest, NotFound
from flexium.server.models import Command, Process, Token, Wait, table_of
from flexium.server.storage import quotas
from flexium.server.storage.devices import device_indexes, held_by_gpu, upsert_devices
from flexium.server.storage.staleness import is_stale, process_heard, process_stale
from flexium.server.storage.token_validity import token_alive, token_end
from flexium.server.storage.views import process_view

_REGISTER_FIELDS = (
    "host",
    "user",
    "pid",
    "gpu_uuid",
    "gpu_model",
    "logical_device",
    "visible_gpus",
    "torch_version",
    "driver_version",
    "flexium_version",
    "memory_bytes",
    "state",
    "started_at",
    "cmdline",
)
# What a process says of itself after it registered (heartbeats, command reports), each
# change worth a live event to dashboards (not last_seen: that is every beat). Its location is
# gpu_uuid alone: the index and cuda:N shown with it are derived from it.
_UPDATED = ("state", "memory_bytes", "gpu_uuid")


@dataclass(frozen=True)
class Progress:
    """A process's training progress as stored (``Process.steps`` ...); all None until it
    reports steps."""

    steps: int | None = None
    steps_at: float | None = None
    steps_per_s: float | None = None
    loss: float | None = None

    @classmethod
    def of(cls, row: Process) -> Progress:
        return cls(steps=row.steps, steps_at=row.steps_at, steps_per_s=row.steps_per_s, loss=row.loss)

    def after(self, *, steps: int | None, loss: float | None, now: float, training: bool) -> Progress:
        """The progress once a body saying ``steps`` and ``loss`` (None: not said) arrives.
        steps/s is measured between two reports of steps while the process trained through both
        (``training``: ``trained_between``): a count that went back (a new process under the same
        id), or a pause or resume between them starts it afresh, as its operation's time is no
        training speed. Two reports of the same steps closer together than the last speed's step
        (a move's report and the beat after it) keep that speed: they say nothing of it."""
        progress = self if loss is None else replace(self, loss=loss)
        if steps is None:
            return progress
        rate = None
        if training and self.steps is not None and self.steps_at is not None:
            between = now - self.steps_at
            if steps == self.steps and (between <= 0 or (self.steps_per_s or 0) * between < 1):
                rate = self.steps_per_s
            elif between > 0 and steps >= self.steps:
                rate = (steps - self.steps) / between
        return replace(progress, steps=steps, steps_at=now, steps_per_s=rate)

    def after_operation(self) -> Progress:
        """A move, pause or resume (its command's report) came between: the speed starts afresh from the
        next report of steps, so that the operation's time is no training speed."""
        return replace(self, steps_at=None, steps_per_s=None)

    def store(self, row: Process) -> None:
        row.steps, row.steps_at, row.steps_per_s, row.loss = self.steps, self.steps_at, self.steps_per_s, self.loss


def trained_between(before: str, reported: str | None) -> bool:
    """Whether a process that was in state ``before`` at its last report and says ``reported`` now (None:
    unchanged) trained all the while, so that the steps between the two reports make a speed."""
    return before == "RUNNING" and reported in (None, "RUNNING")


# Said by a body beside its state; they change with every beat, so they never make a beat
# "changed" (see ``ProcessSnapshot.unchanged_by``): the beat buffer writes them.
_PROGRESS_FIELDS = ("steps", "loss")


@dataclass(frozen=True)
class ProcessSnapshot:
    """What the server keeps in memory about a process to answer plain heartbeats without the
    database (see ``record_beats``)."""

    pk: int
    host: str
    state: str
    memory_bytes: int
    footprint_bytes: int
    gpu_uuid: str | None
    last_seen: float
    token_id: int | None = None  # the token that registered it (a job token acts on its own alone)
    progress: Progress = Progress()

    @classmethod
    def of(cls, row: Process) -> ProcessSnapshot:
        return cls(
            pk=row.pk,
            host=row.host,
            state=row.state,
            memory_bytes=row.memory_bytes,
            footprint_bytes=row.footprint_bytes,
            gpu_uuid=row.gpu_uuid,
            last_seen=row.last_seen,
            token_id=row.token_id,
            progress=Progress.of(row),
        )

    def unchanged_by(self, report: wire.HeartbeatRequest) -> bool:
        """True when applying ``report`` (a heartbeat whose devices, if any, need no write)
        would change nothing but last_seen."""
        for name in report.model_fields_set:
            value = getattr(report, name)
            if name in ("seq", "devices", "room_seen", *_PROGRESS_FIELDS):
                continue  # plain beats need not move seq (see ``heartbeat``); progress: see _PROGRESS_FIELDS
            if name == "footprint_bytes":
                if value is not None and value != self.footprint_bytes:
                    return False
            elif getattr(self, name) != value and (value is not None or name == "gpu_uuid"):
                return False
        return True


@dataclass(frozen=True)
class HeartbeatOutcome:
    host: str
    pending_command: int | None
    changed: wire.ProcessInfo | None  # the process, when a watched field changed
    snapshot: ProcessSnapshot
    devices_written: bool = False  # its GPU report was stored (not when older than what is known)


def find_process(*, session: Session, workspace_id: int, process_id: str, for_update: bool = False) -> Process:
    query = select(Process).where(Process.workspace_id == workspace_id, Process.process_id == process_id)
    if for_update:
        query = query.with_for_update()
    row = session.scalar(query)
    if row is None:
        raise NotFound(f"process {process_id!r} not found")
    return row


def active_command(*, session: Session, process_pk: int) -> Command | None:
    return session.scalar(
        select(Command)
        .where(Command.process_pk == process_pk, Command.state.in_(protocol.ACTIVE_COMMAND_STATES))
        .order_by(Command.id)
        .limit(1)
    )


def _apply_footprint(row: Process, *, footprint: int | None) -> None:
    if footprint is not None:
        row.footprint_bytes = footprint
    elif row.memory_bytes:
        row.footprint_bytes = row.memory_bytes


def apply_process_update(row: Process, update: wire.ProcessUpdate | wire.HeartbeatRequest) -> None:
    """The one writer of what a process says of its state and location after it registered
    (heartbeats, command reports): a field it states is taken, None only where None means
    "none" (a gpu_uuid of None: no engine, no GPU of its own)."""
    for name in _UPDATED:
        if name in update.model_fields_set:
            value = getattr(update, name)
            if value is not None or name == "gpu_uuid":
                setattr(row, name, value)


def shown_process(
    *, session: Session, row: Process, now: float, stale_after: float, active: Command | None
) -> wire.ProcessInfo:
    """One process as the API shows it, its GPU's index read from its host's device reports."""
    [shown] = shown_processes(
        session=session,
        workspace_id=row.workspace_id,
        rows=[row],
        now=now,
        stale_after=stale_after,
        active={} if active is None else {row.pk: active},
    )
    return shown


def shown_processes(
    *,
    session: Session,
    workspace_id: int,
    rows: list[Process],
    now: float,
    stale_after: float,
    active: Mapping[int, Command],
) -> list[wire.ProcessInfo]:
    """Processes of one workspace as the API shows them (``active``: process pk -> its command under
    way), with what they share read once: GPU indexes (of their host's reports alone when they are on
    one host), the queue's waits and the tokens that ended."""
    hosts = {r.host for r in rows}
    indexes = device_indexes(session=session, workspace_id=workspace_id, host=hosts.pop() if len(hosts) == 1 else None)
    by_process, by_job = live_wait_ids(session=session, workspace_id=workspace_id)
    ended = ended_owners(session=session, rows=rows, now=now)
    return [
        process_view(
            r,
            now=now,
            stale_after=stale_after,
            gpu_indexes=indexes,
            active=active.get(r.pk),
            wait_id=by_process.get(r.pk) or (by_job.get(r.job_key) if r.job_key else None),
            token_end=ended.get(r.token_id) if r.token_id else None,
        )
        for r in rows
    ]


def ended_owners(*, session: Session, rows: list[Process], now: float) -> dict[int, protocol.TokenEnd]:
    """Of the tokens that registered ``rows``, those that no longer open doors (revoked or expired
    since), each with why."""
    owners = {r.token_id for r in rows if r.token_id is not None}
    if not owners:
        return {}
    found = session.scalars(select(Token).where(Token.id.in_(owners), not_(token_alive(now))))
    return {t.id: end for t in found if (end := token_end(t, now)) is not None}


def live_wait_ids(*, session: Session, workspace_id: int) -> tuple[dict[int, int], dict[str, int]]:
    """The live waits of the queue: (process pk -> wait id, job key -> wait id): a job's wait,
    held by one rank, is every rank's."""
    query = select(Wait.id, Wait.process_pk, Wait.job_key).where(
        Wait.workspace_id == workspace_id, Wait.state.in_(protocol.LIVE_WAIT_STATES)
    )
    by_process: dict[int, int] = {}
    by_job: dict[str, int] = {}
    for wait_id, process_pk, key in session.execute(query):
        by_process[process_pk] = wait_id
        if key is not None:
            by_job[key] = wait_id
    return by_process, by_job


def register_process(
    *, session: Session, workspace_id: int, report: wire.RegisterRequest, now: float, stale_after: float
) -> tuple[wire.ProcessInfo, bool]:
    process, created, _snapshot = register_process_snapshot(
        session=session, workspace_id=workspace_id, report=report, now=now, stale_after=stale_after
    )
    return process, created


def register_process_snapshot(
    *,
    session: Session,
    workspace_id: int,
    report: wire.RegisterRequest,
    now: float,
    stale_after: float,
    token_id: int | None = None,
    own_only: bool = False,
) -> tuple[wire.ProcessInfo, bool, ProcessSnapshot]:
    """Create or refresh a process from its registration (every field is replaced; missing
    ones take their defaults); returns (process, created). ``token_id``: the registering token,
    kept as the new process's owner; ``own_only`` (a job token): an existing process must be
    that token's, and so must the ranks already registered under its job's key."""
    if report.job is not None and report.job.rank >= report.job.world_size:
        raise InvalidRequest(f"job.rank {report.job.rank} is not a rank of a job of world_size {report.job.world_size}")
    if own_only and report.job is not None:
        _check_own_job(session=session, workspace_id=workspace_id, key=report.job.key, token_id=token_id)
    row = session.scalar(
        select(Process)
        .where(Process.workspace_id == workspace_id, Process.process_id == report.process_id)
        .with_for_update()
    )
    created = row is None
    if row is None:
        quotas.check_new_process(session=session, workspace_id=workspace_id)
        row = Process(
            workspace_id=workspace_id,
            process_id=report.process_id,
            registered_at=now,
            footprint_bytes=0,
            token_id=token_id,
            # Only a new process takes the job's own word: an admin's change outlives a registration again.
            priority=protocol.DEFAULT_PRIORITY if report.priority is None else report.priority,
        )
        session.add(row)
    elif own_only and row.token_id != token_id:
        raise Forbidden(
            f"process {report.process_id!r} was registered by another token: a job token acts only on the "
            "processes it registered (register under a new process id, or use that process's token)"
        )
    else:
        _check_reporter(row, token_id, report.devices)
    for name in _REGISTER_FIELDS:
        setattr(row, name, getattr(report, name))
    row.capabilities = quotas.stored_json(session=session, value=report.capabilities, what="the process's capabilities")
    _set_job(row, report.job)
    training = not created and trained_between(row.state, report.state)
    Progress.of(row).after(steps=report.steps, loss=report.loss, now=now, training=training).store(row)
    row.last_seen = now
    row.state_seq = report.seq
    _apply_footprint(row, footprint=report.footprint_bytes)
    session.flush()
    _store_devices(session, row, report.devices, now=now, stale_after=stale_after)
    active = None if created else active_command(session=session, process_pk=row.pk)
    shown = shown_process(session=session, row=row, now=now, stale_after=stale_after, active=active)
    return shown, created, ProcessSnapshot.of(row)


def _check_own_job(*, session: Session, workspace_id: int, key: str, token_id: int | None) -> None:
    """A rank joins its job by key alone, and a job's ranks are moved and paused as one: a job
    token that could join another token's job would take part in (and see the commands of)
    a job it did not start."""
    other = session.scalar(
        select(Process.process_id)
        .where(
            Process.workspace_id == workspace_id, Process.job_key == key, Process.token_id.is_distinct_from(token_id)
        )
        .limit(1)
    )
    if other is not None:
        raise Forbidden(
            f"job {key!r} has ranks registered by another token ({other!r} among them): a job token registers "
            "ranks only under the keys of its own jobs (every rank of one run uses the same token)"
        )


def _check_reporter(row: Process, reporter: int | None, devices: list[wire.GpuReport]) -> None:
    """A host's GPUs are reported by the token with a live process there, the one whose report
    this is: another token (an admin's, speaking for the process) has no process on that host,
    and its report would be filed under the process's token (``upsert_devices``)."""
    if devices and reporter is not None and row.token_id is not None and reporter != row.token_id:
        raise Forbidden(
            f"a GPU report of host {row.host!r} is taken from the token whose process runs there, and process "
            f"{row.process_id!r} is another token's: send it without devices, or from that process's own token"
        )


def _store_devices(
    session: Session, row: Process, devices: list[wire.GpuReport], *, now: float, stale_after: float
) -> None:
    """A process's GPU report (a registration's or a heartbeat's): what it holds on each GPU,
    from a report that says (an older client sends no process_bytes; kept while it holds
    nothing: paused, it comes back to those GPUs), and its host's GPUs, filed under its token."""
    if not devices:
        return
    held = {report.uuid: report.process_bytes for report in devices if report.process_bytes}
    if held:
        row.gpu_bytes = held
    upsert_devices(
        session=session,
        workspace_id=row.workspace_id,
        host=row.host,
        devices=devices,
        now=now,
        reporter=row.token_id,
        fresh_for=stale_after,
    )


def _set_job(row: Process, job: wire.JobMembership | None) -> None:
    """A registration says the whole of the process's job membership: None clears it."""
    row.job_key = job.key if job else None
    row.job_rank = job.rank if job else None
    row.job_world_size = job.world_size if job else None
    row.job_local_rank = job.local_rank if job else None
    row.job_local_world_size = job.local_world_size if job else None
    row.job_node_rank = job.node_rank if job else None


def process_owner(*, session: Session, workspace_id: int, process_id: str) -> tuple[bool, int | None]:
    """(whether the process exists, the token that registered it)."""
    found = session.execute(
        select(Process.token_id).where(Process.workspace_id == workspace_id, Process.process_id == process_id)
    ).first()
    return (False, None) if found is None else (True, found[0])


def load_snapshots(*, session: Session) -> list[tuple[int, str, ProcessSnapshot]]:
    """Every process, for a server that starts with jobs attached: their next heartbeats and
    polls need no database work."""
    return [(row.workspace_id, row.process_id, ProcessSnapshot.of(row)) for row in session.scalars(select(Process))]


def is_older(seq: int | None, applied: int | None) -> bool:
    """True when a body numbered ``seq`` was built before the last applied one (bodies
    without a number are never older: clients that send none keep working)."""
    return seq is not None and applied is not None and seq < applied


def _shown_placement(row: Process) -> tuple[Any, ...]:
    """What a heartbeat may change that the dashboard shows: the fields it states, and the GPUs
    a process on several holds memory on."""
    return (*(getattr(row, name) for name in _UPDATED), sorted(held_by_gpu(row.gpu_uuid, 0, row.gpu_bytes)))


def heartbeat(
    *,
    session: Session,
    workspace_id: int,
    process_id: str,
    report: wire.HeartbeatRequest,
    now: float,
    stale_after: float,
    write_devices: bool = True,
    reporter: int | None = None,
) -> HeartbeatOutcome:
    """Apply a heartbeat. One older (``seq``) than the last applied body only proves the
    process alive: what it says was true before what the server already knows.

    Plain beats answered from memory (``ServerContext.beat``) do not move ``state_seq``; that
    is safe because they changed nothing, so what they said is what ``state_seq`` stands for.

    The row is read locked: on PostgreSQL a report may commit between an unlocked read and
    this write, and the beat would then write back the state (and ``seq``) it replaced.

    ``reporter``: the token that sent it (None: trusted, a test's or the command line's)."""
    row = find_process(session=session, workspace_id=workspace_id, process_id=process_id, for_update=True)
    if write_devices:
        _check_reporter(row, reporter, report.devices)
    was_stale = is_stale(row, now=now, stale_after=stale_after)
    before = _shown_placement(row)
    # Progress only grows and is not a placement: an older beat's still counts.
    training = trained_between(row.state, report.state)
    Progress.of(row).after(steps=report.steps, loss=report.loss, now=now, training=training).store(row)
    if is_older(report.seq, row.state_seq):
        report = wire.HeartbeatRequest()
    elif report.seq is not None:
        row.state_seq = report.seq
    apply_process_update(row, report)
    _apply_footprint(row, footprint=report.footprint_bytes)
    row.last_seen = now
    devices_written = write_devices and bool(report.devices)
    if devices_written:
        _store_devices(session, row, report.devices, now=now, stale_after=stale_after)
    pending = session.scalar(
        select(Command.id)
        .where(Command.process_pk == row.pk, Command.state.in_(protocol.PENDING_COMMAND_STATES))
        .limit(1)
    )
    changed = None
    if was_stale or before != _shown_placement(row):
        changed = shown_process(
            session=session,
            row=row,
            now=now,
            stale_after=stale_after,
            active=active_command(session=session, process_pk=row.pk),
        )
    return HeartbeatOutcome(
        host=row.host,
        pending_command=pending,
        changed=changed,
        snapshot=ProcessSnapshot.of(row),
        devices_written=devices_written,
    )


def record_beats(*, session: Session, beats: dict[int, float], progress: dict[int, Progress] | None = None) -> int:
    """Write buffered plain heartbeats (process pk -> time) in one statement, and the progress
    they carried (process pk -> progress) in another. Never moves last_seen backwards (a
    heartbeat written directly may be newer)."""
    if progress:
        session.execute(
            _PROGRESS_UPDATE,
            [
                {"b_pk": pk, "b_steps": p.steps, "b_steps_at": p.steps_at, "b_rate": p.steps_per_s, "b_loss": p.loss}
                for pk, p in progress.items()
            ],
        )
    if not beats:
        return 0
    session.execute(_BEAT_UPDATE, [{"b_pk": pk, "b_seen": seen} for pk, seen in beats.items()])
    return len(beats)


_PROCESSES = table_of(Process)
_BEAT_UPDATE = (
    update(_PROCESSES)
    .where(_PROCESSES.c.pk == bindparam("b_pk"), _PROCESSES.c.last_seen < bindparam("b_seen"))
    .values(last_seen=bindparam("b_seen"))
)
# A buffered report never replaces a newer one a heartbeat wrote through meanwhile.
_PROGRESS_UPDATE = (
    update(_PROCESSES)
    .where(
        _PROCESSES.c.pk == bindparam("b_pk"),
        or_(_PROCESSES.c.steps_at.is_(None), _PROCESSES.c.steps_at <= bindparam("b_steps_at")),
    )
    .values(
        steps=bindparam("b_steps"),
        steps_at=bindparam("b_steps_at"),
        steps_per_s=bindparam("b_rate"),
        loss=bindparam("b_loss"),
    )
)


def get_process(
    *, session: Session, workspace_id: int, process_id: str, now: float, stale_after: float
) -> wire.ProcessInfo:
    row = find_process(session=session, workspace_id=workspace_id, process_id=process_id)
    return shown_process(
        session=session,
        row=row,
        now=now,
        stale_after=stale_after,
        active=active_command(session=session, process_pk=row.pk),
    )


def list_processes(
    *,
    session: Session,
    workspace_id: int,
    now: float,
    stale_after: float,
    state: str | None = None,
    host: str | None = None,
    gpu: str | None = None,
    job_key: str | None = None,
    token_ids: Collection[int] | None = None,
) -> list[wire.ProcessInfo]:
    """Every process of the workspace by host, oldest first on each; ``state`` filters on the shown state
    (STALE included), ``gpu`` on the GPU UUID, ``job_key`` on the job's key (its ranks), ``token_ids``
    on the tokens that registered them."""
    query = select(Process).where(Process.workspace_id == workspace_id)
    if token_ids is not None:
        query = query.where(Process.token_id.in_(list(token_ids)))
    if host:
        query = query.where(Process.host == host)
    if gpu:
        query = query.where(Process.gpu_uuid == gpu)
    if job_key is not None:
        query = query.where(Process.job_key == job_key)
    if state == protocol.STALE:
        query = query.where(process_stale(now=now, stale_after=stale_after))
    elif state:
        query = query.where(Process.state == state, process_heard(now=now, stale_after=stale_after))
    rows = list(session.scalars(query.order_by(Process.host, Process.registered_at, Process.pk)))
    active = {
        c.process_pk: c
        for c in session.scalars(
            select(Command).where(
                Command.workspace_id == workspace_id, Command.state.in_(protocol.ACTIVE_COMMAND_STATES)
            )
        )
    }
    return shown_processes(
        session=session, workspace_id=workspace_id, rows=rows, now=now, stale_after=stale_after, active=active
    )


def count_processes(*, session: Session, now: float, stale_after: float) -> dict[str, int]:
    """Shown state -> number of processes, all workspaces (for /metrics)."""
    shown = case((process_stale(now=now, stale_after=stale_after), protocol.STALE), else_=Process.state)
    counts = {state: 0 for state in protocol.DISPLAY_STATES}
    for state, n in session.execute(select(shown, func.count()).group_by(shown)):
        counts[state] = counts.get(state, 0) + n
    return counts
