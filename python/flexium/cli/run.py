"""`flexium run -- python train.py`: a job started on the GPU of this host with the most room, or
once room appears (the server's placement queue, ``server/policies/placement.py``), or once room is
made for it (``--make-room``: jobs of lower priority paused). The job sees every GPU of its host
(CUDA_VISIBLE_DEVICES is left as it is: a job cannot move to a GPU it cannot see) and is told its
GPU through flexium's device setting, its priority, the server, a token (a job token minted for it
where the caller's token is an admin's, revoked when it ends) and its placement, whose held room
its registration takes. Its exit status is flexium run's; Ctrl-C reaches it."""

from __future__ import annotations

import argparse
import os
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from types import FrameType
from typing import Any

from flexium import protocol, simulated, wire
from flexium.cli.connection import add_connection_options
from flexium.cli.exit_status import EXIT_FAILED, EXIT_INTERRUPTED, UsageError, fail, request_body
from flexium.client import ApiClient, NotDelivered, ServerError, Unauthorized, Unavailable, Unreachable
from flexium.client.host import reported_host
from flexium.config import ENV_DEVICE
from flexium.units import read_size

ASK_EVERY_S = 0.5  # while it waits: how soon room that appears is seen
KEEP_ASKING_S = 2.0  # once started, until its job registers: the placement stays alive
TIDY_TIMEOUT_S = 3.0  # each attempt to close the placement and revoke the job's token, once it ended
# A server that cannot be reached when flexium run starts (restarting, upgraded) is tried again this
# long: a job script started meanwhile starts once it is back. Only a request that never reached it
# is sent again, so no placement is made twice.
SERVER_PATIENCE_S = 60.0
TRY_AGAIN_EVERY_S = 1.0


def add_commands(commands: Any) -> None:
    """``commands``: the ``flexium`` parser's subparsers."""
    p = commands.add_parser(
        "run",
        help="start a job on the GPU of this host with the most room, or wait for room: flexium run -- python train.py",
    )
    p.add_argument(
        "--gpu",
        default="auto",
        help="auto (the GPU with the most room), cuda:N (the job's CUDA numbering), N (nvidia-smi's index) or "
        "GPU-<uuid> (default: auto)",
    )
    p.add_argument("--memory", help="the GPU memory the job needs, e.g. 40GiB: it starts where that much is free")
    p.add_argument("--priority", help=f"the job's priority: {protocol.PRIORITY_SYNTAX} (default: normal)")
    p.add_argument(
        "--make-room",
        action="store_true",
        help="pause the fewest jobs of lower priority on one GPU to free --memory (an admin token)",
    )
    p.add_argument(
        "--reason",
        metavar="TEXT",
        help=f"why, in one line (at most {protocol.MAX_REASON_LEN} characters): kept on the placement and carried by "
        "the pauses --make-room sends, so the colleagues whose jobs pause see why",
    )
    p.add_argument(
        "--host",
        help="the host to run on, which is this one (on flexium's simulated driver: the simulated host to run on)",
    )
    p.add_argument("command", nargs=argparse.REMAINDER, help="-- then the job's command line")
    add_connection_options(p, _run, json_output=False)  # its output is its job's


