"""The server's resume-when-free queue on the command line: `flexium queue` (the jobs waiting for
room, in the order they resume), `flexium priority JOB [P]`, and what `flexium resume JOB` does with
``--when-free`` (queue it), ``--make-room`` (pause jobs of lower priority for it now) and
``--cancel`` (take it out of the queue)."""

from __future__ import annotations

import argparse
import sys
import time
from typing import Any

from flexium import protocol, wire
from flexium.cli.connection import add_connection_options
from flexium.cli.exit_status import EXIT_FAILED, EXIT_OK, UsageError, fail, request_body
from flexium.cli.naming import PROCESS_HELP, process_id_for, resolve_process
from flexium.cli.printing import age, print_json, print_table
from flexium.cli.terminal import terminal_width
from flexium.cli.waiting import Following
from flexium.client import ApiClient, NotFound
from flexium.units import gib

FOLLOW_EVERY_S = 0.5  # how often `resume --make-room` reads its wait while the room is made
PAUSE_SLOW_S = 15.0  # a pause making room not done by then is said, with where to look
NOTE_WIDTH = 60


def add_commands(commands: Any) -> None:
    """``commands``: the ``flexium`` parser's subparsers."""
    p = commands.add_parser(
        "queue",
        help="list the paused jobs waiting to resume when free and the flexium run jobs waiting to start (or "
        "started, their room held), by host, in the order they go",
    )
    p.add_argument("--all", action="store_true", help="every wait and placement, those that ended too, newest first")
    add_connection_options(p, _queue)
    p = commands.add_parser(
        "priority",
        help="show a job's priority, or set it (admin): a higher one resumes first from the queue, and making room "
        "pauses only jobs of a lower one",
    )
    p.add_argument("process", help=PROCESS_HELP)
    p.add_argument("priority", nargs="?", help=protocol.PRIORITY_SYNTAX)
    add_connection_options(p, _priority)


def add_resume_options(parser: argparse.ArgumentParser) -> None:
    """`flexium resume`'s options for the queue."""
    later = parser.add_mutually_exclusive_group()
    later.add_argument(
        "--when-free",
        action="store_true",
        help="queue it: resumed by the server as soon as a GPU of its host has room (a higher priority first, first "
        "come first served within one); returns once queued",
    )
    later.add_argument(
        "--make-room",
        action="store_true",
        help="pause the fewest jobs of lower priority on one GPU to free what it needs (they wait to resume when "
        "free), and resume it there; never pauses a job of its priority or higher",
    )
    later.add_argument("--cancel", action="store_true", help="take it out of the queue")
    parser.add_argument(
        "--gpu",
        metavar="GPU",
        help="with --when-free or --make-room: the GPU it waits for, cuda:N, N, GPU-... or auto (the default: the "
        "first GPU of its host with room)",
    )
    parser.add_argument("--host", help="with --when-free: the host it resumes on (its own; said to make sure)")


def resume_later(api: ApiClient, args: argparse.Namespace) -> wire.CommandInfo | int:
    """`flexium resume` with a queue option: an exit status, or the resume command to follow (room
    was free at once, or made)."""
    if args.target or args.ranks is not None:
        raise UsageError("--when-free, --make-room and --cancel take no TARGET or --ranks: name the GPU with --gpu")
    if args.cancel:
        if args.gpu is not None or args.host is not None:
            raise UsageError("--cancel takes no --gpu or --host")
        return _cancel(api, args)
    if args.host is not None and args.make_room:
        raise UsageError("--host goes with --when-free: room is made on the job's own host")
    request = request_body(
        wire.WaitRequest,
        process_id=args.process,
        gpu=args.gpu,
        host=args.host,
        make_room=args.make_room,
        reason=args.reason,
    )
    request.process_id = process_id_for(api, args.process)
    try:
        created = api.create_wait(request)
    except NotFound:
        request.process_id = resolve_process(api, args.process)
        created = api.create_wait(request)
    wait = created.wait
    title = f"resume {wait.process_id}" if wait.job_key is None else f"resume job {wait.job_key}"
    for pause in created.commands:
        if pause.kind == "pause" and not args.json:
            print(f"{title}: making room: pausing {pause.process_id} (command {pause.id})", file=sys.stderr)
    resume = next((c for c in created.commands if c.kind == "resume"), None)
    if resume is not None:
        return resume
    if args.no_wait or not args.make_room:
        if args.json:
            print_json(created)
        else:
            print(f"{title}: {_queued(wait, args.gpu, created.queued_before)}")
        return EXIT_OK
    pauses = [c for c in created.commands if c.kind == "pause"]
    return _until_resumed(api, args, wait, title, pauses)


