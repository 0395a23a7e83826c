"""Tables. The schema itself is created and changed only by the migrations in
``migrations/versions``; these classes must match them (a test compares the two).

Times are Unix epoch seconds in double precision columns: the same on SQLite and PostgreSQL,
no time zone handling, and what the wire format uses.
"""

from __future__ import annotations

from typing import Any, cast

from sqlalchemy import JSON, BigInteger, Double, ForeignKey, Index, Integer, String, Table, Text, UniqueConstraint, text
from sqlalchemy.dialects.postgresql import JSONB
from sqlalchemy.orm import DeclarativeBase, Mapped, mapped_column

from flexium import protocol

JsonType = JSON().with_variant(JSONB(), "postgresql")

# One active command per process, enforced by the database so two racing requests cannot
# both pass the check.
ACTIVE_SQL = "state IN ('queued', 'delivered', 'running')"
# One live wait per process (a job's wait is its lowest rank's): two racing requests cannot queue
# one job twice.
LIVE_WAIT_SQL = "state IN ('waiting', 'dispatched')"
# One live drain of a GPU (or of a whole host).
LIVE_DRAIN_SQL = "ended_at IS NULL"


class Base(DeclarativeBase):
    pass


class Workspace(Base):
    __tablename__ = "workspaces"
    __table_args__ = (UniqueConstraint("name", name="uq_workspaces_name"),)
    id: Mapped[int] = mapped_column(Integer, primary_key=True)
    name: Mapped[str] = mapped_column(String(64))
    created_at: Mapped[float] = mapped_column(Double)


class Token(Base):
    __tablename__ = "tokens"
    __table_args__ = (UniqueConstraint("token_hash", name="uq_tokens_token_hash"),)
    id: Mapped[int] = mapped_column(Integer, primary_key=True)
    workspace_id: Mapped[int] = mapped_column(ForeignKey("workspaces.id", ondelete="CASCADE"), index=True)
    name: Mapped[str] = mapped_column(String(protocol.MAX_SHORT_TEXT), default="")
    token_hash: Mapped[str] = mapped_column(String(64))  # sha256 hex of the token
    prefix: Mapped[str] = mapped_column(String(16))  # shown in lists
    created_at: Mapped[float] = mapped_column(Double)
    revoked_at: Mapped[float | None] = mapped_column(Double, nullable=True)
    # None: valid until revoked; else refused from then on (``storage.token_alive``), as if revoked.
    expires_at: Mapped[float | None] = mapped_column(Double, nullable=True)
    # When a request last came with it, as its servers write it: at most once a TOKEN_USE_WRITTEN_EVERY_S
    # each (ServerContext.flush_token_use). None: none since flexium recorded it.
    last_used_at: Mapped[float | None] = mapped_column(Double, nullable=True)
    # protocol.TOKEN_ROLES; tokens made before roles existed could do everything, so they are admin.
    role: Mapped[str] = mapped_column(String(16), server_default=protocol.ROLE_ADMIN)
    # The token that issued this one (None: the command line, or the workspace's first):
    # revoking a token revokes what it minted, and theirs. No foreign key: tokens are revoked,
    # never deleted (but with their workspace), and SQLite could add one only by copying the table.
    minted_by: Mapped[int | None] = mapped_column(Integer, nullable=True, index=True)


class DashboardSession(Base):
    """A dashboard login: the browser holds the id (its hash is kept), the token it was
    opened with decides what it may do, and revoking that token ends it."""

    __tablename__ = "dashboard_sessions"
    __table_args__ = (UniqueConstraint("session_hash", name="uq_dashboard_sessions_hash"),)
    id: Mapped[int] = mapped_column(Integer, primary_key=True)
    token_id: Mapped[int] = mapped_column(ForeignKey("tokens.id", ondelete="CASCADE"), index=True)
    session_hash: Mapped[str] = mapped_column(String(64))
    created_at: Mapped[float] = mapped_column(Double)
    last_used: Mapped[float] = mapped_column(Double)


