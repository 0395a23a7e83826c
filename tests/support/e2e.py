"""Helpers of the end-to-end tests: a real ``flexium server`` process, real training processes
(``jobs/train_job.py``: CPU torch + ``flexium.init()``, optionally on the fake driver) and the
real ``flexium`` command. Everything listens on 127.0.0.1 only; every wait is bounded."""

from __future__ import annotations

import contextlib
import os
import re
import signal
import subprocess
import sys
import time
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any
from unittest import mock

import requests

from support import fake_driver
from support.live_server import (  # noqa: F401  (free_port: for the tests)
    ProcessOutput,
    ServerProcess,
    clean_env,
    flexium_command,
    free_port,
    wait_until,
)

JOBS = Path(__file__).resolve().parent / "jobs"
TRAIN_JOB = JOBS / "train_job.py"
WORKSPACE = "e2e"
HEARTBEAT_S = 0.5


Output = ProcessOutput  # the e2e tests' name for it


class Server:
    """``python -m flexium.server`` (what ``flexium server`` runs) on a SQLite file (or the database
    given: several servers may share one); restartable on the same port and database."""

    def __init__(
        self,
        tmp: Path,
        *,
        port: int | None = None,
        options: Sequence[str] = ("--stale-after", "20"),
        database: str | None = None,
    ) -> None:
        self.tmp = tmp
        self.home = tmp / "home"
        self.home.mkdir(parents=True, exist_ok=True)
        self.database = database or f"sqlite:///{tmp / 'server.db'}"
        self.child = ServerProcess(
            self.home,
            "--heartbeat-interval",
            str(HEARTBEAT_S),
            *options,
            database=self.database,
            port=port,
            env=clean_env(self.home),
        )
        self.token: str | None = None  # the workspace's first token: an admin token, for the CLI
        self.job_token: str | None = None  # what training jobs are handed (as the README says)

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
        """The workspace and a job token for the training jobs, on the database (the server need
        not run), made by what ``flexium workspace create`` and ``flexium token issue --role job``
        call, in this process and in the environment they would have: the two commands cost 2 to 3
        CPU-seconds per test module. The commands themselves are tested where they are the subject
        (test_starts_and_stops.py, tests/server/test_live_server.py)."""
        from flexium.server import database_admin

        with mock.patch.dict(os.environ, clean_env(self.home), clear=True):
            self.token = database_admin.create_workspace(WORKSPACE, database_url=self.database)
            self.job_token = database_admin.issue_token(
                WORKSPACE, role="job", name="e2e jobs", database_url=self.database
            ).token
        return self.token

    def start(self, timeout: float = 60.0) -> Server:
        self.child.start(timeout)
        return self

    def stop(self, sig: int = signal.SIGTERM, timeout: float = 20.0) -> None:
        self.child.stop(sig, timeout)

    @contextlib.contextmanager
    def serving(self, stop_signal: int = signal.SIGTERM) -> Iterator[Server]:
        """Its workspace made and the server started for the block, then stopped (stop_checked)."""
        self.create_workspace()
        self.start()
        yield self
        self.stop_checked(stop_signal)

    def stop_checked(self, sig: int = signal.SIGTERM) -> None:
        """Stops the server, failing (with what it printed) where it had exited by itself."""
        try:
            self.child.check_alive()
        finally:
            self.stop(sig)

    def headers(self, token: str | None = None) -> dict[str, str]:
        return {"Authorization": f"Bearer {token or self.token}"}

    def get(self, path: str, **kw: Any) -> requests.Response:
        return requests.get(
            self.api + path, headers=kw.pop("headers", self.headers()), timeout=kw.pop("timeout", 10), **kw
        )

    def post(self, path: str, json: Any = None, **kw: Any) -> requests.Response:
        return requests.post(self.api + path, json=json, headers=kw.pop("headers", self.headers()), timeout=10, **kw)

    def process(self, process_id: str) -> dict[str, Any] | None:
        r = self.get(f"/processes/{process_id}")
        return r.json() if r.status_code == 200 else None

    def cli(
        self, *args: str, timeout: float = 60.0, env: dict[str, str] | None = None
    ) -> subprocess.CompletedProcess[str]:
        run_env = clean_env(self.home)
        run_env["FLEXIUM_SERVER"] = self.address
        run_env["FLEXIUM_TOKEN"] = self.token or ""
        run_env.update(env or {})
        return subprocess.run(
            [*flexium_command(), *args], env=run_env, capture_output=True, text=True, timeout=timeout, cwd=self.home
        )


def ps_row(table: str, process_id: str) -> dict[str, str]:
    """The cells of `process_id`'s row in `flexium ps` output, by column name (the table is
    aligned: each column starts where its header does)."""
    lines = table.splitlines()
    header = lines[0]
    row = next(line for line in lines if line.startswith(process_id))
    names = header.split()
    starts: list[int] = []
    for name in names:
        starts.append(header.index(name, starts[-1] + 1 if starts else 0))
    ends: list[int | None] = [*starts[1:], None]
    return {name: row[start:end].strip() for name, start, end in zip(names, starts, ends, strict=True)}


