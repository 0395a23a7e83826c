"""`flexium demo`: a server on its default SQLite file, the default workspace's token, and a
small training job attached to it with a job token of its own; prints a dashboard login link
(a one-time code) and the admin token for the CLI. Ctrl-C stops the job (it unregisters), then
the server, and revokes the job's token.

Both run as child processes in sessions of their own, so that Ctrl-C in the terminal reaches
only this process, which stops them in that order.
"""

from __future__ import annotations

import errno
import importlib.util
import os
import shlex
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path
from typing import TYPE_CHECKING, Any

from flexium import protocol
from flexium.cli.server_extra import server_module

if TYPE_CHECKING:
    from flexium.client import ApiClient

SERVER_START_S = 60.0
JOB_REGISTER_S = 120.0
STOP_S = 10.0


def _say(text: str) -> None:
    print(f"flexium demo: {text}", flush=True)


def _port_free(host: str, port: int) -> bool:
    with socket.socket(socket.AF_INET6 if ":" in host else socket.AF_INET) as s:
        # As the server binds (uvicorn sets it): a port left in TIME_WAIT by the last demo is free.
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            s.bind((host, port))
        except OSError as exc:
            if exc.errno == errno.EADDRINUSE:
                return False
            raise
    return True


def _demo_token(database_url: str) -> tuple[str, bool]:
    """(an admin token of workspace 'default', whether to revoke it at the end). A new database
    gets the default workspace here, and its first token is the user's to keep."""
    from flexium.server import database_admin
    from flexium.server.app import bootstrap
    from flexium.server.errors import NotFound

    db = database_admin.open_database(database_url, create=True)  # before its server first starts
    try:
        first = bootstrap(db)
    finally:
        db.dispose()
    if first is not None:
        return first, False
    try:
        return database_admin.issue_token(
            protocol.DEFAULT_WORKSPACE, name="flexium demo", role=protocol.ROLE_ADMIN, database_url=database_url
        ).token, True
    except NotFound:
        return database_admin.create_workspace(protocol.DEFAULT_WORKSPACE, database_url=database_url), False


def _stop(proc: subprocess.Popen[Any] | None, sig: int) -> int | None:
    if proc is None:
        return None
    if proc.poll() is None:
        proc.send_signal(sig)
        try:
            proc.wait(STOP_S)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
    return proc.returncode


def _raise_interrupt(*_: Any) -> None:
    raise KeyboardInterrupt


def _simulated_host(requested: bool, data_dir: Path) -> dict[str, str] | None:
    """The environment that puts the demo's job on the simulated host, or None for this host's
    own GPUs: the simulation is used where NVML sees no NVIDIA GPU, or when asked for."""
    from flexium import simulated
    from flexium.engine import nvml

    if not requested and nvml.host_gpus():
        return None
    library = simulated.library_path()
    if library is None:
        _say(f"no {simulated.LIBRARY_NAME} in this build: the job runs on this host as it is")
        return None
    host_dir = data_dir / "simulated-host"
    host_dir.mkdir(exist_ok=True)
    return simulated.environment(library, host_dir)


