"""A real server process and simulated training jobs that talk to it over real HTTP, as
flexium's control thread does: register, heartbeat with the host's GPUs, long-poll the next
command, report running and then the outcome with its timings."""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import requests

from support.live_server import ServerProcess

GIB = 1 << 30
H200 = "NVIDIA H200"


class LiveServer(ServerProcess):
    """The server on `database` (a URL), by default its own SQLite file in `home`. Its workspace
    token and login link are the ones its first start printed (a restart on the same database
    prints none)."""

    def __init__(self, home: Path, *args: str, database: str | None = None) -> None:
        super().__init__(home, *args, database=database or f"sqlite:///{Path(home) / 'server.db'}")
        self._first: tuple[str | None, str | None] | None = None

    def start(self, timeout: float = 30.0) -> LiveServer:
        super().start(timeout)
        if self._first is None:
            assert self.output is not None
            self.output.wait_for(r"^flx_", timeout)
            self.output.wait_for(r"Log in to the dashboard: ", timeout)
            self._first = (ServerProcess.token.fget(self), ServerProcess.login_link.fget(self))  # type: ignore[attr-defined]
        return self

    @property
    def token(self) -> str | None:
        return self._first[0] if self._first is not None else None

    @property
    def login_link(self) -> str | None:
        return self._first[1] if self._first is not None else None


class Api:
    """The workspace API with the default workspace's token (what the CLI and jobs use)."""

    def __init__(self, server: LiveServer, workspace: str = "default") -> None:
        assert server.token
        self.base = f"{server.url}/api/w/{workspace}"
        self.session = requests.Session()
        self.session.headers["Authorization"] = f"Bearer {server.token}"
        # Every simulated job's threads share this session: a pool of requests' default 10 would
        # drop and open a connection per request past the tenth (a test of 20 jobs runs 40 threads).
        adapter = requests.adapters.HTTPAdapter(pool_maxsize=64)
        self.session.mount("http://", adapter)
        self.session.mount("https://", adapter)

    def get(self, path: str, **kw: Any) -> requests.Response:
        return self.session.get(self.base + path, timeout=kw.pop("timeout", 10), **kw)

    def post(self, path: str, json: Any = None, **kw: Any) -> requests.Response:
        return self.session.post(self.base + path, json=json, timeout=kw.pop("timeout", 10), **kw)

    def delete(self, path: str) -> requests.Response:
        return self.session.delete(self.base + path, timeout=10)

    def commands(self, process_id: str) -> list[dict[str, Any]]:
        r = self.get("/commands", params={"process_id": process_id})
        r.raise_for_status()
        return list(r.json())


@dataclass
class Gpu:
    index: int
    name: str = H200
    total: int = 140 * GIB
    other: int = 0  # memory held by processes that are not flexium jobs
    utilization: int = 35
    temperature: int = 41
    health: str = "ok"

    def uuid(self, host: str) -> str:
        return f"GPU-{host}-{self.index:02d}"


@dataclass
class FakeHost:
    """One machine's GPUs as NVML would report them; memory used includes its jobs'."""

    name: str
    gpus: list[Gpu] = field(default_factory=lambda: [Gpu(i) for i in range(4)])
    jobs: list[SimJob] = field(default_factory=list)

    def uuid(self, index: int) -> str:
        return self.gpus[index].uuid(self.name)

    def report(self, by: SimJob | None = None) -> list[dict[str, Any]]:
        """The GPUs as job ``by`` reports them: with what it holds on each when it is on several."""
        out = []
        for gpu in self.gpus:
            uuid = gpu.uuid(self.name)
            used = gpu.other + sum(j.held_on(uuid) for j in self.jobs)
            out.append(
                {
                    "uuid": uuid,
                    "index": gpu.index,
                    "name": gpu.name,
                    "memory_total": gpu.total,
                    "memory_used": min(used, gpu.total),
                    "utilization": gpu.utilization,
                    "temperature": gpu.temperature,
                    "health": gpu.health,
                    **({"process_bytes": by.held_on(uuid)} if by is not None and by.shares else {}),
                }
            )
        return out


