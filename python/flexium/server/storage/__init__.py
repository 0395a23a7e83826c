"""Storage functions: the only code that reads or writes tables.

Every function takes keyword arguments only, starting with ``session`` (one open
transaction, from ``Database.session`` / ``Database.run`` / ``Database.call``), and the
caller's clock as ``now`` so tests can move time. Processes, commands, devices, the workspace
summary and tokens come back as ``flexium.wire`` models built from the rows, which routes send
as they are and dashboard templates render (a workspace without its counts, which only the
admin commands read, as a ``WorkspaceRecord``), and they raise
``flexium.server.errors.ApiError`` subclasses for anything a user did wrong.
"""

from flexium.server.storage.audit import (
    Refusal,
    command_senders,
    list_audit,
    record_command_refused,
    record_commands_finished,
    record_refusals,
    refused_commands,
)
from flexium.server.storage.commands import (
    count_commands,
    count_finished,
    create_commands,
    create_commands_audited,
    get_command,
    list_commands,
    next_command,
    peek_command,
    pending_commands,
    report_command,
    report_command_audited,
    undo_delivery,
)
from flexium.server.storage.devices import device_indexes, list_devices, upsert_devices
from flexium.server.storage.drains import drained_gpus, get_drain, list_drains
from flexium.server.storage.forget import unregister_process
from flexium.server.storage.history import HISTORY_EVERY_S, Sample, gpu_history, prune_history
from flexium.server.storage.jobs import get_operation, list_jobs, summarize_jobs
from flexium.server.storage.placements import close_placement, get_placement, list_placements, take_placement
from flexium.server.storage.priorities import set_priority
from flexium.server.storage.processes import (
    HeartbeatOutcome,
    ProcessSnapshot,
    Progress,
    count_processes,
    get_process,
    heartbeat,
    list_processes,
    load_snapshots,
    process_owner,
    record_beats,
    register_process,
    register_process_snapshot,
)
from flexium.server.storage.progress_history import (
    PROGRESS_EVERY_S,
    ProgressPoint,
    progress_history,
    prune_progress,
    sample_progress,
)
from flexium.server.storage.retention import Retention, retention_of
from flexium.server.storage.series import WorkspaceSeries, workspace_series
from flexium.server.storage.sessions import (
    LOGIN_CODE_TTL_S,
    SESSION_IDLE_S,
    SESSION_MAX_S,
    end_session,
    issue_login_code,
    login_code_as,
    login_code_for,
    open_session,
    redeem_login_code,
    session_auth,
    touch_session,
)
from flexium.server.storage.sweep import SweepResult, sweep
from flexium.server.storage.targets import judge_targets, resolve_target, target_refusal
from flexium.server.storage.waits import QueueView, cancel_wait, get_wait, list_waits, queue_view, wait_of_command
from flexium.server.storage.workspaces import (
    AuthInfo,
    WorkspaceRecord,
    authenticate,
    create_workspace,
    ensure_default_workspace,
    get_workspace,
    hash_token,
    issue_token,
    list_tokens,
    list_workspaces,
    new_token,
    revoke_token,
    revoked_since,
    workspace_summary,
)

__all__ = [
    "close_placement",
    "get_placement",
    "list_placements",
    "take_placement",
    "QueueView",
    "cancel_wait",
    "get_wait",
    "list_waits",
    "drained_gpus",
    "get_drain",
    "list_drains",
    "queue_view",
    "set_priority",
    "wait_of_command",
    "WorkspaceSeries",
    "workspace_series",
    "HISTORY_EVERY_S",
    "Sample",
    "gpu_history",
    "prune_history",
    "PROGRESS_EVERY_S",
    "ProgressPoint",
    "progress_history",
    "prune_progress",
    "sample_progress",
    "Retention",
    "retention_of",
    "Refusal",
    "record_refusals",
    "LOGIN_CODE_TTL_S",
    "SESSION_IDLE_S",
    "SESSION_MAX_S",
    "AuthInfo",
    "command_senders",
    "create_commands_audited",
    "end_session",
    "issue_login_code",
    "login_code_as",
    "login_code_for",
    "list_audit",
    "open_session",
    "process_owner",
    "record_command_refused",
    "record_commands_finished",
    "redeem_login_code",
    "refused_commands",
    "report_command_audited",
    "session_auth",
    "touch_session",
    "HeartbeatOutcome",
    "ProcessSnapshot",
    "Progress",
    "SweepResult",
    "WorkspaceRecord",
    "authenticate",
    "count_commands",
    "count_finished",
    "device_indexes",
    "resolve_target",
    "target_refusal",
    "count_processes",
    "create_commands",
    "create_workspace",
    "ensure_default_workspace",
    "get_command",
    "get_operation",
    "get_process",
    "get_workspace",
    "hash_token",
    "heartbeat",
    "issue_token",
    "judge_targets",
    "list_commands",
    "list_devices",
    "list_jobs",
    "list_processes",
    "list_tokens",
    "list_workspaces",
    "new_token",
    "next_command",
    "peek_command",
    "load_snapshots",
    "pending_commands",
    "record_beats",
    "register_process",
    "register_process_snapshot",
    "report_command",
    "revoke_token",
    "revoked_since",
    "summarize_jobs",
    "sweep",
    "undo_delivery",
    "unregister_process",
    "upsert_devices",
    "workspace_summary",
]
