"""Whole-job operations: a migrate, pause or resume of a rank of a job of several acts on its
job (the server makes it a job operation, a command for each rank), and ``--ranks`` says where
each rank that moves goes. Every rank's command is followed until the operation ends, and the
outcome is one line per rank."""

from __future__ import annotations

import argparse
import sys
import time

from flexium import wire
from flexium.cli.exit_status import EXIT_FAILED, EXIT_OK, fail
from flexium.cli.printing import count, ms, print_json, print_table, rank, reason
from flexium.cli.waiting import job_progress, wait_operation
from flexium.client import ApiClient, ServerError


def add_ranks_option(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--ranks",
        metavar="RANK=GPU,...",
        help=(
            "a rank of a job of several: a GPU for each rank that moves, in the named process's numbering, "
            "e.g. 0=cuda:1,1=cuda:0 (a swap); ranks left out stay where they are"
        ),
    )


def follow_job_operation(api: ApiClient, args: argparse.Namespace, operation_id: int) -> int:
    """Every rank's share of a job operation, waited for together; one line per rank."""
    operation = api.get_operation(operation_id)
    title = _job_title(api, operation)
    if args.no_wait:
        if args.json:
            print_json(operation)
        else:
            ids = ", ".join(str(c.id) for c in operation.commands)
            print(f"{title}: queued as job operation {operation.id} (commands {ids})")
        return EXIT_OK
    final = wait_operation(api, operation, args.timeout, progress=None if args.json else job_progress(title))
    if args.json:
        print_json(final)
    if final.finished_at is None:
        return fail(
            f"{title}: still {final.state} after {args.timeout:.0f} s (job operation {final.id}); see `flexium ps`",
            EXIT_FAILED,
        )
    if not args.json:
        _print_job_outcome(api, title, final)
    if final.state != "succeeded":
        reasons = "; ".join(f"rank {rank(c)}: {reason(c)}" for c in final.commands if c.state != "succeeded")
        print(f"flexium: {title} failed: {reasons}", file=sys.stderr)
        return EXIT_FAILED
    return EXIT_OK


def _job_title(api: ApiClient, operation: wire.JobOperationInfo) -> str:
    """ "migrate job run-7f3a (2 ranks): rank 0 to cuda:1, rank 1 to cuda:0": each target in the
    moving rank's own numbering where it sees the GPU."""
    title = f"{operation.kind} job {operation.job_key} ({count(operation.world_size, 'rank')})"
    if not operation.moves:
        return title
    visible = {c.job.rank: c.process_id for c in operation.commands if c.job is not None}
    processes = _processes_by_id(api)
    moves = []
    for moving, uuid in sorted(operation.moves.items(), key=lambda item: int(item[0])):
        process = processes.get(visible.get(int(moving), ""))
        shown = wire.cuda_ordinal(process.visible_gpus, uuid) if process is not None else None
        moves.append(f"rank {moving} to {shown or uuid}")
    return f"{title}: {', '.join(moves)}"


def _print_job_outcome(api: ApiClient, title: str, operation: wire.JobOperationInfo) -> None:
    total = (operation.finished_at or time.time()) - operation.created_at
    processes = _processes_by_id(api)
    simulated = {p.process_id for p in processes.values() if p.simulated}
    on = " on simulated GPUs" if any(c.process_id in simulated for c in operation.commands) else ""
    print(f"{title}: {operation.state} in {total:.2f} s{on} (job operation {operation.id})")
    why = next((c.reason for c in operation.commands if c.reason), None)
    if why:
        print(f"  why: {why}")
    rows = [("RANK", "PROCESS", "COMMAND", "STATE", "GPU", "PATH", "TIME", "ERROR")]
    for command in operation.commands:
        process = processes.get(command.process_id)
        gpu = "-"
        if process is not None and process.gpu_uuid:
            index = "" if process.gpu_index is None else f" (GPU {process.gpu_index})"
            gpu = f"{process.physical_device}{index}"
        result = command.result
        seconds = command.took_s
        rows.append(
            (
                rank(command),
                command.process_id,
                command.state,
                process.state if process is not None else "-",
                gpu,
                (result.path if result is not None else None) or "-",
                "-" if seconds is None else ms(seconds) + (" simulated" if command.process_id in simulated else ""),
                reason(command) if command.state != "succeeded" else "",
            )
        )
    print_table(rows, indent="  ")


def _processes_by_id(api: ApiClient) -> dict[str, wire.ProcessInfo]:
    """The workspace's processes, or none where the server cannot list them now: a title or an
    outcome then shows less, and the operation's own outcome still stands."""
    try:
        return {p.process_id: p for p in api.list_processes()}
    except ServerError:
        return {}
