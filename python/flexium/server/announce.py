"""What a committed change to commands and placements tells beside the database, on this server and
every replica (``ServerContext.publish`` and ``Notifier.notify`` forward it): the dashboards' live
events, the long-polls woken, the pending-command hint heartbeats answer with, the command metrics.
Each is called once the transaction that made the change has committed, never before: a long-poll
woken earlier would read the database without the change and wait its full time."""

from __future__ import annotations

from collections.abc import Iterable

from flexium import protocol, wire
from flexium.server.context import ServerContext


def commands_created(ctx: ServerContext, workspace_id: int, commands: Iterable[wire.CommandInfo]) -> None:
    """Their processes' long-polls woken, dashboards told."""
    for command in commands:
        ctx.command_pending(workspace_id, command.process_id, command.id)
        ctx.notifier.notify((workspace_id, command.process_id))
        ctx.metrics.commands_created.labels(kind=command.kind).inc()
        ctx.publish(workspace_id, protocol.EVENT_COMMAND, {"action": "created", "command": command})


def command_changed(ctx: ServerContext, workspace_id: int, command: wire.CommandInfo) -> None:
    """A command its process reported on, or the server ended (expired, failed, its process
    forgotten): no longer pending, dashboards told, whoever waits on it and on its job operation
    woken, and counted once it ended."""
    ctx.command_settled(workspace_id, command.process_id, command.id)
    ctx.publish(workspace_id, protocol.EVENT_COMMAND, {"action": "updated", "command": command})
    ctx.notifier.notify(command_news(workspace_id, command.id))
    if command.job is not None:
        ctx.notifier.notify(operation_news(workspace_id, command.job.operation_id))
    if command.state in protocol.FINAL_COMMAND_STATES:
        ctx.metrics.commands_finished.labels(kind=command.kind, outcome=command.state).inc()


def command_news(workspace_id: int, command_id: int) -> tuple[str, int, int]:
    """The notifier key that wakes a wait for the command (``long_poll.wait_command``)."""
    return ("cmd", workspace_id, command_id)


def operation_news(workspace_id: int, operation_id: int) -> tuple[str, int, int]:
    """The notifier key that wakes a wait for the job operation (``long_poll.wait_operation``)."""
    return ("op", workspace_id, operation_id)


def placements_changed(ctx: ServerContext, workspace_id: int, placements: Iterable[wire.PlacementInfo]) -> None:
    """Placements asked for again, placed, taken or ended: dashboards told."""
    for placement in placements:
        ctx.publish(workspace_id, protocol.EVENT_PLACEMENT, {"action": "updated", "placement": placement})
