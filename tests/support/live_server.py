"""A real flexium server in a child process, for the server, end-to-end and browser tests:
``python -m flexium.server`` (what ``flexium server`` runs) on 127.0.0.1 and a free port, its
output collected line by line, restartable on the same port and database. Every wait is bounded."""

from __future__ import annotations

import os
import re
import signal
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import requests

_TOKEN_LINE = re.compile(r"flx_[A-Za-z0-9_-]+")
_LOGIN_LINK = re.compile(r"Log in to the dashboard: (\S+)")


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def listens_on(pid: int, port: int) -> bool:
    """Whether process `pid` holds a listening TCP socket on `port` (Linux's /proc)."""
    inodes = set()
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        try:
            rows = Path(table).read_text().splitlines()[1:]
        except OSError:
            continue
        for row in rows:
            fields = row.split()
            if fields[3] == "0A" and int(fields[1].rsplit(":", 1)[1], 16) == port:  # 0A: LISTEN
                inodes.add(f"socket:[{fields[9]}]")
    try:
        fds = list(Path(f"/proc/{pid}/fd").iterdir())
    except OSError:
        return False
    for fd in fds:
        try:
            if os.readlink(fd) in inodes:
                return True
        except OSError:
            continue
    return False


class _PortTaken(Exception):
    """The server could not bind the port chosen for it: another process took it meanwhile."""


def flexium_command() -> list[str]:
    """The `flexium` command of this interpreter's environment."""
    script = Path(sys.executable).with_name("flexium")
    return [str(script)] if script.exists() else [sys.executable, "-m", "flexium.cli.main"]


def clean_env(home: Path) -> dict[str, str]:
    """This environment without flexium's or the fake driver's settings, with a home of its own
    (no ~/.flexiumrc of the machine applies), and without a terminal's size: pytest-xdist's
    workers set COLUMNS, which the command line's tables would fit instead of printing whole lines
    to a pipe."""
    env = {
        k: v
        for k, v in os.environ.items()
        if not k.startswith(("FLEXIUM_", "FAKE_CUDA_", "FAKE_NVML_"))
        and k not in ("GPU_DEVICE", "CI_FLEXIUM", "COLUMNS", "LINES")
    }
    env["HOME"] = str(home)
    env["FLEXIUM_HOME"] = str(home / ".flexium")
    env["PYTHONUNBUFFERED"] = "1"
    return env


def wait_until(condition: Callable[[], Any], timeout: float, what: str, interval: float = 0.05) -> Any:
    deadline = time.monotonic() + timeout
    while True:
        value = condition()
        if value:
            return value
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout:.0f} s waiting for {what}")
        time.sleep(interval)


class ProcessOutput:
    """A child's combined output, collected by a thread; lines are searchable as they come."""

    def __init__(self, proc: subprocess.Popen[str]) -> None:
        self.lines: list[str] = []
        self._proc = proc
        self._thread = threading.Thread(target=self._read, daemon=True)
        self._thread.start()

    def _read(self) -> None:
        assert self._proc.stdout is not None
        with self._proc.stdout:  # closed at its end: a pipe left to the collector warns in a later test
            for line in self._proc.stdout:
                self.lines.append(line.rstrip("\n"))

    @property
    def text(self) -> str:
        return "\n".join(self.lines)

    def wait_closed(self, timeout: float = 5.0) -> None:
        """Until the child's output has been read to its end (after the child exited)."""
        self._thread.join(timeout)

    def wait_for(self, pattern: str, timeout: float, start: int = 0) -> re.Match[str]:
        regex = re.compile(pattern)

        def find() -> re.Match[str] | None:
            for line in self.lines[start:]:
                match = regex.search(line)
                if match:
                    return match
            if self._proc.poll() is not None and not self._thread.is_alive():
                raise AssertionError(
                    f"process exited ({self._proc.returncode}) before printing {pattern!r}:\n" + self.text[-3000:]
                )
            return None

        return wait_until(find, timeout, f"{pattern!r} in the output:\n{self.text[-2000:]}")

    def wait_for_or_show_where(self, pattern: str, timeout: float) -> re.Match[str]:
        """`wait_for`; a child still silent after `timeout` is ended, and the failure says whether it
        worked or waited (its CPU time against the time it lived, the load average) and where each
        of its threads was: with PYTHONFAULTHANDLER=1 in its environment, SIGABRT makes Python write
        the stacks before it dies."""
        try:
            return self.wait_for(pattern, timeout)
        except AssertionError:
            if self._proc.poll() is not None:
                raise
            usage = _cpu_use(self._proc.pid)
            self._proc.send_signal(signal.SIGABRT)
            try:
                self._proc.wait(10)
            except subprocess.TimeoutExpired:
                self._proc.kill()
                self._proc.wait()
            self.wait_closed()
            # Its first lines too: the line that did not match is there when the child went on past it.
            text = self.text
            shown = text if len(text) <= 8000 else f"{text[:3000]}\n[...]\n{text[-5000:]}"
            raise AssertionError(
                f"no line matched {pattern!r} in {timeout:.0f} s; {usage}; load average {os.getloadavg()[0]:.1f} on "
                f"{os.cpu_count()} cores. Its output and stacks:\n{shown}"
            ) from None