class LoginCode(Base):
    """A one-time code for a login link: exchanged once, within minutes, for a session of its
    token (the link carries the code, never the token)."""

    __tablename__ = "login_codes"
    __table_args__ = (UniqueConstraint("code_hash", name="uq_login_codes_hash"),)
    id: Mapped[int] = mapped_column(Integer, primary_key=True)
    token_id: Mapped[int] = mapped_column(ForeignKey("tokens.id", ondelete="CASCADE"), index=True)
    code_hash: Mapped[str] = mapped_column(String(64))
    expires_at: Mapped[float] = mapped_column(Double)


class AuditRecord(Base):
    """One entry of a workspace's audit log (wire.AuditEntry). Who is copied in (token name
    and role), so an entry still says who after its token is gone. An entry about a command
    names its process and command, so a job's page reads its own entries."""

    __tablename__ = "audit_log"
    __table_args__ = (
        Index("ix_audit_log_workspace_id", "workspace_id", "id"),
        Index("ix_audit_log_process", "workspace_id", "process_id", "id"),
        Index("ix_audit_log_kept_until", "workspace_id", "kept_until"),
        Index("ix_audit_log_repeated", "workspace_id", "action", "token_id", "id"),
    )
    id: Mapped[int] = mapped_column(Integer, primary_key=True)
    workspace_id: Mapped[int] = mapped_column(ForeignKey("workspaces.id", ondelete="CASCADE"))
    at: Mapped[float] = mapped_column(Double)
    token_id: Mapped[int | None] = mapped_column(Integer, nullable=True)  # no FK: entries outlive tokens
    token_name: Mapped[str] = mapped_column(String(protocol.MAX_SHORT_TEXT), default="")
    role: Mapped[str] = mapped_column(String(16), default="")
    action: Mapped[str] = mapped_column(String(32))
    target: Mapped[str] = mapped_column(String(protocol.MAX_SHORT_TEXT), default="")
    outcome: Mapped[str] = mapped_column(String(32), default="")
    detail: Mapped[str] = mapped_column(Text, default="")
    # No foreign keys: entries outlive their process and command.
    process_id: Mapped[str | None] = mapped_column(String(protocol.MAX_SHORT_TEXT), nullable=True)
    command_id: Mapped[int | None] = mapped_column(Integer, nullable=True)
    door: Mapped[str | None] = mapped_column(String(16), nullable=True)  # protocol.DOORS; None: no request's
    # The same thing again within the hour (a login, a refusal) counts here instead of taking a row.
    repeats: Mapped[int] = mapped_column(Integer, default=1, server_default="1")
    last_at: Mapped[float | None] = mapped_column(Double, nullable=True)  # the last repeat's time
    kept_until: Mapped[float] = mapped_column(Double, server_default="0")  # by its class (storage/audit.py)


