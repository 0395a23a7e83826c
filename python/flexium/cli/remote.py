"""`flexium ps | devices | migrate | pause | resume`: the server's view and its commands, from
a terminal or a script (``--json``). Every request goes through ``flexium.client.ApiClient``.

Exit status: 0 done; 1 refused or failed (the reason on stderr); 2 bad usage or settings;
3 the server could not be reached.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from typing import Any, Callable, Optional, Sequence, TypeVar, Union

from pydantic import BaseModel, ValidationError

from flexium import protocol, wire
from flexium.client import ApiClient, NotFound, ServerError, Unauthorized, Unreachable
from flexium.errors import ConfigError
from flexium.units import gib

EXIT_OK = 0
EXIT_FAILED = 1
EXIT_USAGE = 2
EXIT_UNREACHABLE = 3

GIB = float(1 << 30)
KEY_WIDTH = 16  # of a job's key in `flexium ps`
COMMAND_WIDTH = 80  # of a job's command line in `flexium ps` (--json has all of it)
DEFAULT_WAIT_S = 300.0
# While a command is under way the CLI says so on stderr at each change, and this often between.
PROGRESS_EVERY_S = 10.0
# A command or a job operation, long-polled until it ends.
_Polled = TypeVar("_Polled", wire.CommandInfo, wire.JobOperationInfo)

_UNDER_WAY = {
    "queued": "queued; the process takes it at its next poll",
    "delivered": "delivered to the process",
    "running": "running in the process (a migrate or pause acts at its next optimizer step, its safe point)",
}


# The server reads a target this way, and only the server (it resolves it to a GPU UUID).
PROCESS_HELP = "process id (gpu-...), a unique prefix of one, or its pid; a rank of a job of several stands for its job"
TARGET_HELP = (
    "the GPU: cuda:N = the job's own CUDA numbering (entry N of the GPUs it sees), a bare "
    "number N = nvidia-smi's index N on the job's host, GPU-... = a GPU UUID"
)


def add_connection_options(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--server",
        metavar="ADDRESS",
        help=f"host[:port]/workspace (default ${protocol.SERVER_ENV}, else 'server:' in .flexiumrc)",
    )
    parser.add_argument("--token", help=f"workspace token (default ${protocol.TOKEN_ENV}, else 'token:' in .flexiumrc)")
    parser.add_argument("--json", action="store_true", help="print JSON (the server's objects) for scripts")


def add_commands(commands: Any) -> None:
    p = commands.add_parser("ps", help="list the workspace's training processes")
    p.add_argument("--state", choices=protocol.DISPLAY_STATES, help="only processes in this state")
    add_connection_options(p)
    p = commands.add_parser("devices", help="list the GPUs the workspace's processes report, by host")
    p.add_argument("--host", help="only this host")
    add_connection_options(p)
    p = commands.add_parser(
        "migrate",
        help="move a running process to another GPU and wait for the outcome (a rank of a job: that rank, or --ranks)",
    )
    p.add_argument("process", help=PROCESS_HELP)
    p.add_argument("target", nargs="?", help=TARGET_HELP + " (a rank of a job: where that rank goes)")
    _add_ranks_option(p)
    p.add_argument(
        "--gpus",
        metavar="GPU=GPU,...",
        help=(
            "one process on several GPUs: where the memory on each GPU it uses goes, GPUs named as TARGET, "
            "e.g. cuda:0=cuda:2,cuda:1=cuda:3; GPUs left out stay"
        ),
    )
    _add_wait_options(p)
    p = commands.add_parser(
        "pause", help="pause a process (its GPU memory is freed) and wait for the outcome (a rank: its whole job)"
    )
    p.add_argument("process", help=PROCESS_HELP)
    _add_wait_options(p)
    p = commands.add_parser(
        "resume", help="resume a paused process, on its GPU or the one given (a rank: its whole job)"
    )
    p.add_argument("process", help=PROCESS_HELP)
    p.add_argument(
        "target", nargs="?", help=TARGET_HELP + " (default: where it paused if there is room, else the server picks)"
    )
    _add_ranks_option(p)
    _add_wait_options(p)


def _add_ranks_option(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--ranks",
        metavar="RANK=GPU,...",
        help=(
            "a rank of a job of several: a GPU for each rank that moves, in the named process's numbering, "
            "e.g. 0=cuda:1,1=cuda:0 (a swap); ranks left out stay where they are"
        ),
    )


def _add_wait_options(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--timeout",
        type=float,
        default=DEFAULT_WAIT_S,
        metavar="SECONDS",
        help=f"how long to wait for the outcome (default {DEFAULT_WAIT_S:.0f})",
    )
    parser.add_argument("--no-wait", action="store_true", help="print the queued command and return")
    add_connection_options(parser)


def run(args: argparse.Namespace) -> int:
    try:
        api = connect(args.server, args.token)
    except ConfigError as exc:
        return _fail(str(exc), EXIT_USAGE, as_json=args.json, code="bad_settings")
    try:
        if args.command == "ps":
            return _ps(api, args)
        if args.command == "devices":
            return _devices(api, args)
        return _command(api, args)
    except Unreachable as exc:
        return _fail(
            f"{exc.message} (is `flexium server` running there?)", EXIT_UNREACHABLE, as_json=args.json, code=exc.code
        )
    except Unauthorized as exc:
        return _fail(_token_problem(api, exc), EXIT_FAILED, as_json=args.json, code=exc.code)
    except ServerError as exc:
        return _fail(exc.message, EXIT_FAILED, as_json=args.json, code=exc.code)
    except _UsageError as exc:
        return _fail(str(exc), EXIT_USAGE, as_json=args.json, code="bad_usage")
    except ValidationError as exc:  # what the server would refuse as invalid_request
        first = exc.errors()[0]
        message = f"{'.'.join(str(p) for p in first['loc'])}: {first['msg']}"
        return _fail(message, EXIT_FAILED, as_json=args.json, code="invalid_request")
    finally:
        api.close()


def _token_problem(api: ApiClient, refused: Unauthorized) -> str:
    """A refused token, said in the CLI's terms (where a token comes from), not HTTP's."""
    where = f"{protocol.TOKEN_ENV}, --token or 'token:' in .flexiumrc"
    if refused.status == 403:
        return f"the token is not allowed to do this in workspace '{api.workspace}': {refused.message}"
    if not api.token:
        return (
            f"no token for workspace '{api.workspace}': set {where} (`flexium server` prints the first token "
            "when it creates a workspace; `flexium token issue WORKSPACE` makes another)"
        )
    return (
        f"the server at {api.base_url} does not accept this token for workspace '{api.workspace}' "
        f"(wrong, revoked, or of another workspace): set {where} to a token of workspace '{api.workspace}'"
    )


def connect(server: Optional[str], token: Optional[str]) -> ApiClient:
    from flexium import __version__
    from flexium.config import load_config, parse_server_address

    if server is not None:
        parse_server_address(server, where="(from --server)")
    config = load_config(orchestrator=server, token=token)
    if config.address is None:
        raise ConfigError(
            f"no server configured: set {protocol.SERVER_ENV}=host[:port]/workspace "
            "(e.g. 127.0.0.1:8080/default), 'server:' in .flexiumrc, or pass --server"
        )
    return ApiClient(config.address, config.token or None, user_agent=f"flexium/{__version__} (cli)")


def _fail(message: str, status: int, *, as_json: bool = False, code: str = "failed") -> int:
    """The reason on stderr; under --json also a JSON object on stdout, so that a script reading
    stdout sees why nothing else came."""
    if as_json:
        print(json.dumps({"error": code, "message": message, "exit_status": status}, indent=2, sort_keys=True))
    print(f"flexium: {message}", file=sys.stderr)
    return status


def _print_json(value: BaseModel | Sequence[BaseModel]) -> None:
    data = value.model_dump(mode="json") if isinstance(value, BaseModel) else [v.model_dump(mode="json") for v in value]
    print(json.dumps(data, indent=2, sort_keys=True))


# ---- ps, devices ---------------------------------------------------------------------------


def _ps(api: ApiClient, args: argparse.Namespace) -> int:
    processes = api.list_processes(state=args.state)
    if args.json:
        _print_json(processes)
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
                _age(now - started),
                _moves(p.capabilities),
                doing,
                _clip(_command_line(p.cmdline), COMMAND_WIDTH) or "-",
            )
        )
    _print_table(rows)
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
        _print_json(answer)
        return EXIT_OK
    if not answer.hosts:
        print(f"no GPUs reported in workspace '{api.workspace}' (processes report their host's GPUs)")
        return EXIT_OK
    now = time.time()
    for i, host in enumerate(answer.hosts):
        if i:
            print()
        stale = "  STALE: no report recently" if host.stale else ""
        print(f"host {host.host} (reported {_age(now - host.updated_at)} ago){stale}")
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
        _print_table(rows, indent="  ")
    return EXIT_OK


# ---- migrate, pause, resume ----------------------------------------------------------------


def _command(api: ApiClient, args: argparse.Namespace) -> int:
    target = getattr(args, "target", None)
    ranks_text, gpus_text = getattr(args, "ranks", None), getattr(args, "gpus", None)
    ranks = _parse_pairs("--ranks", ranks_text, "RANK=GPU, e.g. 0=cuda:1,1=cuda:0") if ranks_text is not None else None
    gpus = _parse_pairs("--gpus", gpus_text, "GPU=GPU, e.g. cuda:0=cuda:2,cuda:1=cuda:3") if gpus_text else None
    if sum(given is not None and given != "" for given in (target, ranks, gpus)) > 1:
        raise _UsageError(
            "give a TARGET (where the process goes), --ranks (several ranks of a job) or --gpus (the GPUs of one "
            "process on several), not both"
        )
    if args.command == "migrate" and not target and ranks is None and gpus is None:
        raise _UsageError(
            "migrate needs a TARGET, or --ranks RANK=GPU,... for a rank of a job of several, or --gpus GPU=GPU,... "
            "for a process on several GPUs"
        )
    for named in [target, *(ranks or {}).values(), *(gpus or {}), *(gpus or {}).values()]:
        if named:
            _check_target(str(named))
    request = wire.CommandRequest(
        kind=args.command, process_id=args.process, target=target or None, ranks=ranks, gpus=gpus
    )
    try:
        command = api.create_command(request)
    except NotFound:
        request.process_id = _resolve_process(api, args.process)
        command = api.create_command(request)
    if command.job is not None:
        return _job_operation(api, args, command.job.operation_id)
    title = _title(api, command)
    if args.no_wait:
        if args.json:
            _print_json(command)
        else:
            print(f"{title}: queued as command {command.id}")
        return EXIT_OK
    final = _wait(api, command, args.timeout, progress=None if args.json else _progress_printer(title, command))
    if args.json:
        _print_json(final)
    if final.state not in protocol.FINAL_COMMAND_STATES:
        return _fail(
            f"{title}: still {final.state} after {args.timeout:.0f} s (command {final.id}); see `flexium ps`",
            EXIT_FAILED,
        )
    if not args.json:
        _print_outcome(api, title, final)
    if final.state != "succeeded":
        if args.json:
            print(f"flexium: {title} {final.state}: {_reason(final)}", file=sys.stderr)
        return EXIT_FAILED
    return EXIT_OK


class _UsageError(ValueError):
    pass


def _check_target(text: str) -> None:
    try:
        protocol.read_target(text)
    except ValueError as exc:
        raise _UsageError(str(exc)) from None


def _parse_pairs(option: str, text: str, form: str) -> dict[str, Union[int, str]]:
    """``0=cuda:1,1=cuda:0`` -> {"0": "cuda:1", "1": "cuda:0"} (the server judges the rest)."""
    pairs: dict[str, Union[int, str]] = {}
    for part in text.split(","):
        key, sep, gpu = part.partition("=")
        if not sep or not key.strip() or not gpu.strip():
            raise _UsageError(f"{option} {text!r}: each entry is {form}")
        pairs[key.strip()] = gpu.strip()
    return pairs


# ---- job operations ------------------------------------------------------------------------


def _job_operation(api: ApiClient, args: argparse.Namespace, operation_id: int) -> int:
    """Every rank's share of a job operation, waited for together; one line per rank."""
    operation = api.get_operation(operation_id)
    title = _job_title(api, operation)
    if args.no_wait:
        if args.json:
            _print_json(operation)
        else:
            ids = ", ".join(str(c.id) for c in operation.commands)
            print(f"{title}: queued as job operation {operation.id} (commands {ids})")
        return EXIT_OK
    final = _wait_operation(api, operation, args.timeout, progress=None if args.json else _job_progress(title))
    if args.json:
        _print_json(final)
    if final.finished_at is None:
        return _fail(
            f"{title}: still {final.state} after {args.timeout:.0f} s (job operation {final.id}); see `flexium ps`",
            EXIT_FAILED,
        )
    if not args.json:
        _print_job_outcome(api, title, final)
    if final.state != "succeeded":
        reasons = "; ".join(f"rank {_rank(c)}: {_reason(c)}" for c in final.commands if c.state != "succeeded")
        print(f"flexium: {title} failed: {reasons}", file=sys.stderr)
        return EXIT_FAILED
    return EXIT_OK


