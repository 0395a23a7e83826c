"""Helpers of the end-to-end tests: a real ``flexium server`` process, real training processes
(``train_job.py``: CPU torch + ``flexium.init()``, optionally on the fake driver) and the
real ``flexium`` command. Everything listens on 127.0.0.1 only; every wait is bounded.
(Imported by name: pytest puts this folder on sys.path.)"""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any, Optional

import requests

import fake_driver  # tests/ is on sys.path: tests/conftest.py
from live_server import (  # noqa: F401  (free_port: for the tests)
    ProcessOutput,
    ServerProcess,
    clean_env,
    flexium_command,
    free_port,
    wait_until,
)

HERE = Path(__file__).resolve().parent
TRAIN_JOB = HERE / "train_job.py"
WORKSPACE = "e2e"
HEARTBEAT_S = 0.5


Output = ProcessOutput  # the e2e tests' name for it


class Server:
    """``python -m flexium.server`` (what ``flexium server`` runs) on a SQLite file; restartable
    on the same port and database."""

    def __init__(self, tmp: Path, *, port: Optional[int] = None) -> None:
        self.tmp = tmp
        self.home = tmp / "home"
        self.home.mkdir(parents=True, exist_ok=True)
        self.database = f"sqlite:///{tmp / 'server.db'}"
        self.child = ServerProcess(
            self.home,
            "--heartbeat-interval",
            str(HEARTBEAT_S),
            "--stale-after",
            "20",
            database=self.database,
            port=port,
            env=clean_env(self.home),
        )
        self.token: Optional[str] = None

    @property
    def port(self) -> int:
        return self.child.port

    @property
    def url(self) -> str:
        return self.child.url

    @property
    def address(self) -> str:
        return f"127.0.0.1:{self.port}/{WORKSPACE}"

    @property
    def api(self) -> str:
        return f"{self.url}/api/w/{WORKSPACE}"

    def create_workspace(self) -> str:
        """``flexium workspace create`` on the database (the server need not run)."""
        done = subprocess.run(
            [*flexium_command(), "workspace", "create", WORKSPACE, "--database", self.database],
            env=clean_env(self.home),
            capture_output=True,
            text=True,
            timeout=60,
        )
        assert done.returncode == 0, done.stderr
        self.token = done.stdout.strip().splitlines()[-1]
        assert self.token.startswith("flx_"), done.stdout
        return self.token

    def start(self, timeout: float = 60.0) -> "Server":
        self.child.start(timeout)
        return self

    def stop(self, sig: int = signal.SIGTERM, timeout: float = 20.0) -> None:
        self.child.stop(sig, timeout)

    def headers(self, token: Optional[str] = None) -> dict[str, str]:
        return {"Authorization": f"Bearer {token or self.token}"}

    def get(self, path: str, **kw: Any) -> requests.Response:
        return requests.get(
            self.api + path, headers=kw.pop("headers", self.headers()), timeout=kw.pop("timeout", 10), **kw
        )

    def post(self, path: str, json: Any = None, **kw: Any) -> requests.Response:
        return requests.post(self.api + path, json=json, headers=kw.pop("headers", self.headers()), timeout=10, **kw)

    def process(self, process_id: str) -> Optional[dict[str, Any]]:
        r = self.get(f"/processes/{process_id}")
        return r.json() if r.status_code == 200 else None

    def cli(
        self, *args: str, timeout: float = 60.0, env: Optional[dict[str, str]] = None
    ) -> subprocess.CompletedProcess[str]:
        run_env = clean_env(self.home)
        run_env["FLEXIUM_SERVER"] = self.address
        run_env["FLEXIUM_TOKEN"] = self.token or ""
        run_env.update(env or {})
        return subprocess.run(
            [*flexium_command(), *args], env=run_env, capture_output=True, text=True, timeout=timeout, cwd=self.home
        )


class Job:
    """A training process (tests/e2e/train_job.py)."""

    def __init__(
        self,
        server: Server,
        *,
        fake: bool,
        memory_mib: int = 1024,
        address: Optional[str] = None,
        extra_env: Optional[dict[str, str]] = None,
    ) -> None:
        self.server = server
        self.control = server.tmp / f"control-{time.monotonic_ns()}"
        library = fake_driver.build()
        env = clean_env(server.home)
        if fake:
            env.update(
                {
                    k: v
                    for k, v in fake_driver.subprocess_env(library).items()
                    if k in ("FLEXIUM_LIBCUDA", "FLEXIUM_LIBNVML", "PYTHONPATH")
                }
            )
        else:
            # NVML only: the job sees the host's GPUs but has no driver to move itself with.
            env["FLEXIUM_LIBNVML"] = str(library)
        env["FLEXIUM_SERVER"] = address or server.address
        env["FLEXIUM_TOKEN"] = server.token or ""
        env["E2E_JOB_MEMORY_MIB"] = str(memory_mib)
        env["E2E_CONTROL"] = str(self.control)
        env["E2E_PRINT_EVERY"] = "5"
        env.update(extra_env or {})
        self.proc = subprocess.Popen(
            [sys.executable, str(TRAIN_JOB)],
            env=env,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
            cwd=server.home,
        )
        self.output = Output(self.proc)
        match = self.output.wait_for(r"^init (\S+) (gpu-[0-9a-f]+)$", 60)
        self.init_seconds = float(match.group(1))
        self.process_id = match.group(2)

    def steps(self) -> int:
        numbers = [int(m.group(1)) for line in self.output.lines if (m := re.match(r"^step (\d+) ", line))]
        return max(numbers, default=0)

    def wait_registered(self, timeout: float = 20.0) -> dict[str, Any]:
        return wait_until(
            lambda: self.server.process(self.process_id), timeout, f"process {self.process_id} to register"
        )

    def arm_failure(self, function: str, code: str) -> None:
        start = len(self.output.lines)
        self.control.write_text(f"fail {function} {code}\n")
        self.output.wait_for(r"^control done$", 20, start=start)

    def stop(self, timeout: float = 20.0) -> int:
        if self.proc.poll() is None:
            os.kill(self.proc.pid, signal.SIGCONT)
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(timeout)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
                raise AssertionError("the training process did not exit:\n" + self.output.text[-3000:]) from None
        return int(self.proc.returncode)