class Process(Base):
    __tablename__ = "processes"
    __table_args__ = (
        UniqueConstraint("workspace_id", "process_id", name="uq_processes_workspace_process"),
        Index("ix_processes_workspace_last_seen", "workspace_id", "last_seen"),
        Index("ix_processes_workspace_job", "workspace_id", "job_key"),
    )
    pk: Mapped[int] = mapped_column(Integer, primary_key=True)
    workspace_id: Mapped[int] = mapped_column(ForeignKey("workspaces.id", ondelete="CASCADE"))
    process_id: Mapped[str] = mapped_column(String(protocol.MAX_SHORT_TEXT))
    host: Mapped[str] = mapped_column(String(protocol.MAX_HOST_LEN))
    user: Mapped[str] = mapped_column(String(protocol.MAX_SHORT_TEXT), default="")
    pid: Mapped[int] = mapped_column(BigInteger, default=0)
    # Where it is (or paused from): the one stored fact of its location. Its nvidia-smi index
    # and its cuda:N are derived when shown (wire.ProcessInfo), from the host's device reports
    # and from visible_gpus, the job's GPU UUIDs in CUDA ordinal order.
    gpu_uuid: Mapped[str | None] = mapped_column(String(protocol.MAX_SHORT_TEXT), nullable=True)
    gpu_model: Mapped[str] = mapped_column(String(protocol.MAX_SHORT_TEXT), default="")
    logical_device: Mapped[str] = mapped_column(String(protocol.MAX_SHORT_TEXT), default="")
    visible_gpus: Mapped[Any] = mapped_column(JsonType, default=list)
    torch_version: Mapped[str] = mapped_column(String(protocol.MAX_SHORT_TEXT), default="")
    driver_version: Mapped[str] = mapped_column(String(protocol.MAX_SHORT_TEXT), default="")
    flexium_version: Mapped[str] = mapped_column(String(protocol.MAX_SHORT_TEXT), default="")
    capabilities: Mapped[Any] = mapped_column(JsonType, default=dict)
    memory_bytes: Mapped[int] = mapped_column(BigInteger, default=0)
    # What it held on each GPU (UUID -> bytes) when it last held anything, from its device
    # reports: a process may use several GPUs. None from a client that does not say.
    gpu_bytes: Mapped[Any | None] = mapped_column(JsonType, nullable=True)
    footprint_bytes: Mapped[int] = mapped_column(BigInteger, default=0)
    state: Mapped[str] = mapped_column(String(16))
    started_at: Mapped[float | None] = mapped_column(Double, nullable=True)
    registered_at: Mapped[float] = mapped_column(Double)
    last_seen: Mapped[float] = mapped_column(Double)
    cmdline: Mapped[str] = mapped_column(Text, default="")
    # The ``seq`` of the last body whose state was applied: an older heartbeat (built before
    # a command's final report, delivered after it) must not undo that report.
    state_seq: Mapped[int | None] = mapped_column(BigInteger, nullable=True)
    # Its place in a multi-process job (wire.JobMembership), None for a single-process job:
    # the ranks of one run share job_key, and are shown and moved together.
    job_key: Mapped[str | None] = mapped_column(String(protocol.MAX_SHORT_TEXT), nullable=True)
    job_rank: Mapped[int | None] = mapped_column(Integer, nullable=True)
    job_world_size: Mapped[int | None] = mapped_column(Integer, nullable=True)
    job_local_rank: Mapped[int | None] = mapped_column(Integer, nullable=True)
    job_local_world_size: Mapped[int | None] = mapped_column(Integer, nullable=True)
    job_node_rank: Mapped[int | None] = mapped_column(Integer, nullable=True)
    # The token that registered it: a job token acts only on the processes it registered.
    # No foreign key, as for Token.minted_by.
    token_id: Mapped[int | None] = mapped_column(Integer, nullable=True)
    # Training progress as the process last reported it (None: it never did): steps_per_s is
    # derived from the two last reports of steps, so the dashboard needs no history for it.
    steps: Mapped[int | None] = mapped_column(BigInteger, nullable=True)
    steps_at: Mapped[float | None] = mapped_column(Double, nullable=True)
    steps_per_s: Mapped[float | None] = mapped_column(Double, nullable=True)
    loss: Mapped[float | None] = mapped_column(Double, nullable=True)
    # protocol.PRIORITIES: the queue resumes a higher one first; making room pauses only lower ones.
    priority: Mapped[int] = mapped_column(Integer, server_default=str(protocol.DEFAULT_PRIORITY))


