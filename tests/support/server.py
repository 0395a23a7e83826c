"""Helpers shared by the server tests: settings, a TestClient bound to a workspace, request bodies,
the schema at a migration, a real server process with simulated jobs over HTTP, and the figures
docs/reliability.md quotes."""

from __future__ import annotations

import json
import threading
import time
from typing import Any

import requests
from fastapi.testclient import TestClient

from flexium.server import storage
from flexium.server.db import Database
from flexium.server.settings import Settings, normalize_database_url
from support.live_server import ServerProcess


def make_settings(database_url: str, **overrides: Any) -> Settings:
    values: dict[str, Any] = dict(
        database_url=normalize_database_url(database_url),
        sweep_interval_s=3600.0,
        token_cache_s=0.0,
        metrics_refresh_s=0.0,  # each scrape reads what the test just did
    )
    values.update(overrides)
    return Settings(**values)


class Api:
    """A TestClient bound to a workspace and its token, with short helpers."""

    ctx: Any
    db: Database

    def __init__(self, client: TestClient, token: str, workspace: str = "default") -> None:
        self.client = client
        self.token = token
        self.workspace = workspace

    @property
    def base(self) -> str:
        return f"/api/w/{self.workspace}"

    def headers(self, token: str | None = None) -> dict[str, str]:
        return {"Authorization": f"Bearer {token or self.token}"}

    def get(self, path: str, **kw: Any) -> Any:
        return self.client.get(self.base + path, headers=kw.pop("headers", self.headers()), **kw)

    def post(self, path: str, json: Any = None, **kw: Any) -> Any:
        return self.client.post(self.base + path, json=json, headers=kw.pop("headers", self.headers()), **kw)

    def delete(self, path: str, **kw: Any) -> Any:
        return self.client.delete(self.base + path, headers=kw.pop("headers", self.headers()), **kw)

    def register(self, process_id: str = "gpu-1", **fields: Any) -> Any:
        body = process_body(process_id, **fields)
        r = self.post("/processes", body)
        assert r.status_code in (200, 201), r.text
        return r.json()

    def log_in(self, token: str | None = None) -> Any:
        """POST /login as the login form does; the client keeps the session cookie."""
        return self.client.post(
            "/login",
            content=f"token={token or self.token}",
            headers={"Content-Type": "application/x-www-form-urlencoded"},
            follow_redirects=False,
        )

    def pages(self, *paths: str) -> list[str]:
        """The dashboard's HTML at each path, fetched as a logged-in browser (a session cookie)."""
        assert self.log_in().status_code == 303
        try:
            return [self.client.get(path).text for path in paths]
        finally:
            self.client.cookies.clear()

    def command(self, kind: str, process_id: str = "gpu-1", target: Any = None, ranks: Any = None) -> Any:
        body: dict[str, Any] = {"kind": kind, "process_id": process_id}
        if target is not None:
            body["target"] = target
        if ranks is not None:
            body["ranks"] = ranks
        return self.post("/commands", body)

    def events(self, after: int, *, on_loop: bool = False) -> list[tuple[str, Any]]:
        """(type, data) of each event published after the id ``after``, as a stream resumed there
        gets them; read on the server's event loop, where the bus lives (``on_loop``: this runs there)."""
        workspace_id = self.db.run(storage.authenticate, write=False, token=self.token, now=time.time()).workspace_id

        def replay() -> list[str]:
            sub, backlog = self.ctx.bus.subscribe(workspace_id, last_event_id=after)
            self.ctx.bus.unsubscribe(sub)
            return backlog

        events = []
        for frame in replay() if on_loop else self.client.portal.call(replay):
            fields = dict(line.split(": ", 1) for line in frame.strip().split("\n"))
            events.append((fields["event"], json.loads(fields["data"])))
        return events


GIB = 1 << 30


def gpu(
    index: int, *, used: int = 0, total: int = 140 * GIB, name: str = "NVIDIA H200", health: str = "ok"
) -> dict[str, Any]:
    return {
        "uuid": f"GPU-{index:04d}",
        "index": index,
        "name": name,
        "memory_total": total,
        "memory_used": used,
        "utilization": 10,
        "temperature": 40,
        "health": health,
    }


