"""A PostgreSQL cluster of one test's own, as ci/test.sh starts the shared one: Debian's binaries,
a temporary data folder, 127.0.0.1 and a free port, run as the postgres user when the tests run as
root. A test that stops and starts PostgreSQL under its servers uses one, so the shared cluster
stays up for every other test. Every wait is bounded."""

from __future__ import annotations

import glob
import os
import shutil
import socket
import subprocess
import tempfile
from pathlib import Path


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


class PostgresCluster:
    """``settings``: more ``-c name=value`` settings of the server (the benchmarks' larger ones)."""

    def __init__(self, *, max_connections: int = 100, settings: tuple[str, ...] = ()) -> None:
        self.max_connections = max_connections
        self.settings = settings
        bins = sorted(glob.glob("/usr/lib/postgresql/*/bin"), key=lambda p: int(Path(p).parent.name))
        if not bins:
            raise RuntimeError("no PostgreSQL in /usr/lib/postgresql/*/bin: install Debian's postgresql")
        self.bin = Path(bins[-1])
        self.dir = Path(tempfile.mkdtemp(prefix="flexium-test-pg."))
        self.port = _free_port()
        self._as = ["runuser", "-u", "postgres", "--"] if os.geteuid() == 0 else []
        if os.geteuid() == 0:
            shutil.chown(self.dir, "postgres", "postgres")
        self._run("initdb", "-D", str(self.dir / "data"), "-A", "trust", "-U", "postgres", "-E", "UTF8")

    @property
    def url(self) -> str:
        return f"postgresql://postgres@127.0.0.1:{self.port}/postgres"

    def _run(self, tool: str, *args: str, timeout: float = 60.0) -> None:
        done = subprocess.run([*self._as, str(self.bin / tool), *args], capture_output=True, text=True, timeout=timeout)
        if done.returncode != 0:
            raise RuntimeError(f"{tool} {' '.join(args)} failed ({done.returncode}): {done.stderr[-2000:]}")

    def start(self) -> PostgresCluster:
        options = " ".join(
            [
                f"-p {self.port} -k {self.dir} -c listen_addresses=127.0.0.1 -c fsync=off",
                f"-c max_connections={self.max_connections}",
                *(f"-c {setting}" for setting in self.settings),
            ]
        )
        data, log = str(self.dir / "data"), str(self.dir / "server.log")
        self._run("pg_ctl", "-D", data, "-l", log, "-w", "-t", "60", "-o", options, "start", timeout=90)
        return self

    def stop(self, mode: str = "fast") -> None:
        """``fast``: its sessions are ended and it shuts down cleanly; ``immediate``: as a crash."""
        self._run("pg_ctl", "-D", str(self.dir / "data"), "-m", mode, "-w", "-t", "60", "stop", timeout=90)

    def remove(self) -> None:
        try:
            self.stop("immediate")
        except RuntimeError:
            pass  # not running
        shutil.rmtree(self.dir, ignore_errors=True)
