"""`flexium migrate | pause | resume`: a command for one process (a rank of a job of several
stands for its job: cli/jobs.py), followed until it ends (cli/waiting.py), and its outcome as the
process measured it."""

from __future__ import annotations

import argparse
import sys
import time
from typing import Any

from flexium import protocol, wire
from flexium.cli.connection import add_connection_options
from flexium.cli.exit_status import EXIT_FAILED, EXIT_OK, UsageError, fail, request_body
from flexium.cli.jobs import add_ranks_option, follow_job_operation
from flexium.cli.naming import PROCESS_HELP, process_id_for, resolve_process
from flexium.cli.printing import ms, print_json, reason
from flexium.cli.queue import add_resume_options, resume_later
from flexium.cli.waiting import ProcessSilent, add_wait_options, command_progress, wait_command
from flexium.client import ApiClient, NotFound, Refused, ServerError
from flexium.units import gib

# The server reads a target this way, and only the server (it resolves it to a GPU UUID).
TARGET_HELP = (
    "the GPU: cuda:N = the job's own CUDA numbering (entry N of the GPUs it sees), a bare "
    "number N = nvidia-smi's index N on the job's host, GPU-... = a GPU UUID"
)


def add_commands(commands: Any) -> None:
    """``commands``: the ``flexium`` parser's subparsers."""
    p = commands.add_parser(
        "migrate",
        help="move a running process to another GPU and wait for the outcome (a rank of a job: that rank, or --ranks)",
    )
    p.add_argument("process", help=PROCESS_HELP)
    p.add_argument(
        "target",
        nargs="?",
        help=TARGET_HELP + ", or auto = the GPU of its host with the most room it can use, not drained (a rank of a "
        "job: where that rank goes)",
    )
    add_ranks_option(p)
    p.add_argument(
        "--gpus",
        metavar="GPU=GPU,...",
        help=(
            "one process on several GPUs: where the memory on each GPU it uses goes, GPUs named as TARGET, "
            "e.g. cuda:0=cuda:2,cuda:1=cuda:3; GPUs left out stay"
        ),
    )
    _add_wait_and_connection_options(p)
    p = commands.add_parser(
        "pause", help="pause a process (its GPU memory is freed) and wait for the outcome (a rank: its whole job)"
    )
    p.add_argument("process", help=PROCESS_HELP)
    _add_wait_and_connection_options(p)
    p = commands.add_parser(
        "resume",
        help="resume a paused process, on its GPU or the one given (a rank: its whole job); or queue it to resume "
        "when free, or make room for it",
    )
    p.add_argument("process", help=PROCESS_HELP)
    p.add_argument(
        "target", nargs="?", help=TARGET_HELP + " (default: where it paused if there is room, else the server picks)"
    )
    add_ranks_option(p)
    add_resume_options(p)
    _add_wait_and_connection_options(p)


def _add_wait_and_connection_options(parser: argparse.ArgumentParser) -> None:
    waits = (
        "; with --when-free or --make-room it is kept on the wait (flexium queue shows it) and the commands sent for "
        "it carry it"
        if parser.prog.endswith(" resume")
        else ""
    )
    parser.add_argument(
        "--reason",
        metavar="TEXT",
        help=f"why, in one line (at most {protocol.MAX_REASON_LEN} characters): the job's timeline shows it beside "
        f"who sent the command, so a colleague sees why their job moved{waits}",
    )
    add_wait_options(parser)
    add_connection_options(parser, _move)