class Device(Base):
    __tablename__ = "devices"
    __table_args__ = (UniqueConstraint("workspace_id", "host", "uuid", name="uq_devices_workspace_host_uuid"),)
    id: Mapped[int] = mapped_column(Integer, primary_key=True)
    workspace_id: Mapped[int] = mapped_column(ForeignKey("workspaces.id", ondelete="CASCADE"))
    host: Mapped[str] = mapped_column(String(protocol.MAX_HOST_LEN))
    uuid: Mapped[str] = mapped_column(String(protocol.MAX_SHORT_TEXT))
    index: Mapped[int | None] = mapped_column(Integer, nullable=True)
    name: Mapped[str] = mapped_column(String(protocol.MAX_SHORT_TEXT), default="")
    memory_total: Mapped[int] = mapped_column(BigInteger, default=0)
    memory_used: Mapped[int] = mapped_column(BigInteger, default=0)
    utilization: Mapped[int | None] = mapped_column(Integer, nullable=True)
    temperature: Mapped[int | None] = mapped_column(Integer, nullable=True)
    health: Mapped[str] = mapped_column(String(protocol.MAX_SHORT_TEXT), default="ok")
    updated_at: Mapped[float] = mapped_column(Double)
    # The token whose report this is (None: one without a token's process, flexium run's); no
    # foreign key, as Token.minted_by.
    reported_by: Mapped[int | None] = mapped_column(Integer, nullable=True)


class GpuSample(Base):
    """One GPU's memory and utilization at one time, at most one a minute per GPU, kept for
    ``storage.Retention.history_keep_s`` (the sweep prunes older ones): the dashboard's history charts."""

    __tablename__ = "gpu_samples"
    __table_args__ = (
        Index("ix_gpu_samples_gpu_at", "workspace_id", "host", "uuid", "at"),
        Index("ix_gpu_samples_at", "at"),
    )
    id: Mapped[int] = mapped_column(Integer, primary_key=True)
    workspace_id: Mapped[int] = mapped_column(ForeignKey("workspaces.id", ondelete="CASCADE"))
    host: Mapped[str] = mapped_column(String(protocol.MAX_HOST_LEN))
    uuid: Mapped[str] = mapped_column(String(protocol.MAX_SHORT_TEXT))
    at: Mapped[float] = mapped_column(Double)
    memory_used: Mapped[int] = mapped_column(BigInteger)
    memory_total: Mapped[int] = mapped_column(BigInteger)
    utilization: Mapped[int | None] = mapped_column(Integer, nullable=True)


class ProgressSample(Base):
    """One process's training progress at one time, at most one every
    ``storage.PROGRESS_EVERY_S`` per process, kept ``storage.Retention.progress_keep_s`` and no longer
    than its process: the job page's curves. (A migration that copies processes on SQLite loses
    them, as it would lose commands: a chart's history, nothing more.)"""

    __tablename__ = "progress_samples"
    __table_args__ = (
        Index("ix_progress_samples_process_at", "process_pk", "at"),
        Index("ix_progress_samples_at", "at"),
    )
    id: Mapped[int] = mapped_column(Integer, primary_key=True)
    process_pk: Mapped[int] = mapped_column(ForeignKey("processes.pk", ondelete="CASCADE"))
    at: Mapped[float] = mapped_column(Double)
    steps: Mapped[int | None] = mapped_column(BigInteger, nullable=True)
    steps_per_s: Mapped[float | None] = mapped_column(Double, nullable=True)
    loss: Mapped[float | None] = mapped_column(Double, nullable=True)


class JobOperation(Base):
    """One pause, resume or migrate of a whole multi-process job; its commands (one per rank)
    point to it."""

    __tablename__ = "job_operations"
    __table_args__ = (
        Index("ix_job_operations_workspace_job", "workspace_id", "job_key"),
        {"sqlite_autoincrement": True},
    )
    id: Mapped[int] = mapped_column(Integer, primary_key=True)
    workspace_id: Mapped[int] = mapped_column(ForeignKey("workspaces.id", ondelete="CASCADE"))
    job_key: Mapped[str] = mapped_column(String(protocol.MAX_SHORT_TEXT))
    kind: Mapped[str] = mapped_column(String(16))
    world_size: Mapped[int] = mapped_column(Integer)
    moves: Mapped[Any] = mapped_column(JsonType, default=dict)  # rank (text) -> target GPU UUID
    created_at: Mapped[float] = mapped_column(Double)