def _queued(wait: wire.WaitInfo, named: str | None, queued_before: float | None = None) -> str:
    """``named``: the GPU as the user named it (--gpu), shown beside the UUID the server resolved it to;
    ``queued_before``: when the job was queued first, if it was already (it kept its place)."""
    if wait.gpu_uuid is None:
        where = "a GPU of its host"
    elif named and named != wait.gpu_uuid:
        where = f"{named} ({wait.gpu_uuid})"
    else:
        where = wait.gpu_uuid
    place = f", number {wait.position} in host {wait.host}'s queue" if wait.position else ""
    already = ""
    if queued_before is not None:
        already = f"already queued since {time.strftime('%H:%M:%S', time.localtime(queued_before))}, its place kept: "
    return (
        f"{already}queued as wait {wait.id}{place}: it resumes when {where} has {gib(wait.need_bytes)} free "
        f"({gib(protocol.ROOM_MARGIN_BYTES)} more as headroom beside other processes or on another GPU; "
        f"`flexium queue` lists the queue; `flexium resume {wait.process_id} --cancel` takes it out)"
    )


def _until_resumed(
    api: ApiClient, args: argparse.Namespace, wait: wire.WaitInfo, title: str, pauses: list[wire.CommandInfo]
) -> wire.CommandInfo | int:
    """The room is being made: the wait read until the queue sends its resume; a pause not taken after
    PAUSE_SLOW_S is said once, with where to look."""
    if not args.json:
        held_on = wait.reservation.gpu_uuid if wait.reservation is not None else wait.gpu_uuid
        print(f"{title}: room held for it on {held_on}; waiting for the pauses to free it", file=sys.stderr)
    Following.now(
        f"wait {wait.id} (`flexium queue` shows it; `flexium resume {wait.process_id} --cancel` takes it out)"
    )
    started = time.monotonic()
    deadline = started + args.timeout
    while wait.state == "waiting" and wait.reservation is not None and time.monotonic() < deadline:
        time.sleep(FOLLOW_EVERY_S)
        wait = api.get_wait(wait.id)
        if pauses and time.monotonic() - started >= PAUSE_SLOW_S:
            _say_slow_pauses(api, args, title, pauses)
            pauses = []
    if wait.command_id is not None and wait.state in ("dispatched", "done"):
        return api.get_command(wait.command_id)
    if wait.state == "waiting" and wait.reservation is None:  # a pause that was to make the room failed
        return fail(
            f"{title}: {wait.note or 'the room held for it is gone'} (wait {wait.id}: `flexium queue` shows it; "
            f"`flexium resume {wait.process_id} --cancel` takes it out)",
            EXIT_FAILED,
            as_json=args.json,
        )
    if wait.state == "waiting":
        return fail(
            f"{title}: still waiting after {args.timeout:.0f} s (wait {wait.id}); it resumes when the room shows "
            "(`flexium queue`)",
            EXIT_FAILED,
            as_json=args.json,
        )
    return fail(
        f"{title}: wait {wait.id} {wait.state}: {wait.note or 'no reason given'}", EXIT_FAILED, as_json=args.json
    )


def _say_slow_pauses(api: ApiClient, args: argparse.Namespace, title: str, pauses: list[wire.CommandInfo]) -> None:
    """The pauses making the room that are still not done, and why that may be."""
    for pause in pauses:
        now = api.get_command(pause.id)
        if now.state in protocol.ACTIVE_COMMAND_STATES and not args.json:
            print(
                f"{title}: pausing {pause.process_id} (command {pause.id}) is still {now.state} after "
                f"{PAUSE_SLOW_S:.0f} s: a job takes its pause at its next optimizer step; `flexium ps` shows whether "
                "it is STALE (its pause then expires and this job waits in the queue); Ctrl-C stops waiting here, "
                "the room stays held",
                file=sys.stderr,
            )


def _cancel(api: ApiClient, args: argparse.Namespace) -> int:
    try:
        waits = api.list_waits(process_id=args.process)
    except NotFound:
        waits = api.list_waits(process_id=resolve_process(api, args.process))
    waiting = [w for w in waits if w.state == "waiting"]
    if not waiting:
        under_way = f": its resume, command {waits[0].command_id}, is under way" if waits else ""
        return fail(f"{args.process} is not waiting in the queue{under_way}", EXIT_FAILED, as_json=args.json)
    cancelled = api.cancel_wait(waiting[0].id)
    if args.json:
        print_json(cancelled)
    else:
        print(f"resume {cancelled.process_id} when free: cancelled (wait {cancelled.id}); it stays paused")
    return EXIT_OK


