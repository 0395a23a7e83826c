"""`flexium ps | devices`: the workspace's training processes, and the GPUs they report by host."""

from __future__ import annotations

import argparse
import sys
import time
from collections.abc import Callable, Sequence
from typing import Any

from flexium import protocol, wire
from flexium.cli.connection import add_connection_options
from flexium.cli.exit_status import EXIT_OK
from flexium.cli.printing import Column, age, clip, count, fit_columns, print_columns, print_json, print_table
from flexium.cli.terminal import terminal_width
from flexium.client import ApiClient
from flexium.units import GIB, gib

KEY_WIDTH = 16  # of a job's key in `flexium ps`
COMMAND_WIDTH = 80  # of a job's command line in `flexium ps` (--json has all of it)
PS_LEGEND = (
    "Columns: DEVICE = the GPU as the job names it (cuda:N), and, once a move took it to another, the GPU it is "
    "on as its host numbers them (cuda:0 (on cuda:1): the job's cuda:0 is the host's GPU 1, `flexium devices` "
    "lists them); STEPS = optimizer steps taken, as last reported (flexium.auto.report's step where the loop "
    "counts its own); SPEED = steps per second between its last two reports, while it runs (- until the "
    "second report after a move, pause or resume); MOVES: fast = migrate and pause on the fast path, driver = "
    "on the driver path only, pause = pause and resume only "
    "(driver below 580), - = none (`flexium ps --json` gives the reasons); MEMORY: the GPU memory it holds, or "
    "a paused one's, that it needs to resume; "
    "DOING: the command under way, or waiting for room to resume (`flexium queue`); "
    "JOB, RANK: the ranks of one job of several move together: pause or resume one of them acts on all; "
    "HOST: shown when processes of more than one host are listed. The table fits the terminal ($COLUMNS, else "
    "its width): it shortens long columns and leaves out those that tell least; to a file or a pipe it prints "
    "whole lines (--json has every field). A note on stderr names the processes on flexium's simulated host "
    "(flexium demo): their GPUs, memory and timings are not measured."
)


def add_commands(commands: Any) -> None:
    """``commands``: the ``flexium`` parser's subparsers."""
    p = commands.add_parser("ps", help="list the workspace's training processes", epilog=PS_LEGEND)
    p.add_argument("--state", choices=protocol.DISPLAY_STATES, help="only processes in this state")
    p.add_argument("--host", help="only the processes of this host")
    add_connection_options(p, _ps)
    p = commands.add_parser("devices", help="list the GPUs the workspace's processes report, by host")
    p.add_argument("--host", help="only this host")
    add_connection_options(p, _devices)


def _ps(api: ApiClient, args: argparse.Namespace) -> int:
    processes = api.list_processes(state=args.state, host=args.host)
    if args.json:
        print_json(processes)
        return EXIT_OK
    if not processes:
        filters = [f"--{name} {value}" for name, value in (("state", args.state), ("host", args.host)) if value]
        if filters:
            matching = " ".join(filters)
            print(f"no process matches {matching} in workspace '{api.workspace}' (`flexium ps` lists them all)")
        else:
            print(f"no processes in workspace '{api.workspace}' at {api.base_url}")
        return EXIT_OK
    print_columns(fit_columns(_columns(processes, time.time()), terminal_width()))
    simulated = [p.process_id for p in processes if p.simulated]
    if simulated:
        sys.stdout.flush()  # the table before the note where both go to one terminal or file
        one = len(simulated) == 1
        print(
            f"note: {', '.join(simulated)} {'runs' if one else 'run'} on flexium's simulated host "
            f"(flexium demo): {'its' if one else 'their'} GPUs, their memory and the timings of moves are simulated, "
            "not measured",
            file=sys.stderr,
        )
    return EXIT_OK


def _columns(processes: Sequence[wire.ProcessInfo], now: float) -> list[Column]:
    """Every column of `flexium ps`, in order; ``keep``: which go last where the terminal is too
    narrow (the id that commands take and the state first, the full command line last)."""

    def column(header: str, cell: Callable[[wire.ProcessInfo], str], keep: int, **fit: Any) -> Column:
        return Column(header, [cell(p) for p in processes], keep=keep, **fit)

    columns = [
        column("PROCESS", lambda p: p.process_id, keep=100),
        column("NAME", lambda p: p.name or "-", keep=90, shrink_to=12),
        column("JOB", lambda p: _short_key(p.job.key) if p.job else "-", keep=55, shrink_to=8, optional=True),
        column("RANK", lambda p: f"{p.job.rank}/{p.job.world_size}" if p.job else "-", keep=56, optional=True),
        column("STATE", _state, keep=95),
        column("HOST", lambda p: p.host, keep=70, shrink_to=12),
        column("PID", lambda p: str(p.pid), keep=20),
        column("DEVICE", _device, keep=80),
        column("GPU", _gpu_cell, keep=45, shrink_to=12),
        column("MEMORY", _memory, keep=60),
        # A silent process's time up ends where it went silent.
        column("UP", lambda p: age((p.last_seen if p.stale else now) - (p.started_at or p.registered_at)), keep=30),
        column("STEPS", lambda p: "-" if p.steps is None else f"{p.steps:,}", keep=75),
        column("SPEED", _speed, keep=72),
        column("MOVES", lambda p: _moves(p.capabilities), keep=40),
        column("DOING", _doing, keep=85, optional=True),
        column("COMMAND", lambda p: clip(_command_line(p.cmdline), COMMAND_WIDTH) or "-", keep=10, shrink_to=20),
    ]
    if len({p.host for p in processes}) == 1:
        columns = [c for c in columns if c.header != "HOST"]
    return columns


