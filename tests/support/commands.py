"""A command as the server answers it (``wire.CommandInfo``), not yet under way, for tests of the
command line that stand in for the server."""

from __future__ import annotations

from flexium import wire


def command_info(command_id: int, kind: str, process_id: str, state: str = "queued") -> wire.CommandInfo:
    return wire.CommandInfo(
        id=command_id,
        kind=kind,  # type: ignore[arg-type]
        process_id=process_id,
        state=state,  # type: ignore[arg-type]
        target_uuid=None,
        created_at=0.0,
        delivered_at=None,
        started_at=None,
        finished_at=None,
        deliveries=0,
        result=None,
        error=None,
    )