class Command(Base):
    __tablename__ = "commands"
    __table_args__ = (
        Index("ix_commands_process_state", "process_pk", "state"),
        Index("ix_commands_workspace_id", "workspace_id", "id"),
        Index("ix_commands_state_created", "state", "created_at"),
        Index(
            "uq_commands_one_active",
            "process_pk",
            unique=True,
            sqlite_where=text(ACTIVE_SQL),
            postgresql_where=text(ACTIVE_SQL),
        ),
        {"sqlite_autoincrement": True},  # ids never reused: clients know repeats by id
    )
    id: Mapped[int] = mapped_column(Integer, primary_key=True)
    workspace_id: Mapped[int] = mapped_column(ForeignKey("workspaces.id", ondelete="CASCADE"))
    process_pk: Mapped[int] = mapped_column(ForeignKey("processes.pk", ondelete="CASCADE"))
    kind: Mapped[str] = mapped_column(String(16))
    state: Mapped[str] = mapped_column(String(16))
    # The GPU the server resolved the target to; its index and the job's cuda:N are derived
    # when shown (an index is the host's, an ordinal the job's: neither names the GPU).
    target_uuid: Mapped[str | None] = mapped_column(String(protocol.MAX_SHORT_TEXT), nullable=True)
    # A migrate GPU by GPU (one process on several GPUs): GPU UUID now -> GPU UUID after.
    gpu_moves: Mapped[Any | None] = mapped_column(JsonType, nullable=True)
    created_at: Mapped[float] = mapped_column(Double)
    delivered_at: Mapped[float | None] = mapped_column(Double, nullable=True)
    started_at: Mapped[float | None] = mapped_column(Double, nullable=True)
    finished_at: Mapped[float | None] = mapped_column(Double, nullable=True)
    deliveries: Mapped[int] = mapped_column(Integer, default=0)
    result: Mapped[Any | None] = mapped_column(JsonType, nullable=True)
    error: Mapped[str | None] = mapped_column(Text, nullable=True)
    # A rank's share of a job operation: ``operation_id`` finds the operation's commands, and
    # ``job`` is what the rank is handed (wire.JobCommandInfo), kept whole in the row so every
    # reader of a command (the long-poll's single statement included) shows it without a join.
    operation_id: Mapped[int | None] = mapped_column(
        ForeignKey("job_operations.id", ondelete="CASCADE", name="fk_commands_operation_id"), nullable=True, index=True
    )
    job: Mapped[Any | None] = mapped_column(JsonType, nullable=True)
    # Why it was sent: its sender's reason, or a policy's (the job's timeline shows it).
    reason: Mapped[str | None] = mapped_column(Text, nullable=True)
    # Who sent it: the token's name then (or the policy's), and its door (protocol.DOORS); None
    # for the commands stored before 0013.
    sent_by: Mapped[str | None] = mapped_column(String(protocol.MAX_SHORT_TEXT), nullable=True)
    door: Mapped[str | None] = mapped_column(String(16), nullable=True)