def _cpu_use(pid: int) -> str:
    """How much CPU a live process has used in the time it has lived (Linux's /proc)."""
    try:
        fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
        uptime = float(Path("/proc/uptime").read_text().split()[0])
    except OSError as exc:
        return f"its CPU use could not be read ({exc})"
    ticks = os.sysconf("SC_CLK_TCK")
    # Fields after the name, counted from 0 at the state: utime 11, stime 12, starttime 19 (proc(5)).
    user, system, started = int(fields[11]) / ticks, int(fields[12]) / ticks, int(fields[19]) / ticks
    return (
        f"it was in state {fields[0]}, had used {user:.1f} s of CPU in Python and libraries and "
        f"{system:.1f} s in the kernel in the {uptime - started:.1f} s it lived"
    )


def start_demo(home: Path) -> tuple[subprocess.Popen[str], ProcessOutput, int, dict[str, str]]:
    """`flexium demo` in a fresh `home` (made here) on a free port: the process, its combined
    output as it comes, the port and the environment it runs with."""
    home.mkdir()
    port = free_port()
    env = clean_env(home)
    demo = subprocess.Popen(
        [*flexium_command(), "demo", "--port", str(port)],
        env=env,
        cwd=home,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )
    return demo, ProcessOutput(demo), port, env