def run(
    *, port: int | None = None, host: str = "127.0.0.1", database: str | None = None, simulated: bool = False
) -> int:
    if importlib.util.find_spec("torch") is None:
        print(
            "flexium demo: the demo training job needs PyTorch: pip install torch (a CPU build is enough)",
            file=sys.stderr,
        )
        return 2
    if server_module("flexium.server.app") is None:
        return 2
    from flexium.server.db import DatabaseUnavailable, SchemaTooNew
    from flexium.server.settings import default_data_dir, load_settings

    if port == 0:
        print("flexium demo: --port 0: the demo's job needs to know the port: give one, 1 to 65535", file=sys.stderr)
        return 2
    port = protocol.DEFAULT_PORT if port is None else port
    try:
        settings = load_settings(database_url=database, host=host, port=port)
    except ValueError as exc:
        print(f"flexium demo: {exc}", file=sys.stderr)
        return 2
    if not _port_free(host, port):
        print(
            f"flexium demo: port {port} on {host} is in use (another flexium server?); choose another with --port",
            file=sys.stderr,
        )
        return 1
    from flexium.server import sole_server
    from flexium.server.settings import sqlite_file

    database_file = sqlite_file(settings.database_url)
    serving = sole_server.serving_link(database_file) if database_file is not None else None
    if serving is not None:
        print(
            f"flexium demo: a flexium server already serves the demo's database {database_file} (its dashboard: "
            f"{serving}), another flexium demo likely: use that one, or stop it first (Ctrl-C where it runs); "
            "or give this demo a database of its own with --database sqlite:///other.db",
            file=sys.stderr,
        )
        return 1
    try:
        token, revoke = _demo_token(settings.database_url)
        from flexium.server import database_admin, storage

        # The jobs get what a job needs, and no more: their tokens cannot command or mint. The demo's job
        # and the jobs of yours started with the line it prints each have their own, so that the audit
        # log tells them apart.
        job_token, your_token = (
            database_admin.issue_token(
                protocol.DEFAULT_WORKSPACE, name=name, role=protocol.ROLE_JOB, database_url=settings.database_url
            ).token
            for name in ("flexium demo job", "your jobs beside flexium demo")
        )
    except (DatabaseUnavailable, SchemaTooNew) as exc:
        print(f"flexium demo: cannot use the database: {exc}", file=sys.stderr)
        return 1

    from flexium.cli.connection import connect
    from flexium.client import ServerError
    from flexium.wire import ProcessInfo

    data_dir = Path(default_data_dir())
    data_dir.mkdir(parents=True, exist_ok=True)
    log_path = data_dir / "demo-server.log"
    link_host = "127.0.0.1" if host in ("0.0.0.0", "::", "") else host
    address = f"[{link_host}]:{port}" if ":" in link_host else f"{link_host}:{port}"
    api = connect(f"{address}/{protocol.DEFAULT_WORKSPACE}", token)
    server: subprocess.Popen[Any] | None = None
    job: subprocess.Popen[Any] | None = None
    registered: ProcessInfo | None = None
    # Set before the children start, so that they begin with the default actions: a demo started
    # in the background (`flexium demo &`) inherits SIGINT ignored, and so would they.
    previous = {sig: signal.signal(sig, _raise_interrupt) for sig in (signal.SIGINT, signal.SIGTERM)}
    status = 0
    printed_your_token = False
    # The log is kept across demos: what this server says starts here.
    log_start = log_path.stat().st_size if log_path.exists() else 0
    try:
        with open(log_path, "ab") as log:
            server = subprocess.Popen(
                [
                    sys.executable,
                    "-m",
                    "flexium.server",
                    "--host",
                    host,
                    "--port",
                    str(port),
                    "--database",
                    settings.database_url,
                ],
                stdout=log,
                stderr=subprocess.STDOUT,
                stdin=subprocess.DEVNULL,
                start_new_session=True,
            )
        deadline = time.monotonic() + SERVER_START_S
        while True:
            if server.poll() is not None:
                tail = log_path.read_bytes()[log_start:].decode(errors="replace").splitlines()[-15:]
                print("flexium demo: the server did not start:\n  " + "\n  ".join(tail), file=sys.stderr)
                return 1
            try:
                api.health(timeout=1.0)
                break
            except ServerError:
                if time.monotonic() > deadline:
                    print(
                        f"flexium demo: the server did not answer within {SERVER_START_S:.0f} s; see {log_path}",
                        file=sys.stderr,
                    )
                    return 1
                time.sleep(0.2)
        base = f"http://{address}"
        _say(f"server {base} (pid {server.pid}; database {settings.database_url}; log {log_path})")
        code = database_admin.login_code(token, database_url=settings.database_url)
        minutes = storage.LOGIN_CODE_TTL_S / 60
        _say(f"dashboard: {base}/login#code={code}  (works once, within {minutes:.0f} min; else paste the token below)")

        env = dict(os.environ)
        env[protocol.SERVER_ENV] = f"{address}/{protocol.DEFAULT_WORKSPACE}"
        env[protocol.TOKEN_ENV] = job_token
        simulation = _simulated_host(simulated, data_dir)
        if simulation is not None:
            env.update(simulation)
            _say(
                "SIMULATED: no NVIDIA GPU is used; the job runs on a simulated host with two simulated GPUs "
                "(flexium's test double of the driver; the job computes on the CPU). Moves you make there "
                "are real commands with simulated results: no GPU, no measured downtime"
            )
        job = subprocess.Popen(
            [sys.executable, "-m", "flexium.cli.demo_job"], env=env, stdin=subprocess.DEVNULL, start_new_session=True
        )
        _say(f"demo training job started (pid {job.pid}); waiting for it to register")
        deadline = time.monotonic() + JOB_REGISTER_S
        while registered is None and job.poll() is None and time.monotonic() < deadline:
            try:
                processes = api.list_processes(retries=0, timeout=5.0)
            except ServerError:
                processes = []
            registered = next((p for p in processes if p.pid == job.pid), None)
            if registered is None:
                time.sleep(0.5)
        if registered is not None:
            on = (
                f"{registered.physical_device}, {registered.gpu_model}"
                if registered.gpu_model
                else registered.physical_device
            )
            _say(f"job {registered.process_id} registered ({registered.state} on {on})")
            if simulation is not None:
                _say(f"try: flexium migrate {registered.process_id} cuda:1   (or Pause / Migrate in the dashboard)")
        else:
            _say("the job has not registered yet; see its output above")
        server_env = f"{protocol.SERVER_ENV}={address}/{protocol.DEFAULT_WORKSPACE}"
        _say(f"admin token (for the CLI and the dashboard): {token}")
        _say(f"try: {server_env} {protocol.TOKEN_ENV}={token} flexium ps")
        job_env = f"{server_env} {protocol.TOKEN_ENV}={your_token}"
        if simulation is None:
            _say(f"a job of yours: {job_env} python train.py  (a job token)")
        else:
            on_host = " ".join(f"{name}={shlex.quote(value)}" for name, value in simulation.items())
            _say(
                f"a job of yours on the simulated host: {job_env} {on_host} python train.py  (a job token; its "
                "tensors stay on the CPU: the simulated GPUs hold none, see flexium.simulated)"
            )
        printed_your_token = True
        _say("Ctrl-C stops the job and the server")
        while True:
            if job.poll() is not None:
                _say(f"the demo job ended (exit status {job.returncode})")
                status = 0 if job.returncode == 0 else 1
                break
            if server.poll() is not None:
                _say(f"the server ended (exit status {server.returncode}); see {log_path}")
                status = 1
                break
            time.sleep(0.5)
    except KeyboardInterrupt:
        print(flush=True)
        _say("stopping")
    finally:
        try:
            if _stop(job, signal.SIGINT) == -signal.SIGKILL and registered is not None:
                _forget(api, registered.process_id)  # it could not unregister: no STALE row for the next demo
            _stop(server, signal.SIGTERM)
            _revoke(job_token, settings.database_url)
            if _revoke(your_token, settings.database_url) and printed_your_token:
                _say(
                    "the job token it printed is revoked: a job of yours started with it trains on without the "
                    "server (start it again with a token of a running server)"
                )
            if revoke:
                _revoke(token, settings.database_url)
        except KeyboardInterrupt:
            for proc in (job, server):
                if proc is not None and proc.poll() is None:
                    proc.kill()
        finally:
            for sig, handler in previous.items():
                signal.signal(sig, handler)
            api.close()
    _say("stopped")
    return status


def _forget(api: ApiClient, process_id: str) -> None:
    from flexium.client import ServerError

    try:
        api.unregister(process_id, timeout=5.0)
    except ServerError as exc:
        print(f"flexium demo: could not remove the demo job from the server: {exc}", file=sys.stderr)


def _revoke(token: str, database_url: str) -> bool:
    """Whether it is revoked now."""
    from flexium.server import database_admin

    try:
        database_admin.revoke_token(protocol.DEFAULT_WORKSPACE, token, database_url=database_url)
    except Exception as exc:  # the demo is over either way; say so and move on
        print(f"flexium demo: could not revoke the demo token: {exc}", file=sys.stderr)
        return False
    return True
