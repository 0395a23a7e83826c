"""Server benchmark: N simulated training jobs speaking the real protocol over real HTTP to a
real ``flexium server`` process on this machine (127.0.0.1 only).

Each job registers (with its host's 8 GPUs), heartbeats every ``--heartbeat-interval``
seconds and keeps a long-poll open; a controller creates pause/resume commands at
``--command-rate`` per second for idle jobs; a job that receives one acknowledges it
(running) and reports it done, then polls again. Measured:

- heartbeats: latency (request -> response) p50/p99 and throughput during the steady phase,
  and the most heartbeats per second the server takes (``--burst-concurrency`` back-to-back),
  with what bounded it: the machine's cores, one server process's core, or this client
  (``cpu_use.py``);
- command delivery: from the controller sending POST /commands to the job receiving the
  command on its long-poll, p50/p99 (both ends in this process, one monotonic clock);
- dashboard events: from the same POST to its ``command`` event on each of ``--dashboards``
  open event streams, p50/p99.

Usage: python bench/server.py [--jobs 100,1000,2000] [--backends sqlite,postgresql]
       python bench/server.py --replicas 1,3 --jobs 5000 --hosts 200
``--replicas``: that many servers on one PostgreSQL database behind Debian's nginx (or the one
$FLEXIUM_NGINX names: ci/bench-replicas.sh runs this on a machine without either), configured as
docs/guide/server.md says, a row each, with the ratio of each row to the first. The server's
quotas (processes, hosts) are raised to the run's size.
PostgreSQL: --postgres-url (an admin URL; a fresh database is made), else
$FLEXIUM_TEST_POSTGRES_URL, else a throwaway cluster is started when running as root with
Debian's postgresql installed. Every loop is bounded in time; the run stops by itself.
The client is a minimal HTTP/1.1 keep-alive client on asyncio, so the 2 cores of a small
machine go to the server rather than to client overhead.
"""

from __future__ import annotations

import argparse
import asyncio
import collections
import contextlib
import functools
import os
import random
import re
import shutil
import sys
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from cpu_use import CpuWindow
from http_client import Conn, HttpError, read_events, tune_client
from live_server import Databases, Replicas, Server
from simulated_job import BASE, GIB, Observer, SimulatedHost, SimulatedJob
from tables import pct

_STARTED = time.perf_counter()


def progress(what: str) -> None:
    """A line with the seconds since the benchmark started: where a long run is, and what each phase took."""
    print(f"   [{time.perf_counter() - _STARTED:6.1f} s] {what}", flush=True)


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
    event_arrivals: list[tuple[int, float]] = field(default_factory=list)  # (command id, monotonic)
    event_latency: list[float] = field(default_factory=list)
    errors: int = 0
    error_kinds: collections.Counter[str] = field(default_factory=collections.Counter)
    refused: int = 0

    def heartbeat(self, job: SimulatedJob, seconds: float) -> None:
        self.hb_latency.append(seconds)

    def command(self, job: SimulatedJob, command: dict[str, Any], received: float, received_wall: float) -> None:
        self.received.setdefault(command["id"], (received, received_wall))
        self.created_wall[command["id"]] = command["created_at"]

    def error(self, job: SimulatedJob, what: str) -> None:
        self.errors += 1
        self.error_kinds[error_kind(what)] += 1


def error_kind(what: str) -> str:
    """The request and its exception or status: "heartbeat: TimeoutError()" -> "heartbeat: TimeoutError",
    "poll: 503 {...}" -> "poll: 503"."""
    request, _, detail = what.partition(": ")
    return f"{request}: {re.split(r'[ ({]', detail, maxsplit=1)[0]}"


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
            except Exception as exc:
                stats.error(job, f"command: {exc!r}")
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