@dataclass(frozen=True)
class HostGpus:
    """This host's GPUs as the job will see them: its CUDA ordinal of each UUID, nvidia-smi's index,
    and the report the server places by."""

    ordinals: dict[str, int]
    indexes: dict[int, str]
    reports: list[wire.GpuReport]

    @classmethod
    def read(cls) -> HostGpus:
        from flexium.engine import identity

        gpus = identity.snapshot_gpus()
        return cls(
            ordinals={gpu.uuid: gpu.ordinal for gpu in gpus},
            indexes={gpu.nvml_index: gpu.uuid for gpu in gpus if gpu.nvml_index is not None},
            reports=read_reports(),
        )

    def uuid_of(self, text: str) -> str | None:
        """The GPU ``--gpu`` names (None: auto)."""
        if text == "auto":
            return None
        try:
            named = protocol.read_target(text, ordinals=len(self.ordinals))
        except ValueError as exc:
            raise UsageError(f"--gpu: {exc}; or auto") from None
        if named.ordinal is not None:
            by_ordinal = {ordinal: uuid for uuid, ordinal in self.ordinals.items()}
            if named.ordinal not in by_ordinal:
                raise UsageError(
                    f"--gpu {text}: the job would see {len(by_ordinal)} GPU(s), cuda:0 to cuda:{len(by_ordinal) - 1}"
                )
            return by_ordinal[named.ordinal]
        if named.index is not None:
            if named.index not in self.indexes:
                raise UsageError(f"--gpu {text}: this host has no GPU with nvidia-smi index {named.index}")
            return self.indexes[named.index]
        if named.uuid not in self.ordinals:
            raise UsageError(f"--gpu {text}: not a GPU this host's jobs see")
        return named.uuid


def read_reports() -> list[wire.GpuReport]:
    """This host's GPUs now, as a job reports them (NVML)."""
    from flexium.client.reports import gpu_reports
    from flexium.engine import nvml

    return gpu_reports(nvml.host_gpus())


def _say(text: str) -> None:
    print(f"flexium run: {text}", file=sys.stderr, flush=True)


def _run(api: ApiClient, args: argparse.Namespace) -> int:
    command = args.command[1:] if args.command[:1] == ["--"] else args.command
    if not command:
        raise UsageError("no command to run: flexium run [options] -- python train.py")
    _choose_host(args.host)
    host = reported_host()
    try:
        gpus = HostGpus.read()
    except Exception as exc:  # no driver, no GPU: nothing to place on
        return fail(
            f"cannot read this host's GPUs, so there is nothing to place the job on: {exc} (on a machine without "
            "an NVIDIA GPU, put the variables of the simulated host that `flexium demo` prints before flexium run)",
            EXIT_FAILED,
        )
    try:
        priority = protocol.DEFAULT_PRIORITY if args.priority is None else protocol.read_priority(args.priority)
    except ValueError as exc:
        raise UsageError(f"--priority: {exc}") from None
    gpu_uuid = gpus.uuid_of(args.gpu)
    if gpu_uuid is None:
        gpu_uuid = _only_visible(gpus)
    request = request_body(
        wire.PlacementRequest,
        host=host,
        gpu_uuid=gpu_uuid,
        memory_bytes=0 if args.memory is None else _memory(args.memory),
        priority=priority,
        make_room=args.make_room,
        reason=args.reason,
        command=wire.clean_text(" ".join(command))[: protocol.MAX_LONG_TEXT],
        devices=gpus.reports,
    )
    with _sigterm_interrupts():
        try:
            created = _create_placement(api, request)
        except KeyboardInterrupt:
            _say("stopped before the server was reached: nothing was placed")
            return EXIT_INTERRUPTED
    placement = created.placement
    for pause in created.commands:
        _say(f"making room: pausing {pause.process_id} (command {pause.id})")
    try:
        with _sigterm_interrupts():
            placement = _wait_until_placed(api, placement)
    except KeyboardInterrupt:
        try:
            api.close_placement(placement.id, timeout=TIDY_TIMEOUT_S, retries=0)
        except ServerError as exc:
            _say(
                f"could not cancel placement {placement.id} ({exc.message}): "
                "the server ends it once flexium run is silent"
            )
        else:
            _say(f"placement {placement.id} cancelled")
        return EXIT_INTERRUPTED
    if placement.state != "placed" or placement.placed_uuid is None:
        return fail(
            f"placement {placement.id} is {placement.state}: {placement.note or 'no reason given'}", EXIT_FAILED
        )
    if placement.placed_uuid not in gpus.ordinals:  # placed by an older server, or the GPUs changed meanwhile
        _close(api, placement.id, None)
        return fail(
            f"placement {placement.id} is on GPU {placement.placed_index}, which this job cannot see "
            f"(CUDA_VISIBLE_DEVICES={os.environ.get('CUDA_VISIBLE_DEVICES', '')}); nothing was started: name a GPU "
            "it sees with --gpu cuda:N, or leave CUDA_VISIBLE_DEVICES unset",
            EXIT_FAILED,
        )
    _say(f"placement {placement.id}: {placement.note}")
    minted = None
    try:
        token, minted = _job_token(api, placement.id)
        env = dict(os.environ)
        env[ENV_DEVICE] = f"cuda:{gpus.ordinals[placement.placed_uuid]}"
        env[protocol.PLACEMENT_ENV] = str(placement.id)
        env["FLEXIUM_PRIORITY"] = str(priority)
        if args.server is not None:
            env[protocol.SERVER_ENV] = args.server
        if token is not None:
            env[protocol.TOKEN_ENV] = token
        return _run_child(api, command, env, placement.id)
    finally:
        _close(api, placement.id, minted)


