"""Debian's nginx (``/usr/sbin/nginx``) in front of several server processes, configured with the
two blocks docs/guide/server.md gives operators: the replicas' ``upstream flexium`` block and the
proxy's ``server`` block. Only what differs on a test machine is changed: the upstream's servers
are the test's, the proxy listens on 127.0.0.1 and a free port without TLS. So the documented
configuration is the one the tests run, and cannot drift from it.

nginx runs as this user (as root: its workers too, to write its temp folders), with its prefix,
pid file, logs and temp folders in a folder of its own, in the foreground (``daemon off``)."""

from __future__ import annotations

import os
import pwd
import re
import signal
import socket
import subprocess
import time
from collections.abc import Sequence
from pathlib import Path

# FLEXIUM_NGINX: another nginx, e.g. ci/bench-replicas.sh's from the bundle of a machine without one
NGINX = os.environ.get("FLEXIUM_NGINX", "/usr/sbin/nginx")
GUIDE = Path(__file__).resolve().parents[2] / "docs" / "guide" / "server.md"
_NGINX_BLOCK = re.compile(r"^```nginx\n(.*?)^```$", re.MULTILINE | re.DOTALL)
_UPSTREAM_SERVER = re.compile(r"^(\s*)server\s+\S+(.*;.*)$")
# the proxy's lines about TLS and its public name, which a test on 127.0.0.1 has no use for
_TLS_LINE = re.compile(r"^\s*(http2|ssl_\w+|server_name)\s")


class NginxMissing(RuntimeError):
    pass


def documented_blocks(guide: Path = GUIDE) -> tuple[str, str]:
    """The replicas' upstream block and the proxy's server block, as the guide gives them."""
    blocks = _NGINX_BLOCK.findall(guide.read_text())
    upstream = [b for b in blocks if b.lstrip().startswith("upstream flexium") and "server {" not in b]
    proxies = [b for b in blocks if "server {" in b]
    if len(upstream) != 1 or len(proxies) != 1:
        raise AssertionError(
            f"{guide} should hold one nginx block with the replicas' upstream alone and one with the proxy's "
            f"server block; found {len(upstream)} and {len(proxies)}"
        )
    server = proxies[0][proxies[0].index("server {") :]
    return upstream[0], server


def front_config(*, port: int, upstream_ports: Sequence[int], work: Path, worker_connections: int = 4096) -> str:
    """nginx.conf for a front on 127.0.0.1:``port`` to the servers on ``upstream_ports``."""
    upstream_doc, server_doc = documented_blocks()
    upstream_lines: list[str] = []
    replaced = False
    for line in upstream_doc.splitlines():
        match = _UPSTREAM_SERVER.match(line)
        if match is None:
            upstream_lines.append(line)
        elif not replaced:  # each replica gets the documented line's options
            indent, options = match.groups()
            upstream_lines += [f"{indent}server 127.0.0.1:{p}{options}" for p in upstream_ports]
            replaced = True
    if not replaced:
        raise AssertionError(f"the guide's upstream block lists no server:\n{upstream_doc}")
    server_lines = []
    for line in server_doc.splitlines():
        if _TLS_LINE.match(line):
            continue
        if line.strip().startswith("listen "):
            line = re.sub(r"listen\s+[^;]*;", f"listen 127.0.0.1:{port};", line)
        server_lines.append(line)
    user = f"user {pwd.getpwuid(os.getuid()).pw_name};\n" if os.geteuid() == 0 else ""
    temp = "\n".join(
        f"    {kind}_temp_path {work / kind};" for kind in ("client_body", "proxy", "fastcgi", "uwsgi", "scgi")
    )
    return (
        f"{user}daemon off;\n"
        "worker_processes 1;\n"
        f"worker_rlimit_nofile {worker_connections * 2};\n"
        f"pid {work / 'nginx.pid'};\n"
        f"error_log {work / 'error.log'} warn;\n"
        f"events {{ worker_connections {worker_connections}; }}\n"
        "http {\n"
        f"    access_log {work / 'access.log'};\n"
        f"{temp}\n" + "\n".join("    " + line if line else "" for line in [*upstream_lines, *server_lines]) + "\n}\n"
    )


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


class NginxFront:
    """nginx on 127.0.0.1 in front of the servers on ``upstream_ports`` (started by ``start``)."""

    def __init__(self, work: Path, upstream_ports: Sequence[int], *, worker_connections: int = 4096) -> None:
        if not os.access(NGINX, os.X_OK):
            raise NginxMissing(
                f"{NGINX} is missing: the replica tests put Debian's nginx in front of the servers; "
                "install it (apt-get install nginx-light; ci/test.sh does), or name another with FLEXIUM_NGINX"
            )
        self.work = Path(work)
        self.upstream_ports = list(upstream_ports)
        self.worker_connections = worker_connections
        self.port = _free_port()
        self.proc: subprocess.Popen[bytes] | None = None

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    @property
    def conf(self) -> Path:
        return self.work / "nginx.conf"

    def start(self, timeout: float = 20.0) -> NginxFront:
        self.work.mkdir(parents=True, exist_ok=True)
        self.conf.write_text(
            front_config(
                port=self.port,
                upstream_ports=self.upstream_ports,
                work=self.work,
                worker_connections=self.worker_connections,
            )
        )
        self.proc = subprocess.Popen(
            [NGINX, "-p", str(self.work), "-c", str(self.conf), "-e", str(self.work / "error.log")],
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
        )
        deadline = time.monotonic() + timeout
        while True:
            if self.proc.poll() is not None:
                raise AssertionError(f"nginx exited ({self.proc.returncode}) at start:\n{self.errors()}")
            try:
                with socket.create_connection(("127.0.0.1", self.port), timeout=1):
                    return self
            except OSError:
                if time.monotonic() > deadline:
                    raise AssertionError(f"nginx did not listen within {timeout:.0f} s:\n{self.errors()}") from None
                time.sleep(0.05)

    def errors(self) -> str:
        log = self.work / "error.log"
        return log.read_text()[-3000:] if log.exists() else "(no error log)"

    def stop(self, timeout: float = 10.0) -> None:
        """A fast stop (SIGTERM): open long-polls and streams are cut, not waited for."""
        if self.proc is not None and self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(timeout)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