def process_body(
    process_id: str = "gpu-1",
    *,
    host: str = "node1",
    gpu_index: int = 0,
    memory: int = 10 * GIB,
    n_gpus: int = 4,
    migration: bool = True,
    pause_resume: bool = True,
    state: str = "RUNNING",
    devices: list[dict[str, Any]] | None = None,
    **extra: Any,
) -> dict[str, Any]:
    if devices is None:
        devices = [gpu(i, used=memory if i == gpu_index else 0) for i in range(n_gpus)]
    body = {
        "process_id": process_id,
        "host": host,
        "user": "alice",
        "pid": 4242,
        "gpu_uuid": f"GPU-{gpu_index:04d}",
        "gpu_model": "NVIDIA H200",
        "logical_device": "cuda:0",
        "visible_gpus": [d["uuid"] for d in devices],
        "torch_version": "2.11.0",
        "driver_version": "580.159.04",
        "flexium_version": "0.1.0",
        "capabilities": {"pause_resume": pause_resume, "migration": migration, "driver_version": "580.159.04"},
        "memory_bytes": memory,
        "state": state,
        "started_at": time.time() - 60,
        "cmdline": "python train.py",
        "devices": devices,
    }
    body.update(extra)
    return body


def rank_body(
    rank: int,
    *,
    world: int = 2,
    key: str = "run-7f3a",
    gpu_index: int | None = None,
    memory: int = 10 * GIB,
    placement: dict[int, int] | None = None,
    job_operations: bool = True,
    problems: list[str] | None = None,
    nccl: bool | None = None,
    **fields: Any,
) -> dict[str, Any]:
    """A rank of a torchrun job as its client registers it: rank r on GPU r unless told, every
    rank seeing the host's 4 GPUs. ``placement``: GPU index -> memory used on it (default: each
    rank's memory on its own GPU)."""
    index = rank if gpu_index is None else gpu_index
    if placement is None:
        placement = {r: memory for r in range(world)}
    devices = [gpu(i, used=placement.get(i, 0)) for i in range(4)]
    capabilities = {
        "pause_resume": job_operations,
        "migration": job_operations,
        "driver_version": "580.159.04",
        "job_operations": job_operations,
        "problems": problems or [],
        "nccl": nccl,
    }
    body = process_body(
        f"rank-{rank}",
        gpu_index=index,
        memory=memory,
        devices=devices,
        capabilities=capabilities,
        job={"key": key, "rank": rank, "world_size": world, "local_rank": rank, "local_world_size": world},
        cmdline="torchrun --nproc-per-node 2 train_ddp.py",
    )
    body.update(fields)
    return body


def register(db: Database, ws: int, body: dict[str, Any], *, now: float, stale_after: float) -> Any:
    """A registration straight through storage (what the register route does), as ProcessInfo."""
    from flexium import wire
    from flexium.server import storage

    proc, _created = db.run(
        storage.register_process,
        write=True,
        workspace_id=ws,
        report=wire.RegisterRequest.model_validate(body),
        now=now,
        stale_after=stale_after,
    )
    return proc


def migrate_to(db: Database, step: Any, revision: str) -> None:
    """``Database.upgrade``'s path (one open connection, SQLite's pragmas on), to a revision;
    `step` is ``alembic.command.upgrade`` or ``downgrade``."""
    from alembic.config import Config

    config = Config()
    config.set_main_option("script_location", "flexium.server:migrations")
    with db.engine.begin() as conn:
        config.attributes["connection"] = conn
        step(config, revision)


def columns(db: Database, table: str) -> set[str]:
    from sqlalchemy import inspect

    with db.engine.connect() as conn:
        return {c["name"] for c in inspect(conn).get_columns(table)}


# What a refused request may change on purpose: a token's last use is noted for every request its token
# authenticated (a 403 too), and written by the server when it flushes, a moment after the request.
_USE_BOOKKEEPING = {"tokens": "last_used_at"}


def table_snapshot(db: Database) -> dict[str, list[tuple[Any, ...]]]:
    """Every row of every table, to show a refused request changed nothing (but the audit log,
    which records refused commands on purpose, and a token's last use)."""
    from sqlalchemy import text

    out = {}
    with db.session(write=False) as session:
        tables = ("workspaces", "tokens", "processes", "devices", "commands", "job_operations")
        for table in (*tables, "dashboard_sessions", "login_codes"):
            rows = session.execute(text(f"SELECT * FROM {table} ORDER BY 1"))
            kept = [i for i, name in enumerate(rows.keys()) if name != _USE_BOOKKEEPING.get(table)]
            out[table] = [tuple(r[i] for i in kept) for r in rows]
    return out


# --- a real server process and simulated jobs speaking the protocol over HTTP -----------------


class LiveServer(ServerProcess):
    """The server on `database_url` ("" for its own SQLite default under `home`)."""

    def __init__(self, database_url: str, home: str, *args: str, port: int | None = None) -> None:
        super().__init__(home, *args, database=database_url or None, port=port)