def _queue(api: ApiClient, args: argparse.Namespace) -> int:
    waits = api.list_waits(ended=args.all)
    placements = api.list_placements(ended=args.all)
    if args.json:
        print_json(wire.QueueListing(waits=waits, placements=placements))
        return EXIT_OK
    if not waits and not placements:
        print(f"no job waits to resume or start in workspace '{api.workspace}'" if not args.all else "no wait yet")
        return EXIT_OK
    if waits:
        if placements:
            print("paused, waiting to resume:")
        _print_waits(waits)
    if placements:
        if waits:
            print()
        _print_placements(placements)
    print(
        "PLACE: in its host's queue, paused jobs and jobs not started yet in one order (a higher priority first, "
        "first come first served within one)."
    )
    return EXIT_OK


def _print_placements(placements: list[wire.PlacementInfo]) -> None:
    now = time.time()
    rows = [("PLACEMENT", "PRIORITY", "PLACE", "STATE", "HOST", "GPU", "NEEDS", "WAITING", "BY", "COMMAND", "NOTE")]
    for p in placements:
        gpu = p.placed_index if p.placed_index is not None else p.placed_uuid
        if gpu is None:
            gpu = p.gpu_index if p.gpu_index is not None else (p.gpu_uuid or "any")
        rows.append(
            (
                str(p.id),
                protocol.priority_name(p.priority),
                "-" if p.position is None else str(p.position),
                p.state,
                p.host,
                str(gpu),
                gib(p.need_bytes) if p.need_bytes else "-",
                age((p.placed_at or p.finished_at or now) - p.created_at),
                p.requested_by,
                _clip(p.command),
                _clip(_placement_note(p)),
            )
        )
    print("waiting to start or starting (flexium run):")
    print_table(rows)


def _wait_note(w: wire.WaitInfo) -> str:
    """Why it waits, or how it ended: a done one by which resume (`flexium ps` and the job's timeline say
    where it went)."""
    if w.state == "done" and w.command_id is not None:
        return f"resumed by command {w.command_id}" + (f"; why: {w.why}" if w.why else "")
    return _with_why(w.why, w.note or ("" if w.why else w.reason))


def _with_why(why: str | None, note: str) -> str:
    """The reason it was queued with (--reason), first: a note that follows may be clipped."""
    return "; ".join(part for part in (f"why: {why}" if why else "", note) if part)


def _placement_note(p: wire.PlacementInfo) -> str:
    """Its note without what NEEDS says already ("waits for 76.5 GiB (its 76.0 GiB and headroom): "): why
    it waits, GPU by GPU."""
    if p.state == "started" and p.reservation is not None:
        until = time.strftime("%H:%M:%S", time.localtime(p.reservation.expires_at))
        return _with_why(
            p.why,
            f"its room is held until its memory shows there (at most until {until}); the queue counts it as taken",
        )
    note = p.note or ""
    if note.startswith("waits for ") and "): " in note:
        note = note.split("): ", 1)[1]
    return _with_why(p.why, note)


def _print_waits(waits: list[wire.WaitInfo]) -> None:
    now = time.time()
    rows = [("WAIT", "PROCESS", "PRIORITY", "PLACE", "STATE", "HOST", "GPU", "NEEDS", "WAITING", "BY", "NOTE")]
    for w in waits:
        rows.append(
            (
                str(w.id),
                w.process_id if w.job_key is None else f"{w.process_id} (job)",
                protocol.priority_name(w.priority),
                "-" if w.position is None else str(w.position),
                w.state,
                w.host,
                str(w.gpu_index) if w.gpu_index is not None else (w.gpu_uuid or "any"),
                gib(w.need_bytes),
                age((w.finished_at or now) - w.created_at),
                w.requested_by,
                _clip(_wait_note(w)),
            )
        )
    print_table(rows)


def _clip(text: str) -> str:
    """At most NOTE_WIDTH characters, or what a wider terminal leaves the last column; whole to a file or a
    pipe (terminal_width)."""
    columns = terminal_width()
    if columns is None:
        return text
    width = max(NOTE_WIDTH, columns - 110)
    return text if len(text) <= width else text[: width - 1] + "~"


def _priority(api: ApiClient, args: argparse.Namespace) -> int:
    try:
        process_id = api.get_process(args.process).process_id
    except NotFound:
        process_id = resolve_process(api, args.process)
    if args.priority is None:
        process = api.get_process(process_id)
    else:
        try:
            priority = protocol.read_priority(args.priority)
        except ValueError as exc:
            raise UsageError(str(exc)) from None
        process = api.set_priority(process_id, priority)
    if args.json:
        print_json(process)
        return EXIT_OK
    whole = f" (every rank of job {process.job.key})" if process.job is not None and process.job.world_size > 1 else ""
    print(f"{process.process_id}: priority {protocol.priority_name(process.priority)}{whole}")
    return EXIT_OK
