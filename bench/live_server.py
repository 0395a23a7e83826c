"""A real ``flexium server`` process on this machine (127.0.0.1 only) for the benchmarks, on a
fresh database: a SQLite file, or a new PostgreSQL database (``--postgres-url``, an admin URL;
else $FLEXIUM_TEST_POSTGRES_URL; else a throwaway cluster, tests/support/postgres_cluster.py, with
Debian's postgresql installed); or several (``Replicas``) on one PostgreSQL database behind
Debian's nginx, configured as docs/guide/server.md says (tests/support/nginx.py, which the tests
run too)."""

from __future__ import annotations

import collections
import contextlib
import os
import re
import signal
import socket
import subprocess
import sys
import threading
import time
import urllib.request
import uuid
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))
from support.nginx import NginxFront  # noqa: E402
from support.postgres_cluster import PostgresCluster  # noqa: E402


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


class Server:
    """The server on a free port; ``token`` is the admin token its first start on an empty
    database prints (empty for a server on a database another one set up), ``output`` the lines
    it printed after it (read on a thread: a full pipe would stop the server). ``options`` go to
    ``flexium server`` (the benchmark's quotas)."""

    def __init__(self, database_url: str, home: str, options: Sequence[str] = ()) -> None:
        self.port = free_port()
        env = {k: v for k, v in os.environ.items() if not k.startswith("FLEXIUM_")}
        env["FLEXIUM_HOME"] = home
        self.proc = subprocess.Popen(
            [
                sys.executable,
                "-m",
                "flexium.server",
                "--port",
                str(self.port),
                "--database",
                database_url,
                "--log-level",
                "warning",
                *options,
            ],
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
            env=env,
        )
        self.token = ""
        deadline = time.monotonic() + 60
        assert self.proc.stdout is not None
        said: list[str] = []
        while time.monotonic() < deadline:
            line = self.proc.stdout.readline()
            if not line:
                raise RuntimeError("server exited at start:\n" + "".join(said[-20:]))
            said.append(line)
            if re.fullmatch(r"flx_[A-Za-z0-9_-]+", line.strip()):
                self.token = line.strip()
            if line.startswith("flexium server: open file limit"):  # its last line before serving
                break
        self.output: collections.deque[str] = collections.deque(maxlen=50)
        threading.Thread(target=self._read_output, daemon=True).start()
        while time.monotonic() < deadline:
            try:
                with urllib.request.urlopen(f"http://127.0.0.1:{self.port}/healthz", timeout=1):
                    return
            except OSError:
                time.sleep(0.05)
        raise RuntimeError("server did not start")

    def cpu_seconds(self) -> float:
        """The CPU time the server process has used (user and system)."""
        with open(f"/proc/{self.proc.pid}/stat") as stat:
            fields = stat.read().rsplit(")", 1)[1].split()
        return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")

    def _read_output(self) -> None:
        assert self.proc.stdout is not None
        for line in self.proc.stdout:
            self.output.append(line.rstrip())

    def stop(self) -> None:
        self.proc.send_signal(signal.SIGTERM)
        try:
            self.proc.wait(20)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()


class Replicas:
    """``count`` servers on one database (the first sets it up and prints the token) and nginx
    in front of them: ``port`` is nginx's."""

    def __init__(self, database_url: str, work: str, count: int, options: Sequence[str] = ()) -> None:
        self.servers: list[Server] = []
        try:
            for i in range(count):
                self.servers.append(Server(database_url, f"{work}/replica-{i}", options))
            # every job holds two connections to nginx, and nginx one to a replica for each
            self.front = NginxFront(Path(work) / "nginx", [s.port for s in self.servers], worker_connections=40000)
            self.front.start()
        except BaseException:
            self.stop()
            raise

    @property
    def port(self) -> int:
        return self.front.port

    @property
    def token(self) -> str:
        return self.servers[0].token

    def cpu_seconds(self) -> list[float]:
        return [s.cpu_seconds() for s in self.servers]

    def stop(self) -> None:
        if hasattr(self, "front"):
            self.front.stop()
        for server in self.servers:
            server.stop()


def fresh_pg_database(admin_url: str) -> tuple[str, Any]:
    import psycopg

    name = "flexium_bench_" + uuid.uuid4().hex[:8]
    with psycopg.connect(admin_url, autocommit=True) as conn:
        conn.execute(f'CREATE DATABASE "{name}"')

    def drop() -> None:
        with psycopg.connect(admin_url, autocommit=True) as conn:
            conn.execute(f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)')

    return admin_url.rsplit("/", 1)[0] + "/" + name, drop


class Databases:
    """Fresh databases for one run of a benchmark, by backend (``sqlite`` or ``postgresql``)."""

    def __init__(self, work: str, postgres_url: str | None) -> None:
        self.work = work
        self.postgres_url = postgres_url
        self.cluster: PostgresCluster | None = None

    @contextlib.contextmanager
    def fresh(self, backend: str, name: str) -> Iterator[str]:
        """The URL of a new, empty database, dropped afterwards."""
        if backend == "sqlite":
            yield f"sqlite:///{self.work}/{name}.db"
            return
        if backend != "postgresql":
            raise ValueError(f"backend {backend!r} is not sqlite or postgresql")
        admin = self.postgres_url
        if not admin:
            if self.cluster is None:
                self.cluster = PostgresCluster(max_connections=300, settings=("shared_buffers=256MB",)).start()
            admin = self.cluster.url
        url, drop = fresh_pg_database(admin)
        try:
            yield url
        finally:
            drop()

    def close(self) -> None:
        if self.cluster is not None:
            self.cluster.remove()