def _wait_operation(
    api: ApiClient,
    operation: wire.JobOperationInfo,
    timeout: float,
    progress: Optional[Callable[[wire.JobOperationInfo], None]] = None,
) -> wire.JobOperationInfo:
    """As ``_wait``, for every rank's command of a job operation."""
    return _poll_until(
        operation,
        ended=lambda o: o.finished_at is not None,
        ask=lambda wait, deadline: api.wait_operation(operation.id, wait=wait, deadline=deadline),
        timeout=timeout,
        progress=progress,
    )


def _rank(command: wire.CommandInfo) -> str:
    return "?" if command.job is None else str(command.job.rank)


def _job_progress(title: str) -> Callable[[wire.JobOperationInfo], None]:
    """Prints on stderr where each rank's command stands, at each change and every
    PROGRESS_EVERY_S between."""
    started = time.monotonic()
    said, said_at = "", started

    def show(operation: wire.JobOperationInfo) -> None:
        nonlocal said, said_at
        now = time.monotonic()
        states = ", ".join(f"rank {_rank(c)} {c.state}" for c in operation.commands)
        if states == said and now - said_at < 0.9 * PROGRESS_EVERY_S:
            return
        said, said_at = states, now
        print(f"{title}: {states} ({now - started:.0f} s)", file=sys.stderr, flush=True)

    return show