class Wait(Base):
    """A paused job in the resume-when-free queue (``server/policies/resume_when_free.py``), its
    process (a job of several ranks: its lowest rank) and what it waits for; the queue turns it into
    an ordinary resume command when its host has room."""

    __tablename__ = "waits"
    __table_args__ = (
        Index("ix_waits_queue", "workspace_id", "host", "state"),
        Index(
            "uq_waits_one_live",
            "process_pk",
            unique=True,
            sqlite_where=text(LIVE_WAIT_SQL),
            postgresql_where=text(LIVE_WAIT_SQL),
        ),
        {"sqlite_autoincrement": True},
    )
    id: Mapped[int] = mapped_column(Integer, primary_key=True)
    workspace_id: Mapped[int] = mapped_column(ForeignKey("workspaces.id", ondelete="CASCADE"))
    process_pk: Mapped[int] = mapped_column(ForeignKey("processes.pk", ondelete="CASCADE"), index=True)
    job_key: Mapped[str | None] = mapped_column(String(protocol.MAX_SHORT_TEXT), nullable=True)
    host: Mapped[str] = mapped_column(String(protocol.MAX_HOST_LEN))
    gpu_uuid: Mapped[str | None] = mapped_column(String(protocol.MAX_SHORT_TEXT), nullable=True)  # None: any
    priority: Mapped[int] = mapped_column(Integer)
    state: Mapped[str] = mapped_column(String(16))  # protocol.WAIT_STATES
    created_at: Mapped[float] = mapped_column(Double)
    finished_at: Mapped[float | None] = mapped_column(Double, nullable=True)
    # The resume it dispatched last (no foreign key: the command may be forgotten first).
    command_id: Mapped[int | None] = mapped_column(Integer, nullable=True)
    dispatches: Mapped[int] = mapped_column(Integer, default=0)
    # When the job last refused a resume it dispatched: only GPU reports newer than this count.
    refused_at: Mapped[float | None] = mapped_column(Double, nullable=True)
    requested_by: Mapped[str] = mapped_column(String(protocol.MAX_SHORT_TEXT), default="")
    token_id: Mapped[int | None] = mapped_column(Integer, nullable=True)  # no FK, as for AuditRecord
    reason: Mapped[str] = mapped_column(Text, default="")
    why: Mapped[str | None] = mapped_column(Text, nullable=True)  # the reason its requester gave
    note: Mapped[str | None] = mapped_column(Text, nullable=True)


class Reservation(Base):
    """Room held on a GPU for one job until it resumes there (``policies/make_room.py``): the
    queue counts it as taken for every other wait."""

    __tablename__ = "reservations"
    __table_args__ = (Index("ix_reservations_gpu", "workspace_id", "host", "gpu_uuid"),)
    id: Mapped[int] = mapped_column(Integer, primary_key=True)
    workspace_id: Mapped[int] = mapped_column(ForeignKey("workspaces.id", ondelete="CASCADE"))
    host: Mapped[str] = mapped_column(String(protocol.MAX_HOST_LEN))
    gpu_uuid: Mapped[str] = mapped_column(String(protocol.MAX_SHORT_TEXT))
    bytes: Mapped[int] = mapped_column(BigInteger)
    # Who it is for: a wait (a paused job), or only named (a job not started yet: ``holder``).
    wait_id: Mapped[int | None] = mapped_column(ForeignKey("waits.id", ondelete="CASCADE"), nullable=True, index=True)
    holder: Mapped[str] = mapped_column(String(protocol.MAX_SHORT_TEXT), default="")
    created_at: Mapped[float] = mapped_column(Double)
    expires_at: Mapped[float] = mapped_column(Double)


class Drain(Base):
    """A GPU (or every GPU of a host: ``gpu_uuid`` "") taken out of use by an admin
    (``policies/drain.py``): its jobs are moved off, and nothing is placed, resumed or migrated there
    until it is undrained (``ended_at``)."""

    __tablename__ = "drains"
    __table_args__ = (
        Index(
            "uq_drains_one_live",
            "workspace_id",
            "host",
            "gpu_uuid",
            unique=True,
            sqlite_where=text(LIVE_DRAIN_SQL),
            postgresql_where=text(LIVE_DRAIN_SQL),
        ),
        {"sqlite_autoincrement": True},
    )
    id: Mapped[int] = mapped_column(Integer, primary_key=True)
    workspace_id: Mapped[int] = mapped_column(ForeignKey("workspaces.id", ondelete="CASCADE"))
    host: Mapped[str] = mapped_column(String(protocol.MAX_HOST_LEN))
    gpu_uuid: Mapped[str] = mapped_column(String(protocol.MAX_SHORT_TEXT))  # "": every GPU of the host
    gpu_index: Mapped[int | None] = mapped_column(Integer, nullable=True)  # as it was named, for people
    created_at: Mapped[float] = mapped_column(Double)
    ended_at: Mapped[float | None] = mapped_column(Double, nullable=True)
    requested_by: Mapped[str] = mapped_column(String(protocol.MAX_SHORT_TEXT), default="")
    token_id: Mapped[int | None] = mapped_column(Integer, nullable=True)  # no FK, as for AuditRecord
    ended_by: Mapped[str | None] = mapped_column(String(protocol.MAX_SHORT_TEXT), nullable=True)
    reason: Mapped[str] = mapped_column(Text, default="")