def _move(api: ApiClient, args: argparse.Namespace) -> int:
    if args.reason is not None and args.command == "resume" and args.cancel:
        raise UsageError("--reason goes with a command or a wait, not with --cancel")
    if args.command == "resume" and (args.when_free or args.make_room or args.cancel):
        later = resume_later(api, args)
        return later if isinstance(later, int) else _follow(api, args, later)
    if args.command == "resume" and (args.gpu is not None or args.host is not None):
        raise UsageError("--gpu and --host go with --when-free or --make-room; a plain resume takes a TARGET")
    target = getattr(args, "target", None)
    ranks_text, gpus_text = getattr(args, "ranks", None), getattr(args, "gpus", None)
    ranks = _parse_pairs("--ranks", ranks_text, "RANK=GPU, e.g. 0=cuda:1,1=cuda:0") if ranks_text is not None else None
    gpus = _parse_pairs("--gpus", gpus_text, "GPU=GPU, e.g. cuda:0=cuda:2,cuda:1=cuda:3") if gpus_text else None
    if sum(given is not None and given != "" for given in (target, ranks, gpus)) > 1:
        raise UsageError(
            "give a TARGET (where the process goes), --ranks (several ranks of a job) or --gpus (the GPUs of one "
            "process on several), not both"
        )
    if args.command == "migrate" and not target and ranks is None and gpus is None:
        raise UsageError(
            "migrate needs a TARGET, or --ranks RANK=GPU,... for a rank of a job of several, or --gpus GPU=GPU,... "
            "for a process on several GPUs"
        )
    for named in [target, *(ranks or {}).values(), *(gpus or {}), *(gpus or {}).values()]:
        if named and not (named == target and args.command == "migrate" and named == protocol.AUTO_TARGET):
            _check_target(str(named))
    request = _request(args, target=target or None, ranks=ranks, gpus=gpus)
    request.process_id = process_id_for(api, args.process)
    try:
        try:
            command = api.create_command(request)
        except NotFound:
            request.process_id = resolve_process(api, args.process)
            command = api.create_command(request)
    except Refused as exc:
        no_such_gpu = isinstance(exc.detail, dict) and bool(exc.detail.get(protocol.UNKNOWN_GPU))
        if args.command == "resume" and exc.code == "target_refused" and no_such_gpu:
            exc.message += "; `flexium devices` lists its host's GPUs"
        elif args.command == "resume" and exc.code == "target_refused":
            # A GPU named: the refusal is that GPU's; the queue may resume it on another of its host.
            exc.message += (
                f"; `flexium devices` lists its host's GPUs, or the queue resumes it when {target} has room: "
                f"flexium resume {args.process} --when-free --gpu {target} (without --gpu: on any GPU of its host)"
                if target
                else f"; {_queue_hint(api, args.process, None)}"
            )
        raise
    return _follow(api, args, command)


def _follow(api: ApiClient, args: argparse.Namespace, command: wire.CommandInfo) -> int:
    """The command followed until it ends (or --timeout), and its outcome printed."""
    if command.job is not None:
        return follow_job_operation(api, args, command.job.operation_id)
    title = _title(api, command)
    if args.no_wait:
        if args.json:
            print_json(command)
        else:
            print(f"{title}: queued as command {command.id}")
        return EXIT_OK
    try:
        final = wait_command(
            api, command, args.timeout, progress=None if args.json else command_progress(title, command)
        )
    except ProcessSilent as exc:
        return fail(f"{title}: {exc}", EXIT_FAILED, as_json=args.json, code="process_silent")
    if args.json:
        print_json(final)
    if final.state not in protocol.FINAL_COMMAND_STATES:
        return fail(
            f"{title}: still {final.state} after {args.timeout:.0f} s (command {final.id}); see `flexium ps`",
            EXIT_FAILED,
        )
    if not args.json:
        _print_outcome(api, title, final)
    if final.state != "succeeded":
        if args.json:
            print(f"flexium: {title} {final.state}: {reason(final)}", file=sys.stderr)
        if final.kind == "resume":
            print(f"  {_queue_hint(api, final.process_id, getattr(args, 'target', None))}", file=sys.stderr)
        return EXIT_FAILED
    return EXIT_OK


def _queue_hint(api: ApiClient, process: str, target: str | None) -> str:
    """After a refused or failed resume: how to queue it (for the GPU it named), unless it waits in the
    queue already."""
    try:
        waiting = [w for w in api.list_waits(process_id=process) if w.state == "waiting"]
    except ServerError:
        waiting = []
    if waiting:
        return f"it waits in the queue already (wait {waiting[0].id}): `flexium queue` shows it"
    gpu = f" --gpu {target}" if target and target != protocol.AUTO_TARGET else ""
    return f"queue it? flexium resume {process} --when-free{gpu}"


def _request(
    args: argparse.Namespace,
    *,
    target: str | None,
    ranks: dict[str, int | str] | None,
    gpus: dict[str, int | str] | None,
) -> wire.CommandRequest:
    return request_body(
        wire.CommandRequest,
        kind=args.command,
        process_id=args.process,
        target=target,
        ranks=ranks,
        gpus=gpus,
        reason=args.reason,
    )


