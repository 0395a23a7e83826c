"""Following a command, or a job operation, until it ends: the server's long-poll asked again
until the end or ``--timeout``, and while it is under way a line on stderr at each change and
every PROGRESS_EVERY_S between (nothing under ``--json``)."""

from __future__ import annotations

import argparse
import math
import sys
import time
from collections.abc import Callable
from typing import TypeVar

from flexium import protocol, wire
from flexium.cli.printing import rank
from flexium.client import ApiClient

DEFAULT_WAIT_S = 300.0
PROGRESS_EVERY_S = 10.0


class Following:
    """What the command line follows now, said if Ctrl-C ends it (cli/connection.py): the server
    carries it on all the same."""

    what: str | None = None  # e.g. "command 9 (flexium ps shows it)"

    @classmethod
    def now(cls, what: str) -> None:
        cls.what = what


# A command or a job operation, long-polled until it ends.
_Polled = TypeVar("_Polled", wire.CommandInfo, wire.JobOperationInfo)

_UNDER_WAY = {
    "queued": "queued; the process takes it at its next poll",
    "delivered": "delivered to the process",
    "running": "running in the process (a migrate or pause acts at its next optimizer step, its safe point)",
}


def seconds(text: str) -> float:
    """A --timeout: a finite number of seconds above 0 (argparse refuses anything else, exit 2,
    before a command is sent)."""
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a number of seconds") from None
    if not math.isfinite(value) or value <= 0:
        raise argparse.ArgumentTypeError(f"{text!r}: give a number of seconds above 0, e.g. 600")
    return value


def add_wait_options(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--timeout",
        type=seconds,
        default=DEFAULT_WAIT_S,
        metavar="SECONDS",
        help=f"how long to wait for the outcome (default {DEFAULT_WAIT_S:.0f})",
    )
    parser.add_argument("--no-wait", action="store_true", help="print the queued command and return")


class ProcessSilent(Exception):
    """The command waits, queued, for a process that stopped reporting: it would wait out its timeout."""


def wait_command(
    api: ApiClient,
    command: wire.CommandInfo,
    timeout: float,
    progress: Callable[[wire.CommandInfo], None] | None = None,
) -> wire.CommandInfo:
    """Long-polls the command until it ends or `timeout` passes; `progress(command)` is called
    with each answer while it is under way (each change, and every PROGRESS_EVERY_S between).
    Raises ProcessSilent when the command is still queued and its process has stopped reporting."""

    def ended(current: wire.CommandInfo) -> bool:
        if current.state in protocol.FINAL_COMMAND_STATES:
            return True
        if current.state == "queued" and current is not command:  # asked at least once: not at the start
            process = api.get_process(current.process_id)
            if process.stale:
                raise ProcessSilent(
                    f"process {current.process_id} stopped reporting (`flexium ps` shows it STALE): command "
                    f"{current.id} stays queued and is taken if it comes back"
                )
        return False

    return _poll_until(
        command,
        ended=ended,
        ask=lambda wait, deadline: api.wait_command(command.id, wait=wait, deadline=deadline),
        timeout=timeout,
        progress=progress,
    )


def wait_operation(
    api: ApiClient,
    operation: wire.JobOperationInfo,
    timeout: float,
    progress: Callable[[wire.JobOperationInfo], None] | None = None,
) -> wire.JobOperationInfo:
    """As ``wait_command``, for every rank's command of a job operation."""
    return _poll_until(
        operation,
        ended=lambda o: o.finished_at is not None,
        ask=lambda wait, deadline: api.wait_operation(operation.id, wait=wait, deadline=deadline),
        timeout=timeout,
        progress=progress,
    )


def _poll_until(
    first: _Polled,
    *,
    ended: Callable[[_Polled], bool],
    ask: Callable[[float, float], _Polled],
    timeout: float,
    progress: Callable[[_Polled], None] | None,
) -> _Polled:
    """`ask(wait, deadline)` the server's long-poll again until `ended` or `timeout` passes."""
    if isinstance(first, wire.CommandInfo):
        Following.now(f"command {first.id} ({first.kind} of {first.process_id}; `flexium ps` shows it)")
    else:
        Following.now(f"job operation {first.id} (`flexium ps` shows its ranks' commands)")
    deadline = time.monotonic() + timeout
    current = first
    while not ended(current):
        if progress is not None:
            progress(current)
        remaining = deadline - time.monotonic()
        if remaining <= 0:
            break
        wait = min(remaining, protocol.MAX_POLL_TIMEOUT_S, PROGRESS_EVERY_S if progress is not None else remaining)
        current = ask(round(wait, 3), deadline)
    return current


def command_progress(title: str, queued: wire.CommandInfo) -> Callable[[wire.CommandInfo], None]:
    """Where a command stands (a 64 GiB pause prepares for half a minute)."""
    return _progress(title, lambda command: f"command {queued.id} {_UNDER_WAY.get(command.state, command.state)}")


def job_progress(title: str) -> Callable[[wire.JobOperationInfo], None]:
    """Where each rank's command stands."""
    return _progress(title, lambda operation: ", ".join(f"rank {rank(c)} {c.state}" for c in operation.commands))


def _progress(title: str, describe: Callable[[_Polled], str]) -> Callable[[_Polled], None]:
    """Prints `describe(answer)` on stderr at each change, and every PROGRESS_EVERY_S while it
    stays the same."""
    started = time.monotonic()
    said, said_at = "", started

    def show(current: _Polled) -> None:
        nonlocal said, said_at
        now = time.monotonic()
        where = describe(current)
        if where == said and now - said_at < 0.9 * PROGRESS_EVERY_S:
            return
        said, said_at = where, now
        print(f"{title}: {where} ({now - started:.0f} s)", file=sys.stderr, flush=True)

    return show