def _state(p: wire.ProcessInfo) -> str:
    if p.token_revoked:
        return f"{p.state} (token revoked)"
    return f"{p.state} (token expired)" if p.token_expired else p.state


def _device(p: wire.ProcessInfo) -> str:
    device = p.logical_device or "-"
    if p.physical_device and p.physical_device != p.logical_device:
        device += f" (on {p.physical_device})"
    return device


def _memory(p: wire.ProcessInfo) -> str:
    if p.state == "PAUSED" and p.footprint_bytes:
        return f"{gib(p.footprint_bytes)} paused"
    return gib(p.memory_bytes or 0)


def _speed(p: wire.ProcessInfo) -> str:
    """Steps per second while it trains (a paused or silent process's last rate is no speed)."""
    per_s = p.steps_per_s
    if per_s is None or p.state != "RUNNING":
        return "-"
    return f"{per_s:.2f}/s" if per_s < 10 else f"{per_s:.1f}/s" if per_s < 100 else f"{per_s:.0f}/s"


def _doing(p: wire.ProcessInfo) -> str:
    active = p.active_command
    return f"{active.kind} {active.state}" if active else ("waiting for room" if p.wait_id else "-")


def _command_line(cmdline: str) -> str:
    """The job's command line with its program by name (``python train.py``, not the
    interpreter's full path), so that the part that tells jobs apart fits the column."""
    program, _, rest = cmdline.partition(" ")
    return f"{program.rsplit('/', 1)[-1]} {rest}".strip()


def _short_key(key: str) -> str:
    """A job's key as a column shows it: enough to tell runs apart."""
    return key if len(key) <= KEY_WIDTH else key[: KEY_WIDTH - 1] + "~"


def _gpu_cell(p: wire.ProcessInfo) -> str:
    """Its GPU's index and model, and how many more GPUs it holds memory on."""
    if p.gpu_index is None and not p.gpu_model:
        return "-"
    cell = f"{'' if p.gpu_index is None else p.gpu_index} {p.gpu_model}".strip()
    more = len(p.other_gpus)
    return f"{cell} (+{count(more, 'GPU')})" if more else cell


def _moves(capabilities: wire.ProcessCapabilities) -> str:
    """What the process can be moved by, in a word (the --json capabilities say why not)."""
    if not capabilities.pause_resume:
        return "-"
    if not capabilities.migration:
        return "pause"
    return "fast" if capabilities.fast_path else "driver"


def _devices(api: ApiClient, args: argparse.Namespace) -> int:
    answer = api.devices(host=args.host)
    if args.json:
        print_json(answer)
        return EXIT_OK
    if not answer.hosts:
        if args.host:
            print(
                f"no GPUs reported by host {args.host!r} in workspace '{api.workspace}' "
                "(`flexium devices` lists them all)"
            )
        else:
            print(f"no GPUs reported in workspace '{api.workspace}' (processes report their host's GPUs)")
        return EXIT_OK
    now = time.time()
    for i, host in enumerate(answer.hosts):
        if i:
            print()
        stale = "  STALE: no report recently" if host.stale else ""
        print(f"host {host.host} (reported {age(now - host.updated_at)} ago){stale}")
        rows = [
            (
                "GPU",
                "MODEL",
                "USED / TOTAL",
                "FLEXIUM",
                "OTHER",
                "RESERVED",
                "UTIL",
                "TEMP",
                "HEALTH",
                "UUID",
                "PROCESSES",
            )
        ]
        for d in host.devices:
            rows.append(
                (
                    "-" if d.index is None else str(d.index),
                    d.name or "-",
                    f"{d.memory_used / GIB:.1f} / {d.memory_total / GIB:.1f} GiB",
                    gib(d.memory_flexium or 0),
                    gib(d.memory_other or 0),
                    gib(d.memory_reserved) if d.memory_reserved else "-",
                    "-" if d.utilization is None else f"{d.utilization}%",
                    "-" if d.temperature is None else f"{d.temperature}C",
                    f"{d.health}, drained" if d.drained else d.health,
                    d.uuid,
                    ",".join(d.processes) or "-",
                )
            )
        print_table(rows, indent="  ")
        for d in host.devices:
            if d.drained:
                print(f"  GPU {'-' if d.index is None else d.index}: {d.drained}")
    if any(d.memory_reserved for host in answer.hosts for d in host.devices):
        print("RESERVED: held for jobs not on the GPU yet (flexium run, --make-room); `flexium queue` lists them")
    return EXIT_OK