def host_count(n: int, args: argparse.Namespace) -> int:
    return args.hosts or -(-n // args.gpus_per_host)


def quota_options(n: int, args: argparse.Namespace) -> list[str]:
    """The server's quotas and bounds raised to the run's size: its defaults stop registration at
    1000 processes and 256 hosts (409), answer 503 past 4096 requests in progress (every job holds
    a long-poll) and close idle connections past 8192 (a job holds two: its poll and its heartbeats),
    so one server alone could not hold more than about 4000 jobs."""
    return [
        "--max-requests",
        str(max(n + 1024, 4096)),
        "--max-connections",
        str(max(2 * n + 1024, 8192)),
        "--max-processes",
        str(max(n, 1000)),
        "--max-hosts",
        str(max(host_count(n, args), 256)),
        "--max-gpus-per-host",
        str(max(args.gpus_per_host, 16)),
    ]


async def dashboards(port: int, token: str, count: int, stats: Stats) -> list[asyncio.Task[None]]:
    """``count`` event streams open, as that many dashboards; each command's ``created`` event
    on each is recorded with its arrival."""

    def on_event(name: str, data: Any) -> None:
        if name == "command" and data.get("action") == "created":
            stats.event_arrivals.append((data["command"]["id"], time.perf_counter()))

    tasks = []
    for _ in range(count):
        opened = asyncio.Event()
        task = asyncio.create_task(read_events(port, token, f"{BASE}/events", on_event, opened))
        waiting = asyncio.create_task(opened.wait())
        await asyncio.wait({task, waiting}, timeout=30, return_when=asyncio.FIRST_COMPLETED)
        waiting.cancel()
        if opened.is_set():
            tasks.append(task)
            continue
        # A server too busy to open a stream leaves the row without its events, not the run ended.
        why = repr(task.exception()) if task.done() else "not opened within 30 s"
        task.cancel()
        stats.errors += 1
        stats.error_kinds[f"events: {why}"[:80]] += 1
    return tasks


async def bench_once(
    port: int, token: str, n: int, args: argparse.Namespace, server_cpu: Callable[[], list[float]]
) -> dict[str, Any]:
    """One run; ``server_cpu``: the CPU seconds each server process has used (what bounded the
    burst is said from it)."""
    base = BASE
    stats = Stats()
    hosts = [SimulatedHost.make(f"host-{h:04d}", args.gpus_per_host) for h in range(host_count(n, args))]
    jobs = [
        SimulatedJob(
            index=i,
            process_id=f"bench-{i:05d}",
            host=hosts[i % len(hosts)],
            gpu=hosts[i % len(hosts)].gpus[(i // len(hosts)) % args.gpus_per_host],
            memory=10 * GIB,
            control=Conn(port, token),
            poll=Conn(port, token),
            observer=stats,
            heartbeat_interval=args.heartbeat_interval,
            poll_wait=args.poll_wait,
        )
        for i in range(n)
    ]
    sem = asyncio.Semaphore(args.register_concurrency)

    async def register(job: SimulatedJob) -> None:
        async with sem:
            try:
                await job.register()
            except RuntimeError as exc:
                raise HttpError(str(exc)) from None

    t0 = time.perf_counter()
    progress(f"registering {n} jobs, {args.register_concurrency} at once")
    cpu_before = sum(server_cpu())
    await asyncio.gather(*(register(j) for j in jobs))
    register_s = time.perf_counter() - t0
    register_cpu = sum(server_cpu()) - cpu_before
    progress(
        f"registered in {register_s:.1f} s (the servers' CPU: {register_cpu:.1f} s, "
        f"{register_cpu / n * 1000:.1f} ms a job); warming up (at most {args.warmup_limit:g} s)"
    )

    stop = asyncio.Event()
    runners = [asyncio.create_task(j.live(stop)) for j in jobs]
    # warm-up: every job has heartbeated and the server answers promptly again (2000 jobs
    # starting at the same instant is a storm no real cluster makes); bounded
    probe = Conn(port, token)
    deadline = time.perf_counter() + args.warmup_limit
    await asyncio.sleep(args.heartbeat_interval + 1.0)
    while time.perf_counter() < deadline:
        start = time.perf_counter()
        try:  # a server far behind answers late: the limit holds all the same
            await asyncio.wait_for(probe.request("GET", "/healthz"), deadline - start)
        except asyncio.TimeoutError:
            break
        if len(stats.hb_latency) >= n and time.perf_counter() - start < 0.02:
            break
        await asyncio.sleep(0.5)
    probe.close()
    warmup_s = time.perf_counter() - t0 - register_s
    heartbeated = len(stats.hb_latency)
    stats.hb_latency.clear()
    progress(f"warm-up took {warmup_s:.1f} s ({heartbeated} heartbeats); steady phase of {args.duration:g} s")
    streams = await dashboards(port, token, args.dashboards, stats)
    cmd_conns = [Conn(port, token) for _ in range(8)]
    ctl_stop = asyncio.Event()
    ctl = asyncio.create_task(controller(jobs, cmd_conns, base, stats, ctl_stop, args.command_rate))
    steady_start = time.perf_counter()
    await asyncio.sleep(args.duration)
    ctl_stop.set()
    await ctl
    steady_s = time.perf_counter() - steady_start
    heartbeats = len(stats.hb_latency)
    await asyncio.sleep(1.0)  # the last deliveries and events land
    stop.set()
    progress(f"steady phase over; waiting at most {args.poll_wait + 5:g} s for the last commands' deliveries")
    # Only the deliveries are waited for (a command not received by then is lost): the jobs' open
    # polls are then cut, and the server ends a long-poll whose client left; waiting for each to
    # end by its own wait held every row up to --poll-wait seconds more.
    deadline = time.perf_counter() + args.poll_wait + 5
    while time.perf_counter() < deadline and any(cid not in stats.received for cid in stats.sent):
        await asyncio.sleep(0.1)
    for task in [*runners, *streams]:
        task.cancel()
    for j in jobs:
        j.control.close()
        j.poll.close()
    for c in cmd_conns:
        c.close()

    progress(f"burst: {args.burst_concurrency} connections for {args.burst_seconds:g} s")
    cpu = CpuWindow(server_cpu)
    burst_rate, burst_lat = await burst(jobs, base, args.burst_seconds, args.burst_concurrency)
    burst_cpu = cpu.end()
    for cid, sent in stats.sent.items():
        if cid in stats.received:
            stats.delivery.append(stats.received[cid][0] - sent)
            stats.server_delivery.append(stats.received[cid][1] - stats.created_wall[cid])
    for cid, arrived in stats.event_arrivals:
        if cid in stats.sent:
            stats.event_latency.append(arrived - stats.sent[cid])
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
        "burst_cpu": burst_cpu,
        "commands": len(stats.delivery),
        "undelivered": len(lost),
        "del_p50": pct(stats.delivery, 0.5),
        "del_p99": pct(stats.delivery, 0.99),
        "del_p90": pct(stats.delivery, 0.9),
        "del_p95": pct(stats.delivery, 0.95),
        "del_max": max(stats.delivery) if stats.delivery else float("nan"),
        "srv_del_p99": pct(stats.server_delivery, 0.99),
        "events": len(stats.event_latency),
        "ev_p50": pct(stats.event_latency, 0.5),
        "ev_p99": pct(stats.event_latency, 0.99),
        "post_p50": pct(stats.post_latency, 0.5),
        "post_p99": pct(stats.post_latency, 0.99),
        "errors": stats.errors,
        "error_kinds": ", ".join(f"{kind} {count}" for kind, count in stats.error_kinds.most_common()),
        "refused": stats.refused,
    }


# --- main -----------------------------------------------------------------------------------


def _server_cpu(server: Server | Replicas) -> list[float]:
    return _listed(server.cpu_seconds())


def _listed(cpu: float | list[float]) -> list[float]:
    return cpu if isinstance(cpu, list) else [cpu]


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
        "event p50 ms",
        "event p99 ms",
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
                fmt_ms(r["ev_p50"]),
                fmt_ms(r["ev_p99"]),
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
        "deliv: controller sends POST /commands -> the job's open long-poll returns it. event: the same POST -> "
        f"its 'created' event on each of {args.dashboards} open event streams. "
        "lost: created but not received within the run."
    )
    print(
        "load: the machine's 1-minute load average at the start and the end of the run; server CPU: the share "
        "of one core each server process used over the run"
    )
    for r in rows:
        print(f"  {r['backend']}, {r['n']} jobs: load {r['load']}; server CPU {r['cpu']}")
    print("burst hb/s, what bounded it (cores used on average during the burst; 1.00 is one core):")
    for r in rows:
        print(f"  {r['backend']}, {r['n']} jobs: {r['burst_cpu'].said()}")
    if len(rows) > 1 and args.replicas:
        first = rows[0]
        print(f"ratio to {first['backend']}:")
        for r in rows[1:]:
            print(
                f"  {r['backend']}: burst hb/s x{r['burst_rate'] / first['burst_rate']:.2f}, "
                f"steady hb p99 x{r['hb_p99'] / first['hb_p99']:.2f}, "
                f"deliv p99 x{r['del_p99'] / first['del_p99']:.2f}, "
                f"event p99 x{r['ev_p99'] / first['ev_p99']:.2f}"
            )


def save_logs(server: Server | Replicas, folder: Path, label: str) -> None:
    """After a row's servers stopped: the last lines each printed (bench/live_server.py keeps 50)
    and, for replicas, nginx's error log."""
    folder.mkdir(parents=True, exist_ok=True)
    servers = server.servers if isinstance(server, Replicas) else [server]
    for i, one in enumerate(servers):
        (folder / f"{label}-server-{i}.log").write_text("".join(line + "\n" for line in one.output))
    if isinstance(server, Replicas) and hasattr(server, "front"):
        error_log = server.front.work / "error.log"
        if error_log.exists():
            shutil.copy(error_log, folder / f"{label}-nginx-error.log")


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
    parser.add_argument("--hosts", type=int, default=0, help="hosts the jobs are spread over (jobs / --gpus-per-host)")
    parser.add_argument("--dashboards", type=int, default=2, help="event streams open, as dashboards")
    parser.add_argument(
        "--replicas",
        default="",
        help="e.g. 1,3: that many servers on one PostgreSQL behind nginx, a row each (--backends is then ignored)",
    )
    parser.add_argument("--postgres-url", default=os.environ.get("FLEXIUM_TEST_POSTGRES_URL"))
    parser.add_argument(
        "--register-concurrency", type=int, default=32, help="registrations under way at once in the start's storm"
    )
    parser.add_argument(
        "--warmup-limit",
        type=float,
        default=120.0,
        help="the most seconds the warm-up waits for every job's first heartbeat and a prompt /healthz",
    )
    parser.add_argument("--logs", default="", help="a folder for each row's servers' last lines and nginx's error log")
    args = parser.parse_args(argv)
    tune_client()
    rows = []
    work = tempfile.mkdtemp(prefix="flexium-bench.")
    databases = Databases(work, args.postgres_url)
    interrupted = False
    try:
        runs = [("postgresql", int(k)) for k in args.replicas.split(",")] if args.replicas else []
        runs = runs or [(backend, 0) for backend in args.backends.split(",")]
        for backend, replicas in runs:
            for n in [int(x) for x in args.jobs.split(",")]:
                with databases.fresh(backend, f"bench-{n}") as url:
                    options = quota_options(n, args)
                    progress(f"starting {max(replicas, 1)} server(s)" + (" and nginx" if replicas else ""))
                    server = Replicas(url, work, replicas, options) if replicas else Server(url, work, options)
                    label = f"{backend} x{replicas} (nginx)" if replicas else backend
                    try:
                        print(f"== {label}, {n} jobs on {host_count(n, args)} hosts", flush=True)
                        load = os.getloadavg()[0]
                        cpu = server.cpu_seconds()
                        started = time.perf_counter()
                        row = asyncio.run(
                            bench_once(server.port, server.token, n, args, functools.partial(_server_cpu, server))
                        )
                        used = [b - a for a, b in zip(_listed(cpu), _listed(server.cpu_seconds()), strict=True)]
                        wall = time.perf_counter() - started
                        row["backend"] = label
                        row["load"] = f"{load:.1f} -> {os.getloadavg()[0]:.1f}"
                        row["cpu"] = " + ".join(f"{u / wall:.0%}" for u in used)
                        rows.append(row)
                        print(
                            f"   registered in {row['register_s']:.1f} s, warm-up {row['warmup_s']:.1f} s; "
                            f"{row['commands']} commands, "
                            f"delivery p90/p95/p99 {fmt_ms(row['del_p90'])}/{fmt_ms(row['del_p95'])}/"
                            f"{fmt_ms(row['del_p99'])} ms "
                            f"(from the server's commit: p99 {fmt_ms(row['srv_del_p99'])} ms), "
                            f"events p99 {fmt_ms(row['ev_p99'])} ms, "
                            f"heartbeat p99 {fmt_ms(row['hb_p99'])} ms, errors {row['errors']}"
                            + (f" ({row['error_kinds']})" if row["error_kinds"] else ""),
                            flush=True,
                        )
                    finally:
                        server.stop()
                        if args.logs:
                            save_logs(
                                server, Path(args.logs), f"{backend}-x{replicas}-{n}" if replicas else f"{backend}-{n}"
                            )
    except KeyboardInterrupt:  # ci/bench-replicas.sh's time limit, or Ctrl-C: the rows finished still count
        interrupted = True
        print(f"\ninterrupted (SIGINT) after {len(rows)} finished row(s)", flush=True)
    finally:
        databases.close()
        shutil.rmtree(work, ignore_errors=True)
    print_table(rows, args)
    return 1 if interrupted else 0


if __name__ == "__main__":
    sys.exit(main())
