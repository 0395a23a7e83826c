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
import os
import random
import shutil
import sys
import tempfile
import time
from dataclasses import dataclass, field
from typing import Any

from http_client import Conn, HttpError, tune_client
from live_server import Databases, Server
from simulated_job import BASE, GIB, Observer, SimulatedHost, SimulatedJob
from tables import pct

# --- measurements ---------------------------------------------------------------------------


@dataclass
class Stats(Observer):
    hb_latency: list[float] = field(default_factory=list)
    post_latency: list[float] = field(default_factory=list)
    delivery: list[float] = field(default_factory=list)
    server_delivery: list[float] = field(default_factory=list)
    sent: dict[int, float] = field(default_factory=dict)  # command id -> controller send time
    received: dict[int, tuple[float, float]] = field(default_factory=dict)  # id -> (monotonic, wall)
    created_wall: dict[int, float] = field(default_factory=dict)
    errors: int = 0
    refused: int = 0

    def heartbeat(self, job: SimulatedJob, seconds: float) -> None:
        self.hb_latency.append(seconds)

    def command(self, job: SimulatedJob, command: dict[str, Any], received: float, received_wall: float) -> None:
        self.received.setdefault(command["id"], (received, received_wall))
        self.created_wall[command["id"]] = command["created_at"]

    def error(self, job: SimulatedJob, what: str) -> None:
        self.errors += 1


async def controller(
    jobs: list[SimulatedJob], conns: list[Conn], base: str, stats: Stats, stop: asyncio.Event, rate: float
) -> None:
    """Commands at ``rate`` per second, each to a job without one in flight."""

    async def send(job: SimulatedJob, conn: Conn) -> None:
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


async def burst(jobs: list[SimulatedJob], base: str, seconds: float, concurrency: int) -> tuple[float, list[float]]:
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
    base = BASE
    stats = Stats()
    hosts = [SimulatedHost.make(f"host-{h:04d}", args.gpus_per_host) for h in range(-(-n // args.gpus_per_host))]
    jobs = [
        SimulatedJob(
            index=i,
            process_id=f"bench-{i:05d}",
            host=hosts[i // args.gpus_per_host],
            gpu=hosts[i // args.gpus_per_host].gpus[i % args.gpus_per_host],
            memory=10 * GIB,
            control=Conn(port, token),
            poll=Conn(port, token),
            observer=stats,
            heartbeat_interval=args.heartbeat_interval,
            poll_wait=args.poll_wait,
        )
        for i in range(n)
    ]
    sem = asyncio.Semaphore(32)

    async def register(job: SimulatedJob) -> None:
        async with sem:
            try:
                await job.register()
            except RuntimeError as exc:
                raise HttpError(str(exc)) from None

    t0 = time.perf_counter()
    await asyncio.gather(*(register(j) for j in jobs))
    register_s = time.perf_counter() - t0

    stop = asyncio.Event()
    runners = [asyncio.create_task(j.live(stop)) for j in jobs]
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
    tune_client()
    rows = []
    work = tempfile.mkdtemp(prefix="flexium-bench.")
    databases = Databases(work, args.postgres_url)
    try:
        for backend in args.backends.split(","):
            for n in [int(x) for x in args.jobs.split(",")]:
                with databases.fresh(backend, f"bench-{n}") as url:
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
    finally:
        databases.close()
        shutil.rmtree(work, ignore_errors=True)
    print_table(rows, args)
    return 0


if __name__ == "__main__":
    sys.exit(main())