class SimJob:
    """A training process's control side reduced to the protocol: register, heartbeat, long-poll,
    report; survives server restarts (retries, re-registers on 404). ``accepting`` False: it
    stops taking commands (as while busy), ``drop_next`` True: it receives one command and
    forgets it unacknowledged (as if the answer were lost)."""

    def __init__(self, base: str, token: str, process_id: str, body: dict[str, Any]) -> None:
        self.base = base
        self.process_id = process_id
        self.body = body
        self.session = requests.Session()
        self.session.headers["Authorization"] = f"Bearer {token}"
        self.accepting = threading.Event()
        self.accepting.set()
        self.drop_next = False
        self.stop = threading.Event()
        self.received: list[dict[str, Any]] = []
        self.done: list[int] = []
        self.registrations = 0
        self.errors = 0
        self.state = body.get("state", "RUNNING")
        self.threads = [
            threading.Thread(target=self._beat, daemon=True),
            threading.Thread(target=self._poll, daemon=True),
        ]

    def start(self) -> SimJob:
        self._register()
        for t in self.threads:
            t.start()
        return self

    def close(self) -> None:
        self.stop.set()
        self.accepting.set()
        for t in self.threads:
            t.join(10)

    def _register(self) -> None:
        while not self.stop.is_set():
            try:
                seq = time.monotonic_ns()  # taken before the state is read, as the real client does
                r = self.session.post(
                    f"{self.base}/processes", json={**self.body, "state": self.state, "seq": seq}, timeout=5
                )
                if r.status_code in (200, 201):
                    self.registrations += 1
                    return
            except requests.RequestException:
                pass
            self.errors += 1
            self.stop.wait(0.1)

    def _beat(self) -> None:
        while not self.stop.wait(0.2):
            try:
                seq = time.monotonic_ns()
                r = self.session.post(
                    f"{self.base}/processes/{self.process_id}/heartbeat",
                    json={"state": self.state, "seq": seq},
                    timeout=5,
                )
                if r.status_code == 404:
                    self._register()
            except requests.RequestException:
                self.errors += 1

    def _poll(self) -> None:
        seen: set[int] = set()
        while not self.stop.is_set():
            self.accepting.wait()
            if self.stop.is_set():
                return
            try:
                r = self.session.get(
                    f"{self.base}/processes/{self.process_id}/commands/next", params={"wait": 2}, timeout=10
                )
            except requests.RequestException:
                self.errors += 1
                self.stop.wait(0.1)
                continue
            if r.status_code == 404:
                self._register()
                continue
            if r.status_code != 200:
                continue
            cmd = r.json()
            self.received.append(cmd)
            if self.drop_next:
                self.drop_next = False
                self.accepting.clear()
                continue
            if cmd["id"] in seen and cmd["id"] in self.done:
                continue
            seen.add(cmd["id"])
            self._run(cmd)

    def _report(self, command_id: int, body: dict[str, Any]) -> None:
        while not self.stop.is_set():
            try:
                r = self.session.post(f"{self.base}/commands/{command_id}/report", json=body, timeout=5)
                if r.status_code < 500:
                    return
            except requests.RequestException:
                pass
            self.stop.wait(0.1)

    def _run(self, cmd: dict[str, Any]) -> None:
        self._report(cmd["id"], {"state": "running"})
        self.state = {"migrate": "RUNNING", "pause": "PAUSED", "resume": "RUNNING"}[cmd["kind"]]
        update: dict[str, Any] = {"state": self.state, "seq": time.monotonic_ns()}
        if cmd.get("target_uuid"):
            update["gpu_uuid"] = cmd["target_uuid"]
        # Carried out before it is told: a test reading `done` once the server shows the command
        # succeeded would otherwise race this thread's return from the report.
        self.done.append(cmd["id"])
        self._report(
            cmd["id"],
            {
                "state": "succeeded",
                "process": update,
                "result": {"kind": cmd["kind"], "path": "driver", "ok": True, "seconds": 0.01},
            },
        )


# --- figures that docs/reliability.md quotes ----------------------------------------------------

FIGURES_ENV = "FLEXIUM_RELIABILITY_FIGURES"


def report_figures(request: Any, name: str, line: str, figures: dict[str, Any]) -> None:
    """Prints `line` past pytest's capture (-q shows it too) and, where ``$FLEXIUM_RELIABILITY_FIGURES``
    names a folder, writes `figures` there as ``NAME.json`` with the date of the run."""
    import json
    import os
    from pathlib import Path

    capture = request.config.pluginmanager.get_plugin("capturemanager")
    reporter = request.config.pluginmanager.get_plugin("terminalreporter")
    if reporter is not None and capture is not None:
        with capture.global_and_fixture_disabled():
            reporter.write_line(line)
    folder = os.environ.get(FIGURES_ENV)
    if folder:
        Path(folder).mkdir(parents=True, exist_ok=True)
        stamped = {"date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()), "summary": line, **figures}
        (Path(folder) / f"{name}.json").write_text(json.dumps(stamped, indent=1, ensure_ascii=False) + "\n")