class Job:
    """A training process (tests/support/jobs/train_job.py)."""

    def __init__(
        self,
        server: Server,
        *,
        fake: bool,
        memory_mib: int = 1024,
        address: str | None = None,
        extra_env: dict[str, str] | None = None,
        script: Path = TRAIN_JOB,
        args: Sequence[str | bytes] = (),
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
        env["FLEXIUM_TOKEN"] = server.job_token or ""
        env["E2E_JOB_MEMORY_MIB"] = str(memory_mib)
        env["E2E_CONTROL"] = str(self.control)
        env["E2E_PRINT_EVERY"] = "5"
        env["PYTHONFAULTHANDLER"] = "1"  # where it was, should it not start (wait_for_or_show_where)
        env.update(extra_env or {})
        self.proc = subprocess.Popen(
            [sys.executable, script, *args],
            env=env,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
            cwd=server.home,
        )
        self.output = Output(self.proc)
        match = self.output.wait_for_or_show_where(r"^init (\S+) (gpu-[0-9a-f]+)$", 60)
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


class FakeRank:
    """One rank of a torchrun job, reduced to what it says over HTTP: it registers with the
    job's key, beats, long-polls and answers each command as a rank would (running, then its
    outcome, and where it is after). ``fail_next``: the error its next command fails with."""

    def __init__(
        self,
        server: Server,
        rank: int,
        *,
        world: int = 2,
        key: str = "run-e2e-7f3a",
        gpus: int = 4,
        job_operations: bool = True,
        problems: list[str] | None = None,
    ) -> None:
        import threading

        self.server = server
        self.rank = rank
        self.process_id = f"{key}-rank-{rank}"
        self.gpu = f"GPU-e2e-{rank}"
        self.state = "RUNNING"
        self.visible = [f"GPU-e2e-{i}" for i in range(gpus)]
        self.fail_next: str | None = None
        self.received: list[dict[str, Any]] = []
        self.errors: list[str] = []
        self.stop = threading.Event()
        self.body: dict[str, Any] = {
            "process_id": self.process_id,
            "host": "e2e-node",
            "user": "alice",
            "pid": 5000 + rank,
            "gpu_model": "NVIDIA H200",
            "logical_device": "cuda:0",
            "visible_gpus": self.visible,
            "capabilities": {
                "pause_resume": job_operations,
                "migration": job_operations,
                "job_operations": job_operations,
                "problems": problems or [],
            },
            "cmdline": "torchrun --nproc-per-node 2 train_ddp.py",
            "job": {"key": key, "rank": rank, "world_size": world, "local_rank": rank, "local_world_size": world},
        }
        self.threads = [
            threading.Thread(target=self._beat, daemon=True),
            threading.Thread(target=self._poll, daemon=True),
        ]

    def devices(self) -> list[dict[str, Any]]:
        return [
            {"uuid": uuid, "index": i, "name": "NVIDIA H200", "memory_total": 140 << 30, "memory_used": 0}
            for i, uuid in enumerate(self.visible)
        ]

    def start(self) -> FakeRank:
        body = {**self.body, "gpu_uuid": self.gpu, "state": self.state, "memory_bytes": 8 << 30}
        r = self.server.post("/processes", {**body, "devices": self.devices()})
        assert r.status_code in (200, 201), r.text
        for thread in self.threads:
            thread.start()
        return self

    def close(self) -> None:
        self.stop.set()
        for thread in self.threads:
            thread.join(10)
        requests.delete(f"{self.server.api}/processes/{self.process_id}", headers=self.server.headers(), timeout=10)

    def _beat(self) -> None:
        while not self.stop.wait(HEARTBEAT_S):
            try:
                self.server.post(f"/processes/{self.process_id}/heartbeat", {"state": self.state})
            except requests.RequestException as exc:
                self.errors.append(f"heartbeat: {exc}")

    def _poll(self) -> None:
        while not self.stop.is_set():
            try:
                r = self.server.get(f"/processes/{self.process_id}/commands/next", params={"wait": 1}, timeout=10)
            except requests.RequestException as exc:
                self.errors.append(f"poll: {exc}")
                continue
            if r.status_code == 200:
                self._run(r.json())

    def _report(self, command_id: int, body: dict[str, Any]) -> None:
        r = self.server.post(f"/commands/{command_id}/report", body)
        if r.status_code != 200:
            self.errors.append(f"report {command_id}: {r.status_code} {r.text}")

    def _run(self, command: dict[str, Any]) -> None:
        self.received.append(command)
        self._report(command["id"], {"state": "running"})
        if self.fail_next is not None:
            error, self.fail_next = self.fail_next, None
            self._report(command["id"], {"state": "failed", "error": error, "process": {"state": self.state}})
            return
        self.state = {"migrate": "RUNNING", "pause": "PAUSED", "resume": "RUNNING"}[command["kind"]]
        self.gpu = command.get("target_uuid") or self.gpu
        result = {"kind": command["kind"], "ok": True, "seconds": 0.25 + self.rank / 100}
        if command["kind"] != "pause":
            result["path"] = "fast"
        update = {"state": self.state, "gpu_uuid": self.gpu, "memory_bytes": 0 if self.state == "PAUSED" else 8 << 30}
        self._report(command["id"], {"state": "succeeded", "result": result, "process": update})
