"""Server benchmark: N simulated training jobs speaking the real protocol over real HTTP to a
real ``flexium server`` process on this machine (127.0.0.1 only).

Each job registers (with its host's 8 GPUs), heartbeats every ``--heartbeat-interval``
seconds and keeps a long-poll open; a controller creates pause/resume commands at
``--command-rate`` per second for idle jobs; a job that receives one acknowledges it
(running) and reports it done, then polls again. Measured:

- heartbeats: latency (request -> response) p50/p99 and throughput during the steady phase,
  and the most heartbeats per second the server takes (``--burst-concurrency`` back-to-back);
- command delivery: from the controller sending POST /commands to the job receiving the
  command on its long-poll, p50/p99 (both ends in this process, one monotonic clock).

Usage: python bench/server.py [--jobs 100,1000,2000] [--backends sqlite,postgresql]
PostgreSQL: --postgres-url (an admin URL; a fresh database is made), else
$FLEXIUM_TEST_POSTGRES_URL, else a throwaway cluster is started when running as root with
Debian's postgresql installed. Every loop is bounded in time; the run stops by itself.
The client is a minimal HTTP/1.1 keep-alive client on asyncio, so the 2 cores of a small
machine go to the server rather than to client overhead.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import glob
import json
import os
import random
import re
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
import urllib.request
import uuid
from dataclasses import dataclass, field
from typing import Any

GIB = 1 << 30


# --- a small HTTP/1.1 client ----------------------------------------------------------------


class HttpError(Exception):
    pass


class Conn:
    """One keep-alive connection; one request at a time (callers hold ``lock``)."""

    def __init__(self, port: int, token: str) -> None:
        self.port = port
        self.auth = f"Authorization: Bearer {token}\r\n"
        self.reader: asyncio.StreamReader | None = None
        self.writer: asyncio.StreamWriter | None = None
        self.lock = asyncio.Lock()

    async def _connect(self) -> None:
        self.reader, self.writer = await asyncio.open_connection("127.0.0.1", self.port)

    def close(self) -> None:
        if self.writer is not None:
            self.writer.close()
        self.reader = self.writer = None

    async def request(self, method: str, path: str, body: Any = None, *, timeout: float = 60.0) -> tuple[int, Any]:
        payload = b"" if body is None else json.dumps(body).encode()
        head = (
            f"{method} {path} HTTP/1.1\r\nHost: 127.0.0.1\r\n{self.auth}"
            f"Content-Type: application/json\r\nContent-Length: {len(payload)}\r\n\r\n"
        ).encode()
        for attempt in (0, 1):
            if self.writer is None:
                await self._connect()
            assert self.reader is not None and self.writer is not None
            try:
                self.writer.write(head + payload)
                return await asyncio.wait_for(self._read(), timeout)
            except (ConnectionError, asyncio.IncompleteReadError, OSError):
                self.close()
                if attempt:
                    raise
            except asyncio.TimeoutError:
                self.close()
                raise
        raise HttpError("unreachable")

    async def _read(self) -> tuple[int, Any]:
        assert self.reader is not None
        raw = await self.reader.readuntil(b"\r\n\r\n")
        lines = raw.decode("latin-1").split("\r\n")
        status = int(lines[0].split(" ", 2)[1])
        length, close = 0, False
        for line in lines[1:]:
            name, _, value = line.partition(":")
            name = name.strip().lower()
            if name == "content-length":
                length = int(value)
            elif name == "connection" and value.strip().lower() == "close":
                close = True
        data = await self.reader.readexactly(length) if length else b""
        if close:
            self.close()
        return status, (json.loads(data) if data else None)


# --- measurements ---------------------------------------------------------------------------


def pct(values: list[float], q: float) -> float:
    if not values:
        return float("nan")
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))]


@dataclass
class Stats:
    hb_latency: list[float] = field(default_factory=list)
    post_latency: list[float] = field(default_factory=list)
    delivery: list[float] = field(default_factory=list)
    server_delivery: list[float] = field(default_factory=list)
    sent: dict[int, float] = field(default_factory=dict)  # command id -> controller send time
    received: dict[int, tuple[float, float]] = field(default_factory=dict)  # id -> (monotonic, wall)
    created_wall: dict[int, float] = field(default_factory=dict)
    errors: int = 0
    refused: int = 0


@dataclass
class Job:
    index: int
    process_id: str
    control: Conn
    poll: Conn
    state: str = "RUNNING"
    busy: bool = False


def job_body(job: Job, gpus_per_host: int) -> dict[str, Any]:
    host = f"host-{job.index // gpus_per_host:04d}"
    mine = job.index % gpus_per_host
    devices = [
        {
            "uuid": f"GPU-{host}-{g}",
            "index": g,
            "name": "NVIDIA H200",
            "memory_total": 141 * GIB,
            "memory_used": 10 * GIB,
            "utilization": 90,
            "temperature": 60,
            "health": "ok",
        }
        for g in range(gpus_per_host)
    ]
    return {
        "process_id": job.process_id,
        "host": host,
        "user": "bench",
        "pid": 10000 + job.index,
        "gpu_uuid": devices[mine]["uuid"],
        "gpu_model": "NVIDIA H200",
        "logical_device": "cuda:0",
        "visible_gpus": [d["uuid"] for d in devices],
        "torch_version": "2.11.0",
        "driver_version": "580.159.04",
        "flexium_version": "0.1.0",
        "capabilities": {"pause_resume": True, "migration": True},
        "memory_bytes": 10 * GIB,
        "state": "RUNNING",
        "started_at": time.time(),
        "cmdline": "python train.py",
        "devices": devices,
    }


async def run_job(job: Job, base: str, stats: Stats, stop: asyncio.Event, interval: float, poll_wait: float) -> None:
    async def heartbeats() -> None:
        await asyncio.sleep(random.uniform(0, interval))
        while not stop.is_set():
            start = time.perf_counter()
            try:
                async with job.control.lock:
                    status, _ = await job.control.request(
                        "POST",
                        f"{base}/processes/{job.process_id}/heartbeat",
                        {"state": job.state, "memory_bytes": 0 if job.state == "PAUSED" else 10 * GIB},
                    )
                if status == 200:
                    stats.hb_latency.append(time.perf_counter() - start)
                else:
                    stats.errors += 1
            except Exception:
                stats.errors += 1
            with contextlib.suppress(asyncio.TimeoutError):
                await asyncio.wait_for(stop.wait(), interval)

    async def polls() -> None:
        while not stop.is_set():
            wait = round(random.uniform(0.5, 1.0) * poll_wait, 2)  # real jobs are not in step
            try:
                status, cmd = await job.poll.request(
                    "GET", f"{base}/processes/{job.process_id}/commands/next?wait={wait}", timeout=wait + 30
                )
            except Exception:
                stats.errors += 1
                await asyncio.sleep(0.1)
                continue
            if status != 200:
                if status != 204:
                    stats.errors += 1
                continue
            stats.received.setdefault(cmd["id"], (time.perf_counter(), time.time()))
            stats.created_wall[cmd["id"]] = cmd["created_at"]
            new_state = "PAUSED" if cmd["kind"] == "pause" else "RUNNING"
            try:
                async with job.control.lock:
                    await job.control.request("POST", f"{base}/commands/{cmd['id']}/report", {"state": "running"})
                    await job.control.request(
                        "POST",
                        f"{base}/commands/{cmd['id']}/report",
                        {
                            "state": "succeeded",
                            "process": {"state": new_state},
                            "result": {"kind": cmd["kind"], "path": "driver", "ok": True, "seconds": 0.001},
                        },
                    )
            except Exception:
                stats.errors += 1
            job.state = new_state
            job.busy = False

    await asyncio.gather(heartbeats(), polls())


async def controller(
    jobs: list[Job], conns: list[Conn], base: str, stats: Stats, stop: asyncio.Event, rate: float
) -> None:
    """Commands at ``rate`` per second, each to a job without one in flight."""

    async def send(job: Job, conn: Conn) -> None:
        kind = "pause" if job.state == "RUNNING" else "resume"
        async with conn.lock:
            start = time.perf_counter()
            try:
                status, body = await conn.request(
                    "POST", f"{base}/commands", {"kind": kind, "process_id": job.process_id}
                )
            except Exception:
                stats.errors += 1
                job.busy = False
                return
        stats.post_latency.append(time.perf_counter() - start)
        if status == 201:
            stats.sent[body["id"]] = start
        else:
            stats.refused += 1
            job.busy = False

    tasks = set()
    period = 1.0 / rate
    next_at = time.perf_counter()
    n = 0
    while not stop.is_set():
        idle = [j for j in random.sample(jobs, min(len(jobs), 50)) if not j.busy]
        if idle:
            job = idle[0]
            job.busy = True
            task = asyncio.create_task(send(job, conns[n % len(conns)]))
            tasks.add(task)
            task.add_done_callback(tasks.discard)
            n += 1
        next_at += period
        with contextlib.suppress(asyncio.TimeoutError):
            await asyncio.wait_for(stop.wait(), max(0.0, next_at - time.perf_counter()))
    if tasks:
        await asyncio.wait(tasks, timeout=30)


async def burst(jobs: list[Job], base: str, seconds: float, concurrency: int) -> tuple[float, list[float]]:
    """Heartbeats back-to-back from ``concurrency`` connections: the most the server takes."""
    conns = [Conn(jobs[0].control.port, "") for _ in range(concurrency)]
    for c in conns:
        c.auth = jobs[0].control.auth
    latencies: list[float] = []
    deadline = time.perf_counter() + seconds

    async def worker(k: int) -> None:
        i = k
        while time.perf_counter() < deadline:
            job = jobs[i % len(jobs)]
            start = time.perf_counter()
            status, _ = await conns[k].request(
                "POST", f"{base}/processes/{job.process_id}/heartbeat", {"state": job.state}
            )
            if status == 200:
                latencies.append(time.perf_counter() - start)
            i += concurrency

    start = time.perf_counter()
    await asyncio.gather(*(worker(k) for k in range(concurrency)))
    elapsed = time.perf_counter() - start
    for c in conns:
        c.close()
    return len(latencies) / elapsed, latencies


async def bench_once(port: int, token: str, n: int, args: argparse.Namespace) -> dict[str, Any]:
    base = "/api/w/default"
    stats = Stats()
    jobs = [Job(i, f"bench-{i:05d}", Conn(port, token), Conn(port, token)) for i in range(n)]
    sem = asyncio.Semaphore(32)

    async def register(job: Job) -> None:
        async with sem:
            status, _ = await job.control.request("POST", f"{base}/processes", job_body(job, args.gpus_per_host))
            if status not in (200, 201):
                raise HttpError(f"register: {status}")

    t0 = time.perf_counter()
    await asyncio.gather(*(register(j) for j in jobs))
    register_s = time.perf_counter() - t0

    stop = asyncio.Event()
    runners = [
        asyncio.create_task(run_job(j, base, stats, stop, args.heartbeat_interval, args.poll_wait)) for j in jobs
    ]
    # warm-up: every job has heartbeated and the server answers promptly again (2000 jobs
    # starting at the same instant is a storm no real cluster makes); bounded
    probe = Conn(port, token)
    deadline = time.perf_counter() + 120
    await asyncio.sleep(args.heartbeat_interval + 1.0)
    while time.perf_counter() < deadline:
        start = time.perf_counter()
        await probe.request("GET", "/healthz")
        if len(stats.hb_latency) >= n and time.perf_counter() - start < 0.02:
            break
        await asyncio.sleep(0.5)
    probe.close()
    warmup_s = time.perf_counter() - t0 - register_s
    stats.hb_latency.clear()
    cmd_conns = [Conn(port, token) for _ in range(8)]
    ctl_stop = asyncio.Event()
    ctl = asyncio.create_task(controller(jobs, cmd_conns, base, stats, ctl_stop, args.command_rate))
    steady_start = time.perf_counter()
    await asyncio.sleep(args.duration)
    ctl_stop.set()
    await ctl
    steady_s = time.perf_counter() - steady_start
    heartbeats = len(stats.hb_latency)
    await asyncio.sleep(1.0)  # last deliveries land
    stop.set()
    # polls end by their own wait; don't hold the run for them
    await asyncio.wait(runners, timeout=args.poll_wait + 5)
    for task in runners:
        task.cancel()
    for j in jobs:
        j.control.close()
        j.poll.close()
    for c in cmd_conns:
        c.close()

    burst_rate, burst_lat = await burst(jobs, base, args.burst_seconds, args.burst_concurrency)
    for cid, sent in stats.sent.items():
        if cid in stats.received:
            stats.delivery.append(stats.received[cid][0] - sent)
            stats.server_delivery.append(stats.received[cid][1] - stats.created_wall[cid])
    lost = [cid for cid in stats.sent if cid not in stats.received]
    return {
        "n": n,
        "register_s": register_s,
        "warmup_s": warmup_s,
        "hb_rate": heartbeats / steady_s,
        "hb_p50": pct(stats.hb_latency, 0.5),
        "hb_p99": pct(stats.hb_latency, 0.99),
        "burst_rate": burst_rate,
        "burst_p50": pct(burst_lat, 0.5),
        "burst_p99": pct(burst_lat, 0.99),
        "commands": len(stats.delivery),
        "undelivered": len(lost),
        "del_p50": pct(stats.delivery, 0.5),
        "del_p99": pct(stats.delivery, 0.99),
        "del_p90": pct(stats.delivery, 0.9),
        "del_p95": pct(stats.delivery, 0.95),
        "del_max": max(stats.delivery) if stats.delivery else float("nan"),
        "srv_del_p99": pct(stats.server_delivery, 0.99),
        "post_p50": pct(stats.post_latency, 0.5),
        "post_p99": pct(stats.post_latency, 0.99),
        "errors": stats.errors,
        "refused": stats.refused,
    }


# --- servers --------------------------------------------------------------------------------


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


class Server:
    def __init__(self, database_url: str, home: str) -> None:
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
            ],
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
            env=env,
        )
        self.token = ""
        deadline = time.monotonic() + 60
        assert self.proc.stdout is not None
        while time.monotonic() < deadline:
            line = self.proc.stdout.readline()
            if not line:
                raise RuntimeError("server exited before printing its token")
            if re.fullmatch(r"flx_[A-Za-z0-9_-]+", line.strip()):
                self.token = line.strip()
                break
        while time.monotonic() < deadline:
            try:
                with urllib.request.urlopen(f"http://127.0.0.1:{self.port}/healthz", timeout=1):
                    return
            except OSError:
                time.sleep(0.05)
        raise RuntimeError("server did not start")

    def stop(self) -> None:
        self.proc.send_signal(signal.SIGTERM)
        try:
            self.proc.wait(20)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()


class ThrowawayPostgres:
    """A PostgreSQL cluster in a temp folder, run as the postgres user (as ci/test.sh does)."""

    def __init__(self) -> None:
        bins = sorted(glob.glob("/usr/lib/postgresql/*/bin"))
        if not bins or os.geteuid() != 0:
            raise RuntimeError("no PostgreSQL: give --postgres-url, or run as root with Debian's postgresql")
        self.bin = bins[-1]
        self.dir = tempfile.mkdtemp(prefix="flexium-bench-pg.")
        shutil.chown(self.dir, "postgres", "postgres")
        self.port = free_port()
        run = ["runuser", "-u", "postgres", "--"]
        subprocess.run(
            run + [f"{self.bin}/initdb", "-D", f"{self.dir}/data", "-A", "trust", "-U", "postgres", "-E", "UTF8"],
            check=True,
            stdout=subprocess.DEVNULL,
        )
        subprocess.run(
            run
            + [
                f"{self.bin}/pg_ctl",
                "-D",
                f"{self.dir}/data",
                "-l",
                f"{self.dir}/log",
                "-w",
                "-o",
                f"-p {self.port} -k {self.dir} -c listen_addresses=127.0.0.1 "
                "-c max_connections=300 -c shared_buffers=256MB",
                "start",
            ],
            check=True,
            stdout=subprocess.DEVNULL,
        )
        self.url = f"postgresql://postgres@127.0.0.1:{self.port}/postgres"

    def stop(self) -> None:
        subprocess.run(
            ["runuser", "-u", "postgres", "--", f"{self.bin}/pg_ctl", "-D", f"{self.dir}/data", "-m", "fast", "stop"],
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
        )
        shutil.rmtree(self.dir, ignore_errors=True)


def fresh_pg_database(admin_url: str) -> tuple[str, Any]:
    import psycopg

    name = "flexium_bench_" + uuid.uuid4().hex[:8]
    with psycopg.connect(admin_url, autocommit=True) as conn:
        conn.execute(f'CREATE DATABASE "{name}"')

    def drop() -> None:
        with psycopg.connect(admin_url, autocommit=True) as conn:
            conn.execute(f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)')

    return admin_url.rsplit("/", 1)[0] + "/" + name, drop


# --- main -----------------------------------------------------------------------------------


def fmt_ms(seconds: float) -> str:
    return "-" if seconds != seconds else f"{seconds * 1000:.1f}"


def print_table(rows: list[dict[str, Any]], args: argparse.Namespace) -> None:
    print()
    print(
        f"flexium server benchmark: heartbeat every {args.heartbeat_interval:g} s per job, long-poll "
        f"wait {args.poll_wait:g} s, {args.command_rate:g} commands/s for {args.duration:g} s; "
        f"burst: {args.burst_concurrency} connections back-to-back for {args.burst_seconds:g} s"
    )
    head = (
        "backend",
        "jobs",
        "hb/s",
        "hb p50 ms",
        "hb p99 ms",
        "burst hb/s",
        "burst p99 ms",
        "cmds",
        "deliv p50 ms",
        "deliv p99 ms",
        "deliv max ms",
        "POST p99 ms",
        "lost",
        "errors",
    )
    table = [head]
    for r in rows:
        table.append(
            (
                r["backend"],
                str(r["n"]),
                f"{r['hb_rate']:.0f}",
                fmt_ms(r["hb_p50"]),
                fmt_ms(r["hb_p99"]),
                f"{r['burst_rate']:.0f}",
                fmt_ms(r["burst_p99"]),
                str(r["commands"]),
                fmt_ms(r["del_p50"]),
                fmt_ms(r["del_p99"]),
                fmt_ms(r["del_max"]),
                fmt_ms(r["post_p99"]),
                str(r["undelivered"]),
                str(r["errors"]),
            )
        )
    widths = [max(len(row[i]) for row in table) for i in range(len(head))]
    for k, row in enumerate(table):
        print(" | ".join(cell.rjust(widths[i]) for i, cell in enumerate(row)))
        if k == 0:
            print("-+-".join("-" * w for w in widths))
    print(
        "deliv: controller sends POST /commands -> the job's open long-poll returns it. "
        "lost: created but not received within the run."
    )


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--jobs", default="100,1000,2000")
    parser.add_argument("--backends", default="sqlite,postgresql")
    parser.add_argument("--duration", type=float, default=30.0, help="steady phase seconds")
    parser.add_argument("--heartbeat-interval", type=float, default=5.0)
    parser.add_argument("--poll-wait", type=float, default=25.0, help="the server's default long-poll wait")
    parser.add_argument("--command-rate", type=float, default=10.0)
    parser.add_argument("--burst-seconds", type=float, default=5.0)
    parser.add_argument("--burst-concurrency", type=int, default=32)
    parser.add_argument("--gpus-per-host", type=int, default=8)
    parser.add_argument("--postgres-url", default=os.environ.get("FLEXIUM_TEST_POSTGRES_URL"))
    args = parser.parse_args(argv)
    try:
        import uvloop

        uvloop.install()
    except ImportError:
        pass
    import gc

    gc.freeze()  # the client's own collections must not show as latency
    gc.set_threshold(50_000, 20, 100)
    rows = []
    pg: ThrowawayPostgres | None = None
    work = tempfile.mkdtemp(prefix="flexium-bench.")
    try:
        for backend in args.backends.split(","):
            for n in [int(x) for x in args.jobs.split(",")]:
                drop = None
                if backend == "sqlite":
                    url = f"sqlite:///{work}/bench-{n}.db"
                else:
                    admin = args.postgres_url
                    if not admin:
                        if pg is None:
                            pg = ThrowawayPostgres()
                        admin = pg.url
                    url, drop = fresh_pg_database(admin)
                server = Server(url, work)
                try:
                    print(f"== {backend}, {n} jobs", flush=True)
                    row = asyncio.run(bench_once(server.port, server.token, n, args))
                    row["backend"] = backend
                    rows.append(row)
                    print(
                        f"   registered in {row['register_s']:.1f} s, warm-up {row['warmup_s']:.1f} s; "
                        f"{row['commands']} commands, "
                        f"delivery p90/p95/p99 {fmt_ms(row['del_p90'])}/{fmt_ms(row['del_p95'])}/"
                        f"{fmt_ms(row['del_p99'])} ms "
                        f"(from the server's commit: p99 {fmt_ms(row['srv_del_p99'])} ms), "
                        f"heartbeat p99 {fmt_ms(row['hb_p99'])} ms, errors {row['errors']}",
                        flush=True,
                    )
                finally:
                    server.stop()
                    if drop is not None:
                        drop()
    finally:
        if pg is not None:
            pg.stop()
        shutil.rmtree(work, ignore_errors=True)
    print_table(rows, args)
    return 0


if __name__ == "__main__":
    sys.exit(main())