class DrainMove(Base):
    """What a drain did to one job on its GPUs: a migrate, a pause (queued to resume when free), or
    nothing, with why (``note``); the command's own row tells how it went."""

    __tablename__ = "drain_moves"
    id: Mapped[int] = mapped_column(Integer, primary_key=True)
    drain_id: Mapped[int] = mapped_column(ForeignKey("drains.id", ondelete="CASCADE"), index=True)
    # The job as it was named (no FK: the drain's record outlives a forgotten process).
    process_pk: Mapped[int] = mapped_column(Integer)
    process_id: Mapped[str] = mapped_column(String(protocol.MAX_SHORT_TEXT))
    job_key: Mapped[str | None] = mapped_column(String(protocol.MAX_SHORT_TEXT), nullable=True)
    action: Mapped[str] = mapped_column(String(16))  # protocol.DRAIN_ACTIONS
    command_id: Mapped[int | None] = mapped_column(Integer, nullable=True)  # no FK, as Wait.command_id
    target_uuid: Mapped[str | None] = mapped_column(String(protocol.MAX_SHORT_TEXT), nullable=True)
    created_at: Mapped[float] = mapped_column(Double)
    note: Mapped[str] = mapped_column(Text, default="")


class Placement(Base):
    """A job ``flexium run`` starts once its host has room (``server/policies/placement.py``): the
    GPU it asks for (None: the one with the most room) and the room it needs; placed, its room is
    held (``reservation_id``) until the job registers and takes it."""

    __tablename__ = "placements"
    __table_args__ = (Index("ix_placements_queue", "workspace_id", "host", "state"), {"sqlite_autoincrement": True})
    id: Mapped[int] = mapped_column(Integer, primary_key=True)
    workspace_id: Mapped[int] = mapped_column(ForeignKey("workspaces.id", ondelete="CASCADE"))
    host: Mapped[str] = mapped_column(String(protocol.MAX_HOST_LEN))
    gpu_uuid: Mapped[str | None] = mapped_column(String(protocol.MAX_SHORT_TEXT), nullable=True)  # None: auto
    need_bytes: Mapped[int] = mapped_column(BigInteger)
    priority: Mapped[int] = mapped_column(Integer)
    state: Mapped[str] = mapped_column(String(16))  # protocol.PLACEMENT_STATES
    created_at: Mapped[float] = mapped_column(Double)
    # When its flexium run last asked: one that stopped asking waits no more.
    asked_at: Mapped[float] = mapped_column(Double)
    placed_at: Mapped[float | None] = mapped_column(Double, nullable=True)
    finished_at: Mapped[float | None] = mapped_column(Double, nullable=True)
    placed_uuid: Mapped[str | None] = mapped_column(String(protocol.MAX_SHORT_TEXT), nullable=True)
    # No foreign key: a reservation expires by itself (the sweep drops it).
    reservation_id: Mapped[int | None] = mapped_column(Integer, nullable=True)
    process_id: Mapped[str | None] = mapped_column(String(protocol.MAX_SHORT_TEXT), nullable=True)
    requested_by: Mapped[str] = mapped_column(String(protocol.MAX_SHORT_TEXT))
    token_id: Mapped[int | None] = mapped_column(Integer, nullable=True)
    command: Mapped[str] = mapped_column(Text)
    note: Mapped[str | None] = mapped_column(Text, nullable=True)
    why: Mapped[str | None] = mapped_column(Text, nullable=True)  # the reason its requester gave


def table_of(model: type[Base]) -> Table:
    """A model's Core table, typed as one (``__table__`` is typed as any FROM clause), for
    the statements written in Core: bulk updates, upserts, single-statement deliveries."""
    return cast(Table, model.__table__)
