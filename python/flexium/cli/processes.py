"""`flexium ps | devices`: the workspace's training processes, and the GPUs they report by host."""

from __future__ import annotations

import argparse
import time
from typing import Any

from flexium import protocol, wire
from flexium.cli.connection import add_connection_options
from flexium.cli.exit_status import EXIT_OK
from flexium.cli.printing import age, print_json, print_table
from flexium.client import ApiClient
from flexium.units import GIB, gib

KEY_WIDTH = 16  # of a job's key in `flexium ps`
COMMAND_WIDTH = 80  # of a job's command line in `flexium ps` (--json has all of it)


def add_commands(commands: Any) -> None:
    """``commands``: the ``flexium`` parser's subparsers."""
    p = commands.add_parser("ps", help="list the workspace's training processes")
    p.add_argument("--state", choices=protocol.DISPLAY_STATES, help="only processes in this state")
    add_connection_options(p, _ps)
    p = commands.add_parser("devices", help="list the GPUs the workspace's processes report, by host")
    p.add_argument("--host", help="only this host")
    add_connection_options(p, _devices)


def _ps(api: ApiClient, args: argparse.Namespace) -> int:
    processes = api.list_processes(state=args.state)
    if args.json:
        print_json(processes)
        return EXIT_OK
    if not processes:
        print(f"no processes in workspace '{api.workspace}' at {api.base_url}")
        return EXIT_OK
    now = time.time()
    rows = [
        (
            "PROCESS",
            "NAME",
            "JOB",
            "RANK",
            "STATE",
            "HOST",
            "PID",
            "DEVICE",
            "GPU",
            "MEMORY",
            "UP",
            "MOVES",
            "DOING",
            "COMMAND",
        )
    ]
    for p in processes:
        device = p.logical_device or "-"
        if p.physical_device and p.physical_device != p.logical_device:
            device += f" (on {p.physical_device})"
        gpu = _gpu_cell(p)
        memory = gib(p.memory_bytes or 0)
        if p.state == "PAUSED" and p.footprint_bytes:
            memory += f" ({gib(p.footprint_bytes or 0)} paused)"
        active = p.active_command
        doing = f"{active.kind} {active.state}" if active else "-"
        started = p.started_at or p.registered_at
        rows.append(
            (
                p.process_id,
                p.name or "-",
                _short_key(p.job.key) if p.job else "-",
                f"{p.job.rank}/{p.job.world_size}" if p.job else "-",
                p.state,
                p.host,
                str(p.pid),
                device,
                gpu,
                memory,
                age(now - started),
                _moves(p.capabilities),
                doing,
                _clip(_command_line(p.cmdline), COMMAND_WIDTH) or "-",
            )
        )
    print_table(rows)
    if any(p.job is not None and p.job.world_size > 1 for p in processes):
        print("JOB, RANK: the ranks of one job of several move together: pause or resume one of them acts on all")
    print(
        "MOVES: fast = migrate and pause on the fast path, driver = on the driver path only, pause = "
        "pause and resume only (driver below 580), - = none (`flexium ps --json` gives the reasons). "
        "DOING: the command under way."
    )
    return EXIT_OK


def _command_line(cmdline: str) -> str:
    """The job's command line with its program by name (``python train.py``, not the
    interpreter's full path), so that the part that tells jobs apart fits the column."""
    program, _, rest = cmdline.partition(" ")
    return f"{program.rsplit('/', 1)[-1]} {rest}".strip()


def _clip(text: str, width: int) -> str:
    return text if len(text) <= width else text[: width - 1] + "~"


def _short_key(key: str) -> str:
    """A job's key as a column shows it: enough to tell runs apart."""
    return key if len(key) <= KEY_WIDTH else key[: KEY_WIDTH - 1] + "~"


def _gpu_cell(p: wire.ProcessInfo) -> str:
    """Its GPU's index and model, and how many more GPUs it holds memory on."""
    if p.gpu_index is None and not p.gpu_model:
        return "-"
    cell = f"{'' if p.gpu_index is None else p.gpu_index} {p.gpu_model}".strip()
    more = len(p.other_gpus)
    return f"{cell} (+{more} GPU{'s' if more > 1 else ''})" if more else cell


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
        print(f"no GPUs reported in workspace '{api.workspace}' (processes report their host's GPUs)")
        return EXIT_OK
    now = time.time()
    for i, host in enumerate(answer.hosts):
        if i:
            print()
        stale = "  STALE: no report recently" if host.stale else ""
        print(f"host {host.host} (reported {age(now - host.updated_at)} ago){stale}")
        rows = [("GPU", "MODEL", "USED / TOTAL", "FLEXIUM", "OTHER", "UTIL", "TEMP", "HEALTH", "UUID", "PROCESSES")]
        for d in host.devices:
            rows.append(
                (
                    "-" if d.index is None else str(d.index),
                    d.name or "-",
                    f"{d.memory_used / GIB:.1f} / {d.memory_total / GIB:.1f} GiB",
                    gib(d.memory_flexium or 0),
                    gib(d.memory_other or 0),
                    "-" if d.utilization is None else f"{d.utilization}%",
                    "-" if d.temperature is None else f"{d.temperature}C",
                    d.health,
                    d.uuid,
                    ",".join(d.processes) or "-",
                )
            )
        print_table(rows, indent="  ")
    return EXIT_OK