def _job_title(api: ApiClient, operation: wire.JobOperationInfo) -> str:
    """ "migrate job run-7f3a (2 ranks): rank 0 to cuda:1, rank 1 to cuda:0": each target in the
    moving rank's own numbering where it sees the GPU."""
    title = f"{operation.kind} job {operation.job_key} ({operation.world_size} ranks)"
    if not operation.moves:
        return title
    visible = {c.job.rank: c.process_id for c in operation.commands if c.job is not None}
    try:
        processes = {p.process_id: p for p in api.list_processes()}
    except ServerError:
        processes = {}
    moves = []
    for rank, uuid in sorted(operation.moves.items(), key=lambda item: int(item[0])):
        process = processes.get(visible.get(int(rank), ""))
        shown = wire.cuda_ordinal(process.visible_gpus, uuid) if process is not None else None
        moves.append(f"rank {rank} to {shown or uuid}")
    return f"{title}: {', '.join(moves)}"


def _print_job_outcome(api: ApiClient, title: str, operation: wire.JobOperationInfo) -> None:
    total = (operation.finished_at or time.time()) - operation.created_at
    print(f"{title}: {operation.state} in {total:.2f} s (job operation {operation.id})")
    try:
        processes = {p.process_id: p for p in api.list_processes()}
    except ServerError:
        processes = {}
    rows = [("RANK", "PROCESS", "COMMAND", "STATE", "GPU", "PATH", "TIME", "ERROR")]
    for command in operation.commands:
        process = processes.get(command.process_id)
        gpu = "-"
        if process is not None and process.gpu_uuid:
            index = "" if process.gpu_index is None else f" (GPU {process.gpu_index})"
            gpu = f"{process.physical_device}{index}"
        result = command.result
        seconds = result.seconds if result is not None else None
        rows.append(
            (
                _rank(command),
                command.process_id,
                command.state,
                process.state if process is not None else "-",
                gpu,
                (result.path if result is not None else None) or "-",
                "-" if seconds is None else _ms(seconds),
                _reason(command) if command.state != "succeeded" else "",
            )
        )
    _print_table(rows, indent="  ")