@contextmanager
def _sigterm_interrupts() -> Iterator[None]:
    """SIGTERM (kill, timeout, a scheduler's stop) taken as Ctrl-C while no job runs yet: the placement is
    cancelled at once rather than left for the server to end once flexium run is silent."""

    def interrupt(signum: int, frame: FrameType | None) -> None:
        raise KeyboardInterrupt

    previous = signal.signal(signal.SIGTERM, interrupt)
    try:
        yield
    finally:
        signal.signal(signal.SIGTERM, previous)


def _memory(text: str) -> int:
    amount = text.strip()
    # A unit left out: 40 means 40 GiB to a person, 40 bytes to read_size.
    if amount.replace(".", "", 1).isdigit():
        raise UsageError(f"--memory {amount}: give its unit, e.g. {amount}GiB or {amount}MiB")
    try:
        return read_size(text)
    except ValueError as exc:
        raise UsageError(f"--memory: {exc}") from None


def _choose_host(host: str | None) -> None:
    """``--host``: this host by name, or the simulated host to run on (flexium's simulated driver)."""
    if host is None:
        return
    if simulated.drivers_simulated():
        os.environ[simulated.HOST_ENV] = host
        return
    here = reported_host()
    if host != here:
        raise UsageError(
            f"--host {host}: flexium run starts the job here, on host {here!r}; run it on {host!r} to place a job there"
        )


def _only_visible(gpus: HostGpus) -> str | None:
    """For --gpu auto: None (any GPU of the host) where the job sees them all; the one it sees where
    CUDA_VISIBLE_DEVICES leaves one; else a refusal before anything is asked of the server, which
    places on any GPU of the host (a job cannot run, nor move, on a GPU it cannot see)."""
    hidden = sorted(r.index if r.index is not None else r.uuid for r in gpus.reports if r.uuid not in gpus.ordinals)
    if not hidden:
        return None
    if len(gpus.ordinals) == 1:
        return next(iter(gpus.ordinals))
    raise UsageError(
        f"CUDA_VISIBLE_DEVICES={os.environ.get('CUDA_VISIBLE_DEVICES', '')} hides GPU(s) "
        f"{', '.join(map(str, hidden))} of this host from the job, and --gpu auto may place it on any: name one it "
        f"sees with --gpu cuda:N (N from 0 to {len(gpus.ordinals) - 1}), or leave CUDA_VISIBLE_DEVICES unset "
        "(flexium tells the job its GPU)"
    )


def _create_placement(api: ApiClient, request: wire.PlacementRequest) -> wire.PlacementCreated:
    """The placement, asked for until the server is reached or SERVER_PATIENCE_S pass (then its
    NotDelivered is raised: the command line says it cannot reach the server)."""
    give_up = time.monotonic() + SERVER_PATIENCE_S
    said = False
    while True:
        try:
            return api.create_placement(request)
        except NotDelivered as exc:
            if time.monotonic() + TRY_AGAIN_EVERY_S > give_up:
                raise
            if not said:
                _say(f"{exc.message}; trying again for up to {SERVER_PATIENCE_S:.0f} s (Ctrl-C stops)")
                said = True
            time.sleep(TRY_AGAIN_EVERY_S)