class SimJob:
    """A training process as the server sees it. Operations succeed after ``op_seconds`` of
    reported time; ``hold`` (cleared Event) keeps the next one at 'running' until set;
    ``fail_with`` makes it fail with that error (rolled back, still on its GPU). ``shares``: a
    process on several GPUs (DataParallel), the bytes it holds on each GPU index, its own
    device (``gpu``) among them; a migrate moves each share as the command's ``gpu_moves`` say."""

    def __init__(
        self,
        api: Api,
        host: FakeHost,
        process_id: str,
        *,
        gpu: int = 0,
        memory: int = 20 * GIB,
        user: str = "alice",
        cmdline: str = "python train.py",
        migration: bool = True,
        pause_resume: bool = True,
        state: str = "RUNNING",
        op_seconds: float = 1.23,
        job: dict[str, Any] | None = None,
        problems: list[str] | None = None,
        steps: int | None = None,
        loss: float | None = None,
        shares: dict[int, int] | None = None,
        nccl: bool | None = None,
    ) -> None:
        self.api = api
        self.host = host
        self.process_id = process_id
        self.gpu_uuid: str | None = host.uuid(gpu)
        self.gpu_index: int | None = gpu
        self.shares = {host.uuid(index): held for index, held in (shares or {}).items()}
        self.memory = sum(self.shares.values()) if self.shares else memory
        self.footprint = self.memory
        self.user = user
        self.cmdline = cmdline
        self.capabilities: dict[str, Any] = {"migration": migration, "pause_resume": pause_resume}
        if problems:
            self.capabilities["problems"] = problems
        self.job = job  # a rank of a job of several: its wire.JobMembership
        if job is not None:
            self.capabilities["job_operations"] = migration and pause_resume
            self.capabilities["nccl"] = nccl
        self.state = state
        # Training progress its beats report (None: like a client that reports none); each beat
        # is 5 more optimizer steps.
        self.steps = steps
        self.loss = loss
        self.op_seconds = op_seconds
        self.hold = threading.Event()
        self.hold.set()
        self.fail_with: str | None = None
        self.received: list[dict[str, Any]] = []
        self.errors: list[str] = []
        self._alive = threading.Event()
        self._lock = threading.Lock()
        self._threads: list[threading.Thread] = []
        host.jobs.append(self)

    # --- what it sends ------------------------------------------------------------------

    def registration(self) -> dict[str, Any]:
        return {
            "process_id": self.process_id,
            "host": self.host.name,
            "user": self.user,
            "pid": 4000 + len(self.host.jobs),
            "gpu_uuid": self.gpu_uuid,
            "gpu_model": H200,
            "logical_device": "cuda:0",
            "visible_gpus": [self.host.uuid(g.index) for g in self.host.gpus],
            "torch_version": "2.13.0",
            "driver_version": "580.159.04",
            "flexium_version": "0.1.0",
            "capabilities": self.capabilities,
            "memory_bytes": 0 if self.state == "PAUSED" else self.memory,
            "footprint_bytes": self.footprint,
            "state": self.state,
            "started_at": time.time() - 3725,
            "cmdline": self.cmdline,
            "devices": self.host.report(self),
            **({"job": self.job} if self.job is not None else {}),
        }

    def beat(self) -> dict[str, Any]:
        with self._lock:
            progress: dict[str, Any] = {}
            if self.steps is not None:
                if self.state == "RUNNING":
                    self.steps += 5
                progress["steps"] = self.steps
            if self.loss is not None:
                progress["loss"] = self.loss
            return {
                "seq": time.monotonic_ns(),  # as the client: a beat built before a report never undoes it
                "state": self.state,
                "memory_bytes": 0 if self.state == "PAUSED" else self.memory,
                "footprint_bytes": self.footprint,
                "gpu_uuid": self.gpu_uuid,
                "devices": self.host.report(self),
                **progress,
            }

    def held_on(self, uuid: str) -> int:
        if self.state == "PAUSED":
            return 0
        if self.shares:
            return self.shares.get(uuid, 0)
        return self.memory if self.gpu_uuid == uuid else 0

    # --- life -----------------------------------------------------------------------------

    def start(self) -> SimJob:
        r = self.api.post("/processes", self.registration())
        assert r.status_code in (200, 201), r.text
        self._alive.set()
        for target in (self._beat_loop, self._poll_loop):
            t = threading.Thread(target=target, daemon=True, name=f"{self.process_id}-{target.__name__}")
            t.start()
            self._threads.append(t)
        return self

    def die(self) -> None:
        """Stop talking to the server (the process was killed): it goes STALE."""
        self._alive.clear()
        self.hold.set()
        for t in self._threads:
            t.join(10)

    def _beat_loop(self) -> None:
        while self._alive.is_set():
            try:
                r = self.api.post(f"/processes/{self.process_id}/heartbeat", self.beat(), timeout=5)
                if r.status_code == 404:
                    self.api.post("/processes", self.registration(), timeout=5)
            except requests.RequestException as exc:
                self.errors.append(f"heartbeat: {exc}")
            time.sleep(0.5)

    def _poll_loop(self) -> None:
        while self._alive.is_set():
            try:
                r = self.api.get(f"/processes/{self.process_id}/commands/next", params={"wait": 1}, timeout=10)
            except requests.RequestException as exc:
                self.errors.append(f"poll: {exc}")
                time.sleep(0.2)
                continue
            if r.status_code == 200 and self._alive.is_set():
                self._run(r.json())
            elif r.status_code not in (200, 204):
                time.sleep(0.2)

    def _report(self, command_id: int, body: dict[str, Any]) -> None:
        r = self.api.post(f"/commands/{command_id}/report", body)
        if r.status_code != 200:
            self.errors.append(f"report {command_id}: {r.status_code} {r.text}")

    def _run(self, cmd: dict[str, Any]) -> None:
        if any(c["id"] == cmd["id"] for c in self.received):
            return  # delivered again: already handled
        self.received.append(cmd)
        kind = cmd["kind"]
        with self._lock:
            before = self.state
            self.state = {"migrate": "MIGRATING", "pause": "PAUSING", "resume": "RESUMING"}[kind]
        self._report(cmd["id"], {"state": "running"})
        self.hold.wait(60)
        source = {
            "ordinal": 0,
            "uuid": self.gpu_uuid,
            "name": H200,
            "total_memory": 140 * GIB,
            "pci_bus_id": "0000:00:00.0",
            "nvml_index": self.gpu_index,
        }
        target_uuid = cmd.get("target_uuid") or (self.gpu_uuid if kind != "pause" else None)
        # A command names its GPU by UUID only; its index is the host's numbering of that GPU.
        target_index = (
            next((g.index for g in self.host.gpus if self.host.uuid(g.index) == cmd["target_uuid"]), None)
            if cmd.get("target_uuid")
            else self.gpu_index
        )
        target = None if target_uuid is None else dict(source, uuid=target_uuid, nvml_index=target_index)
        steps = [
            {"step": "checkpoint", "seconds": round(self.op_seconds * 0.4, 3), "ok": True},
            {
                "step": "restore",
                "seconds": round(self.op_seconds * 0.5, 3),
                "ok": self.fail_with is None,
                "error": self.fail_with,
            },
        ]
        result = {
            "kind": kind,
            "path": "driver",
            "ok": self.fail_with is None,
            "logical_device": "cuda:0",
            "source": source,
            "target": target,
            "steps": steps,
            "bytes_moved": self.memory,
            "seconds": self.op_seconds,
            "failed_step": "restore" if self.fail_with else None,
            "error": self.fail_with,
            "notes": [],
        }
        if self.fail_with is not None:
            with self._lock:
                self.state = before
            self._report(
                cmd["id"],
                {
                    "state": "failed",
                    "result": result,
                    "error": self.fail_with,
                    "process": {"state": before, "seq": time.monotonic_ns()},
                },
            )
            return
        with self._lock:
            if kind == "pause":
                self.state = "PAUSED"
            else:
                self.state = "RUNNING"
                self.gpu_uuid, self.gpu_index = target_uuid, target_index
                moves = cmd.get("gpu_moves") or {}
                self.shares = {moves.get(uuid, uuid): held for uuid, held in self.shares.items()}
            update = {
                "seq": time.monotonic_ns(),
                "state": self.state,
                "gpu_uuid": self.gpu_uuid,
                "memory_bytes": 0 if self.state == "PAUSED" else self.memory,
            }
        self._report(cmd["id"], {"state": "succeeded", "result": result, "process": update})


Jobs = Callable[..., SimJob]


def two_rank_job(jobs: Jobs, host: FakeHost, key: str, *, op_seconds: float = 0.4) -> list[SimJob]:
    """The two ranks of a torchrun job on GPUs 0 and 1 of `host`, as the `jobs` fixture makes them."""
    return [
        jobs(
            host,
            f"{key}-r{rank}",
            gpu=rank,
            cmdline="torchrun --nproc-per-node 2 train_ddp.py",
            op_seconds=op_seconds,
            job={"key": key, "rank": rank, "world_size": 2, "local_rank": rank, "local_world_size": 2},
        )
        for rank in (0, 1)
    ]