def _resolve_process(api: ApiClient, text: str) -> str:
    """A unique id prefix or a pid stands for the process (ids are long to type)."""
    matches = [
        p.process_id
        for p in api.list_processes()
        if p.process_id.startswith(text) or p.process_id == f"gpu-{text}" or (text.isdigit() and str(p.pid) == text)
    ]
    if len(matches) == 1:
        return matches[0]
    if not matches:
        raise NotFound(
            f"no process {text!r} in workspace '{api.workspace}' (`flexium ps` lists them)",
            code="not_found",
            status=404,
        )
    raise NotFound(f"{text!r} matches several processes: {', '.join(sorted(matches))}", code="not_found", status=404)


def _wait(
    api: ApiClient,
    command: wire.CommandInfo,
    timeout: float,
    progress: Optional[Callable[[wire.CommandInfo], None]] = None,
) -> wire.CommandInfo:
    """Long-polls the command until it ends or `timeout` passes; `progress(command)` is called
    with each answer while it is under way (each change, and every PROGRESS_EVERY_S between)."""
    return _poll_until(
        command,
        ended=lambda c: c.state in protocol.FINAL_COMMAND_STATES,
        ask=lambda wait, deadline: api.wait_command(command.id, wait=wait, deadline=deadline),
        timeout=timeout,
        progress=progress,
    )


