"""Rows -> wire models (what the API returns and templates render)."""

from __future__ import annotations

import logging
from collections.abc import Mapping

from pydantic import ValidationError

from flexium import protocol, wire
from flexium.server.models import Command, Process
from flexium.server.storage.devices import held_by_gpu
from flexium.server.storage.staleness import is_stale

log = logging.getLogger("flexium.server")


def stored_result(row: Command) -> wire.OperationReport | None:
    """The command's result as stored. A row from an older server kept what its client sent,
    any keys: they read through the model's leniency, and one that does not read at all is
    shown as no result rather than failing every page that lists the command."""
    if row.result is None:
        return None
    try:
        return wire.OperationReport.model_validate(row.result)
    except ValidationError as exc:
        log.warning("command %s: its stored result does not read, shown as none: %s", row.id, exc.errors()[0]["msg"])
        return None


def stored_capabilities(row: Process) -> wire.ProcessCapabilities:
    """The process's capabilities as stored, read as ``stored_result`` reads a result; one that
    does not read at all counts as none (the process cannot be moved until it registers again)."""
    try:
        return wire.ProcessCapabilities.model_validate(row.capabilities or {})
    except ValidationError as exc:
        log.warning(
            "process %s: its stored capabilities do not read, taken as none: %s", row.process_id, exc.errors()[0]["msg"]
        )
        return wire.ProcessCapabilities()


def command_view(row: Command, process_id: str) -> wire.CommandInfo:
    return wire.CommandInfo.model_validate(
        {
            "id": row.id,
            "kind": row.kind,
            "process_id": process_id,
            "state": row.state,
            "target_uuid": row.target_uuid,
            "gpu_moves": row.gpu_moves,
            "created_at": row.created_at,
            "delivered_at": row.delivered_at,
            "started_at": row.started_at,
            "finished_at": row.finished_at,
            "deliveries": row.deliveries,
            "result": stored_result(row),
            "error": row.error,
            "job": row.job,
            "reason": row.reason,
            "sent_by": row.sent_by,
            "door": row.door,
        }
    )


def process_view(
    row: Process,
    *,
    now: float,
    stale_after: float,
    gpu_indexes: Mapping[str, int | None],
    active: Command | None = None,
    wait_id: int | None = None,
    token_end: protocol.TokenEnd | None,
) -> wire.ProcessInfo:
    """``gpu_indexes``: GPU UUID -> nvidia-smi index from the device reports (``device_indexes``);
    ``wait_id``: its live wait in the queue (its job's, for a rank of a job of several);
    ``token_end``: why the token it registered with no longer opens doors, or None (``ended_owners``).
    The row holds one fact of where the process is, ``gpu_uuid``; how it is shown comes from it."""
    stale = is_stale(row, now=now, stale_after=stale_after)
    visible = list(row.visible_gpus or [])
    return wire.ProcessInfo.model_validate(
        {
            "process_id": row.process_id,
            "host": row.host,
            "user": row.user,
            "pid": row.pid,
            "state": protocol.STALE if stale else row.state,
            "reported_state": row.state,
            "stale": stale,
            "gpu_uuid": row.gpu_uuid,
            "gpu_model": row.gpu_model,
            "gpu_index": gpu_indexes.get(row.gpu_uuid) if row.gpu_uuid is not None else None,
            "other_gpus": [u for u in held_by_gpu(row.gpu_uuid, row.memory_bytes, row.gpu_bytes) if u != row.gpu_uuid],
            "logical_device": row.logical_device,
            # No ordinal: the process has no engine (no GPU UUID), so what it trains on is its word.
            "physical_device": wire.cuda_ordinal(visible, row.gpu_uuid) or row.logical_device,
            "visible_gpus": visible,
            "torch_version": row.torch_version,
            "driver_version": row.driver_version,
            "flexium_version": row.flexium_version,
            "capabilities": stored_capabilities(row),
            "memory_bytes": row.memory_bytes,
            "footprint_bytes": row.footprint_bytes,
            "started_at": row.started_at,
            "registered_at": row.registered_at,
            "last_seen": row.last_seen,
            "cmdline": row.cmdline,
            "name": wire.job_name(row.cmdline),
            "active_command": command_view(active, row.process_id) if active is not None else None,
            "job": job_view(row),
            "steps": row.steps,
            "steps_per_s": row.steps_per_s,
            "steps_at": row.steps_at,
            "loss": row.loss,
            "priority": row.priority,
            "wait_id": wait_id,
            "token_revoked": token_end == "revoked",
            "token_expired": token_end == "expired",
        }
    )


def job_view(row: Process) -> wire.JobInfo | None:
    if row.job_key is None or row.job_rank is None or row.job_world_size is None:
        return None
    return wire.JobInfo(
        key=row.job_key,
        rank=row.job_rank,
        world_size=row.job_world_size,
        local_rank=row.job_local_rank,
        local_world_size=row.job_local_world_size,
        node_rank=row.job_node_rank,
    )