def _check_target(text: str) -> None:
    try:
        protocol.read_target(text)
    except ValueError as exc:
        raise UsageError(str(exc)) from None


def _parse_pairs(option: str, text: str, form: str) -> dict[str, int | str]:
    """``0=cuda:1,1=cuda:0`` -> {"0": "cuda:1", "1": "cuda:0"} (the server judges the rest)."""
    pairs: dict[str, int | str] = {}
    for part in text.split(","):
        key, sep, gpu = part.partition("=")
        if not sep or not key.strip() or not gpu.strip():
            raise UsageError(f"{option} {text!r}: each entry is {form}")
        pairs[key.strip()] = gpu.strip()
    return pairs


def _title(api: ApiClient, command: wire.CommandInfo) -> str:
    """ "migrate gpu-1a2b to cuda:1": the target in the job's own numbering when it sees the
    GPU (derived here from the UUID the command carries), else the UUID."""
    visible: list[str] = []
    if command.target_uuid is not None or command.gpu_moves:
        try:
            visible = api.get_process(command.process_id).visible_gpus
        except ServerError:
            pass

    def shown(uuid: str) -> str:
        return wire.cuda_ordinal(visible, uuid) or uuid

    title = f"{command.kind} {command.process_id}"
    if command.gpu_moves:
        return title + " GPU by GPU: " + ", ".join(f"{shown(a)} to {shown(b)}" for a, b in command.gpu_moves.items())
    return title + (f" to {shown(command.target_uuid)}" if command.target_uuid else "")


def _print_outcome(api: ApiClient, title: str, command: wire.CommandInfo) -> None:
    try:
        process: wire.ProcessInfo | None = api.get_process(command.process_id)
    except ServerError:
        process = None
    simulated = process is not None and process.simulated
    created, delivered = command.created_at, command.delivered_at
    started, finished = command.started_at, command.finished_at
    total = (finished or time.time()) - created
    print(f"{title}: {command.state} in {total:.2f} s{' on simulated GPUs' if simulated else ''}")
    if command.reason:
        print(f"  why: {command.reason}")
    parts = []
    if delivered is not None:
        parts.append(f"delivered {ms(delivered - created)} after it was queued")
    if started is not None and delivered is not None:
        parts.append(f"started {ms(started - delivered)} later")
    if finished is not None and started is not None:
        parts.append(f"done {ms(finished - started)} after that (includes the wait for a safe point)")
    if parts:
        print("  " + "; ".join(parts))
    result = command.result
    steps = [s for s in result.steps if not s.rollback] if result is not None else []
    if result is not None and steps:
        line = ", ".join(f"{s.step} {ms(s.seconds)}" + ("" if s.ok else " FAILED") for s in steps)
        moved = result.bytes_moved
        seconds = result.seconds or 0.0
        path = f"{result.path} path, " if result.path else ""
        if simulated:
            # The simulated driver's memory and timings: a rate from them would read as a measurement.
            memory = f"{gib(moved or 0)} of simulated memory moved"
            print(f"  simulated operation {ms(seconds)}, {path}phases ({line}); {memory}")
        else:
            speed = f", {moved / 1e9 / seconds:.1f} GB/s" if moved and seconds else ""
            print(f"  operation {ms(seconds)}, {path}phases ({line}); {gib(moved or 0)} moved{speed}")
        for note in result.notes:
            print(f"  note: {note}")
    if command.state != "succeeded":
        print(f"  reason: {reason(command)}", file=sys.stderr)
    if process is None:
        return
    where = process.physical_device or process.logical_device
    gpu = f" ({process.gpu_uuid}, nvidia-smi index {process.gpu_index})" if process.gpu_uuid else ""
    if process.state == "PAUSED":
        print(f"  the process is PAUSED on {where}{gpu}; it needs {gib(process.footprint_bytes or 0)} to resume")
    elif process.state == protocol.FAILED:
        print("  the process is FAILED: an earlier rollback failed and it may be stuck; restart the job")
    else:
        print(f"  the process is {process.state} on {where}{gpu}")