class ServerProcess:
    """The server with its home folder (``FLEXIUM_HOME``) and, unless ``database`` names one,
    the SQLite file the server makes there. ``env`` replaces the inherited environment (which is
    otherwise used without any ``FLEXIUM_`` variable); ``prefix`` goes before the command (e.g.
    ``prlimit`` with its options)."""

    def __init__(
        self,
        home: Path | str,
        *args: str,
        database: str | None = None,
        port: int | None = None,
        env: dict[str, str] | None = None,
        prefix: tuple[str, ...] = (),
    ) -> None:
        self.home = Path(home)
        self.prefix = list(prefix)
        self.args = list(args)
        self.database = database
        self.port = port or free_port()
        # A port found free may be taken before the server binds it (by any process on the
        # machine): a port of our choosing is chosen again until the server first starts.
        self._port_is_ours_to_choose = port is None
        self._stopped = False  # by stop(), since the last start
        self.env = env
        self.proc: subprocess.Popen[str] | None = None
        self.output: ProcessOutput | None = None

    @property
    def url(self) -> str:
        scheme = "https" if "--certfile" in self.args else "http"
        return f"{scheme}://127.0.0.1:{self.port}"

    @property
    def lines(self) -> list[str]:
        """What the server printed since its last start."""
        return self.output.lines if self.output is not None else []

    @property
    def stalls(self) -> list[str]:
        """The warnings of this run's event loop watcher (server/loop_watch.py): when the server
        answered nothing, for how long, and why."""
        return [line for line in self.lines if "event loop did not run" in line]

    @property
    def token(self) -> str | None:
        """The workspace token this run printed (a restart on the same database prints none)."""
        tokens = [line.strip() for line in self.lines if _TOKEN_LINE.fullmatch(line.strip())]
        return tokens[-1] if tokens else None

    def issue_job_token(self, name: str = "training job") -> str:
        """A job token of the default workspace, issued through the API with the printed admin
        token: what training jobs are handed (as the README says)."""
        assert self.token, "the server printed no admin token (a restart on the same database prints none)"
        answer = requests.post(
            f"{self.url}/api/w/default/tokens",
            json={"name": name, "role": "job"},
            headers={"Authorization": f"Bearer {self.token}"},
            timeout=10,
        )
        assert answer.status_code == 201, answer.text
        return str(answer.json()["token"])

    @property
    def login_link(self) -> str | None:
        links = [m.group(1) for line in self.lines if (m := _LOGIN_LINK.search(line))]
        return links[-1] if links else None

    def start(self, timeout: float = 60.0, *, healthy: bool = True) -> ServerProcess:
        """Starts the server and waits until /healthz answers 200 (``healthy=False``: answers at
        all, for a server whose database is meant to fail the check) from this very process: an
        answer from another process that holds the port does not count."""
        for _attempt in range(3):
            try:
                self._start_once(timeout, healthy)
            except _PortTaken:
                self.port = free_port()
                continue
            self._port_is_ours_to_choose = False
            return self
        raise AssertionError("three free ports were taken before the server could bind them:\n" + "\n".join(self.lines))

    def check_alive(self) -> None:
        """Fails, with what the server printed, where it exited without being stopped."""
        if self.proc is not None and self.proc.poll() is not None and not self._stopped:
            assert self.output is not None
            self.output.wait_closed()
            raise AssertionError(f"the server exited ({self.proc.returncode}) by itself:\n{self.output.text[-6000:]}")

    def _start_once(self, timeout: float, healthy: bool) -> None:
        self.home.mkdir(parents=True, exist_ok=True)
        if self.env is not None:
            env = dict(self.env)
        else:
            env = {k: v for k, v in os.environ.items() if not k.startswith("FLEXIUM_")}
            env["FLEXIUM_HOME"] = str(self.home)
        env["PYTHONUNBUFFERED"] = "1"
        cmd = [
            *self.prefix,
            sys.executable,
            "-m",
            "flexium.server",
            "--host",
            "127.0.0.1",
            "--port",
            str(self.port),
            *self.args,
        ]
        if self.database:
            cmd += ["--database", self.database]
        self.proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env)
        self.output = ProcessOutput(self.proc)
        self._stopped = False
        proc, output = self.proc, self.output

        def answers() -> bool:
            if proc.poll() is not None:
                output.wait_closed()
                if self._port_is_ours_to_choose and "address already in use" in output.text.lower():
                    raise _PortTaken()
                raise AssertionError("server exited:\n" + output.text)
            try:
                status = requests.get(self.url + "/healthz", timeout=1).status_code
            except requests.RequestException:
                return False
            return (status == 200 or not healthy) and listens_on(proc.pid, self.port)

        wait_until(answers, timeout, "the server to answer /healthz")

    def stop(self, sig: int = signal.SIGTERM, timeout: float = 20.0) -> float:
        """Sends `sig` and waits; returns the seconds until the process exited. A server that
        does not exit in time is killed and the test fails. Then ``lines`` hold all it printed
        (the reader may be behind the exit on a busy machine)."""
        started = time.monotonic()
        self._stopped = True
        if self.proc is not None and self.proc.poll() is None:
            self.proc.send_signal(sig)
            try:
                self.proc.wait(timeout)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
                raise AssertionError(f"the server did not exit within {timeout:.0f} s of signal {sig}") from None
        stopped_after = time.monotonic() - started
        if self.output is not None:
            self.output.wait_closed()
        return stopped_after

    def restart(self) -> ServerProcess:
        self.stop()
        return self.start()