def _wait_until_placed(api: ApiClient, placement: wire.PlacementInfo) -> wire.PlacementInfo:
    """Asks until placed; a server that cannot be reached for a while (restarted) is asked again:
    the placement is a row, waiting for it in the queue as before."""
    said = None
    unreachable = False  # said once an outage
    while placement.state == "waiting":
        if placement.note != said:
            # Its place among the jobs waiting to start on its host; paused jobs waiting to resume are a list of
            # their own, which `flexium queue` shows above it.
            place = f" (number {placement.position} to start on {placement.host})" if placement.position else ""
            _say(f"placement {placement.id} waits{place}: {placement.note}")
            said = placement.note
        time.sleep(ASK_EVERY_S)
        try:
            placement = api.report_placement(placement.id, wire.PlacementReport(devices=read_reports()))
        except (Unreachable, Unavailable) as exc:
            if not unreachable:
                _say(f"placement {placement.id}: {exc.message}; asking again")
            unreachable = True
        else:
            unreachable = False
    return placement


def _job_token(api: ApiClient, placement_id: int) -> tuple[str | None, int | None]:
    """(the token the job is given, the id of one minted for it): a job token minted with the
    caller's admin token; the caller's own where it cannot mint (a job token, say)."""
    try:
        minted = api.issue_token(wire.TokenRequest(name=f"flexium run, placement {placement_id}", role="job"))
    except Unauthorized:
        return api.token, None
    return minted.token, minted.id


def _run_child(api: ApiClient, command: list[str], env: dict[str, str], placement_id: int) -> int:
    try:
        child = subprocess.Popen(command, env=env)
    except OSError as exc:
        return fail(f"cannot start {command[0]!r}: {exc}", EXIT_FAILED)

    def forward(signum: int, frame: FrameType | None) -> None:
        # Ctrl-C at a terminal reaches the job by itself (one process group); said to flexium
        # run alone (kill -INT), it is passed on.
        if signum != signal.SIGINT or not _terminal_sent_it():
            child.send_signal(signum)

    previous = {sig: signal.signal(sig, forward) for sig in (signal.SIGINT, signal.SIGTERM)}
    try:
        started = False
        while True:
            try:
                code = child.wait(KEEP_ASKING_S)
                break
            except subprocess.TimeoutExpired:
                pass
            if not started:
                started = _still_placed(api, placement_id)
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)
    return 128 - code if code < 0 else code


def _terminal_sent_it() -> bool:
    """Whether flexium run is in the terminal's foreground process group, where its job is too."""
    try:
        return os.tcgetpgrp(sys.stdin.fileno()) == os.getpgrp()
    except (OSError, ValueError):
        return False


def _still_placed(api: ApiClient, placement_id: int) -> bool:
    """Asks again so that the placement stays alive until its job registers; whether it did. One
    short attempt: a server that does not answer is asked again next round, and the job's end is
    seen meanwhile."""
    try:
        placement = api.report_placement(
            placement_id, wire.PlacementReport(devices=read_reports()), timeout=KEEP_ASKING_S, retries=0
        )
    except ServerError:
        return False
    return placement.state != "placed"


def _close(api: ApiClient, placement_id: int, minted: int | None) -> None:
    """The placement closed and the job token minted for it revoked, each tried briefly and on its
    own: a server that does not answer keeps flexium run no longer than a few seconds after its
    job (the server ends a placement whose flexium run went silent); a token it could not revoke
    is named, with how to revoke it."""
    try:
        api.close_placement(placement_id, timeout=TIDY_TIMEOUT_S, retries=1)
    except ServerError as exc:
        _say(f"could not close placement {placement_id} (the server ends it once flexium run is silent): {exc.message}")
    if minted is None:
        return
    try:
        api.revoke_token(minted, timeout=TIDY_TIMEOUT_S, retries=1)
    except ServerError as exc:
        _say(
            f"could not revoke the job token minted for the job, token {minted} ({exc.message}): it stays valid "
            f"until revoked: flexium token revoke {api.workspace} {minted}"
        )