def _poll_until(
    first: _Polled,
    *,
    ended: Callable[[_Polled], bool],
    ask: Callable[[float, float], _Polled],
    timeout: float,
    progress: Optional[Callable[[_Polled], None]],
) -> _Polled:
    """`ask(wait, deadline)` the server's long-poll again until `ended` or `timeout` passes."""
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


def _progress_printer(title: str, queued: wire.CommandInfo) -> Callable[[wire.CommandInfo], None]:
    """Prints on stderr where a command stands: at each change of state, and every
    PROGRESS_EVERY_S while it stays the same (a 64 GiB pause prepares for half a minute)."""
    started = time.monotonic()
    said_state, said_at = "", started

    def show(command: wire.CommandInfo) -> None:
        nonlocal said_state, said_at
        now = time.monotonic()
        state = command.state
        if state == said_state and now - said_at < 0.9 * PROGRESS_EVERY_S:
            return
        said_state, said_at = state, now
        doing = _UNDER_WAY.get(state, state)
        print(f"{title}: command {queued.id} {doing} ({now - started:.0f} s)", file=sys.stderr, flush=True)

    return show


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


def _reason(command: wire.CommandInfo) -> str:
    if command.state == "expired":
        return "the process did not take the command in time (it stopped listening?)"
    return command.error or "no reason given"


def _print_outcome(api: ApiClient, title: str, command: wire.CommandInfo) -> None:
    created, delivered = command.created_at, command.delivered_at
    started, finished = command.started_at, command.finished_at
    total = (finished or time.time()) - created
    print(f"{title}: {command.state} in {total:.2f} s")
    parts = []
    if delivered is not None:
        parts.append(f"delivered {_ms(delivered - created)} after it was queued")
    if started is not None and delivered is not None:
        parts.append(f"started {_ms(started - delivered)} later")
    if finished is not None and started is not None:
        parts.append(f"done {_ms(finished - started)} after that (includes the wait for a safe point)")
    if parts:
        print("  " + "; ".join(parts))
    result = command.result
    steps = [s for s in result.steps if not s.rollback] if result is not None else []
    if result is not None and steps:
        line = ", ".join(f"{s.step} {_ms(s.seconds)}" + ("" if s.ok else " FAILED") for s in steps)
        moved = result.bytes_moved
        seconds = result.seconds or 0.0
        speed = f", {moved / 1e9 / seconds:.1f} GB/s" if moved and seconds else ""
        path = f"{result.path} path, " if result.path else ""
        print(f"  operation {_ms(seconds)}, {path}({line}); {gib(moved or 0)} moved{speed}")
        for note in result.notes:
            print(f"  note: {note}")
    if command.state != "succeeded":
        print(f"  reason: {_reason(command)}", file=sys.stderr)
    try:
        process = api.get_process(command.process_id)
    except ServerError:
        return
    where = process.physical_device or process.logical_device
    gpu = f" ({process.gpu_uuid}, nvidia-smi index {process.gpu_index})" if process.gpu_uuid else ""
    if process.state == "PAUSED":
        print(f"  the process is PAUSED on {where}{gpu}; it needs {gib(process.footprint_bytes or 0)} to resume")
    elif process.state == protocol.FAILED:
        print("  the process is FAILED: an earlier rollback failed and it may be stuck; restart the job")
    else:
        print(f"  the process is {process.state} on {where}{gpu}")


# ---- formatting ----------------------------------------------------------------------------


def _ms(seconds: float) -> str:
    ms = max(0.0, seconds) * 1e3
    return f"{ms:.1f} ms" if ms < 10 else f"{ms:.0f} ms" if ms < 10_000 else f"{seconds:.1f} s"


def _age(seconds: float) -> str:
    seconds = max(0.0, seconds)
    if seconds < 120:
        return f"{seconds:.0f}s"
    if seconds < 7200:
        return f"{seconds / 60:.0f}m"
    if seconds < 172800:
        return f"{seconds / 3600:.0f}h"
    return f"{seconds / 86400:.0f}d"


def _print_table(rows: Sequence[Sequence[str]], indent: str = "") -> None:
    widths = [max(len(row[i]) for row in rows) for i in range(len(rows[0]))]
    for row in rows:
        print(indent + "  ".join(cell.ljust(width) for cell, width in zip(row, widths, strict=True)).rstrip())
