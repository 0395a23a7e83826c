"""`flexium drain HOST[:GPU]` and `flexium undrain HOST[:GPU]`: take a GPU (or every GPU of a host)
out of use, its jobs migrated to the GPU of the host with the most room or paused to resume when
free, each job's move printed as it goes and a summary at the end; and give it back."""

from __future__ import annotations

import argparse
import sys
import time
from typing import Any

from flexium import protocol, wire
from flexium.cli.connection import add_connection_options
from flexium.cli.exit_status import EXIT_FAILED, EXIT_OK, UsageError, fail, request_body
from flexium.cli.printing import print_json
from flexium.cli.waiting import Following, add_wait_options

FOLLOW_EVERY_S = 0.5  # how often `flexium drain` reads its drain while the moves go
WHERE_HELP = "HOST (every GPU of it) or HOST:GPU, the GPU by its nvidia-smi index or its UUID (GPU-...)"


def add_commands(commands: Any) -> None:
    """``commands``: the ``flexium`` parser's subparsers."""
    p = commands.add_parser(
        "drain",
        help="take a GPU (or every GPU of a host) out of use (admin): each job on it migrated to the GPU of the host "
        "with the most room, or paused to resume when free; nothing goes there until `flexium undrain`",
    )
    p.add_argument("where", metavar="HOST[:GPU]", help=WHERE_HELP)
    p.add_argument(
        "--reason",
        metavar="TEXT",
        default="",
        help="why, one line, for the audit log and the commands it sends (the jobs' timelines)",
    )
    add_wait_options(p)
    add_connection_options(p, _drain)
    p = commands.add_parser("undrain", help="give a drained GPU (or host) back: jobs may be placed and resumed there")
    p.add_argument("where", metavar="HOST[:GPU]", help=WHERE_HELP)
    add_connection_options(p, _undrain)


def read_where(text: str) -> tuple[str, str | None]:
    """(host, GPU or None) of ``HOST[:GPU]``; a host name has no colon (a GPU UUID has none either)."""
    host, sep, gpu = text.strip().partition(":")
    if not host or (sep and not gpu):
        raise UsageError(f"{text!r} is not {WHERE_HELP}")
    return host, gpu or None


def _drain(api: Any, args: argparse.Namespace) -> int:
    host, gpu = read_where(args.where)
    drain = api.create_drain(request_body(wire.DrainRequest, host=host, gpu=gpu, reason=args.reason))
    label = args.where
    if not args.json:
        print(
            f"drain {drain.id} of {label}: nothing is placed, resumed or migrated there until `flexium undrain {label}`"
        )
    shown: dict[tuple[str, int], str] = {}
    Following.now(f"drain {drain.id} of {label} (`flexium drain` shows it; `flexium undrain {label}` ends it)")
    deadline = time.monotonic() + args.timeout
    while True:
        if not args.json:
            _print_changes(drain, shown)
        if args.no_wait or drain.state != "draining" or time.monotonic() >= deadline:
            break
        time.sleep(FOLLOW_EVERY_S)
        drain = api.get_drain(drain.id)
    if args.json:
        print_json(drain)
    else:
        print(summary(drain))
    if drain.state == "draining" and not args.no_wait:
        return fail(
            f"drain {drain.id}: moves still under way after {args.timeout:.0f} s (`flexium drain` again shows them; "
            f"GET {protocol.PATH_DRAIN.format(drain_id=drain.id)})",
            EXIT_FAILED,
        )  # under --json the drain printed above is stdout's one document: it says what is under way
    left = left_behind(drain)
    if left and not args.no_wait:
        # A script that drains before maintenance must not go on while jobs still run there.
        return fail(
            f"drain {drain.id}: {len(left)} job(s) still on {label}: {', '.join(left)} (named above with why); the "
            f"drain stays, so nothing new goes there: move or pause them yourself, or `flexium undrain {label}`",
            EXIT_FAILED,
        )
    return EXIT_OK


def _print_changes(drain: wire.DrainInfo, shown: dict[tuple[str, int], str]) -> None:
    """Each job's move as it goes: printed when it is sent and again when its command ends."""
    for number, move in enumerate(drain.moves):
        line = move_line(move)
        key = (move.process_id, number)
        if shown.get(key) != line:
            shown[key] = line
            print(line, file=sys.stdout if move.action != "refused" else sys.stderr, flush=True)


def move_line(move: wire.DrainMoveInfo) -> str:
    who = f"job {move.job_key}" if move.job_key else move.process_id
    state = f" [{move.command_state or 'forgotten'}]" if move.command_id is not None else ""
    if move.action == "refused":
        return f"  {who}: not moved: {move.note}"
    # A command that ended otherwise than succeeded: its note was the plan; the line after it says why not.
    gone = move.command_state in protocol.FINAL_COMMAND_STATES and move.command_state != "succeeded"
    note = f"planned as: {move.note}" if gone else move.note
    return f"  {who}: {move.action} (command {move.command_id}){state}: {note}"


def summary(drain: wire.DrainInfo) -> str:
    done = {"migrate": 0, "pause": 0}
    for move in _last_moves(drain):
        if move.action != "refused" and move.command_state == "succeeded":
            done[move.action] += 1
    parts = [f"{done['migrate']} moved", f"{done['pause']} paused (queued to resume when free)"]
    left = left_behind(drain)
    if left:
        parts.append(f"{len(left)} left where they are (named above)")
    if drain.remaining:
        parts.append(f"still to move: {', '.join(drain.remaining)}")
    return f"drain {drain.id}: {drain.state}: " + ", ".join(parts)


def left_behind(drain: wire.DrainInfo) -> list[str]:
    """The jobs whose last move was refused or ended otherwise than succeeded: still on the drained GPUs."""
    return [
        move.job_key or move.process_id
        for move in _last_moves(drain)
        if move.action == "refused"
        or (move.command_state != "succeeded" and move.command_state not in protocol.ACTIVE_COMMAND_STATES)
    ]


def _last_moves(drain: wire.DrainInfo) -> list[wire.DrainMoveInfo]:
    latest: dict[str, wire.DrainMoveInfo] = {}
    for move in drain.moves:
        latest[move.job_key or move.process_id] = move
    return list(latest.values())


def _undrain(api: Any, args: argparse.Namespace) -> int:
    host, gpu = read_where(args.where)
    drains = api.list_drains(host=host)
    if gpu is None:
        chosen = drains  # every drain of the host: the host's and each GPU's
    else:
        chosen = [d for d in drains if gpu in (d.gpu_uuid, str(d.gpu_index))]
        whole = [d for d in drains if d.gpu_uuid is None]
        if not chosen and whole:
            return fail(
                f"{host} is drained as a whole (drain {whole[0].id}): `flexium undrain {host}`, then drain the GPUs "
                "to keep out",
                EXIT_FAILED,
                as_json=args.json,
            )
    if not chosen:
        return fail(f"{args.where} is not drained (`flexium drain` drains it)", EXIT_FAILED, as_json=args.json)
    ended = [api.undrain(d.id) for d in chosen]
    if args.json:
        print_json(ended)
    else:
        for drain in ended:
            gpu_name = drain.gpu_uuid if drain.gpu_index is None else drain.gpu_index
            where = host if drain.gpu_uuid is None else f"{host}:{gpu_name}"
            print(f"undrained {where} (drain {drain.id}): jobs may be placed and resumed there again")
    return EXIT_OK
