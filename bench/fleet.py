"""Fleet benchmark: flexium's server as a team's GPU allocator. A real ``flexium server`` and
simulated training jobs speaking the real protocol over HTTP (bench/simulated_job.py) on a fleet
of simulated hosts (50 x 8 GPUs of 141 GiB by default), jobs arriving at random and leaving when
they have trained their time (bench/arrivals.py: seeded; rate, running time, size and priority
mixes are options).

Policy run: a job that arrives registers paused (it needs its memory, it holds none, it has no GPU
yet) and is queued to resume when free on its host (``POST /waits``); a high-priority one asks for
room to be made (``make_room``: the server pauses jobs of lower priority for it and queues them to
resume when free). The server then places and moves every job itself; the jobs carry out its
commands (a pause or resume of a job that has trained takes ``--operation-s``) and tell it when
room they wait for appears. Baseline, the same arrivals with static placement: a job waits until
a whole GPU of its host is free and never moves (bench/arrivals.py). Measured over the window
after the warm-up: the fleet's mean GPU memory in use, each priority's wait to start p50/p99,
the high-priority time-to-start, and the server's decision latency (from the report that lets it
decide to the command it creates, by the server's own timestamp).

Usage: python bench/fleet.py [--hosts 50] [--gpus-per-host 8] [--rate 3] [--backends sqlite]
PostgreSQL as bench/server.py finds it (--postgres-url, $FLEXIUM_TEST_POSTGRES_URL, or a throwaway
cluster when root). Every loop is bounded in time; the run stops by itself.
"""

from __future__ import annotations

import argparse
import asyncio
import bisect
import contextlib
import dataclasses
import os
import shutil
import sys
import tempfile
import time
import urllib.request
from dataclasses import dataclass, field
from typing import Any

from arrivals import GIB, Arrival, draw_arrivals, parse_mix, static_placement
from fleet_report import Measured, print_report, static_measured
from http_client import Conn, tune_client
from live_server import Databases, Server
from simulated_job import BASE, Observer, SimulatedHost, SimulatedJob


@dataclass
class JobRecord:
    arrival: Arrival
    arrived: float  # wall clock, as scheduled
    queued: float | None = None  # its POST /waits answered
    started: float | None = None
    start_created: float | None = None  # the resume that started it: when the server created it
    paused: list[float] = field(default_factory=list)  # wall clock of each pause to make room
    paused_s: float = 0.0
    on: tuple[str, str | None] = ("PAUSED", None)  # (state, GPU) at its last change


class Fleet(Observer):
    """What the policy run records, as the jobs see it happen."""

    def __init__(self, hosts: list[SimulatedHost]) -> None:
        self.hosts = hosts
        self.records: dict[str, JobRecord] = {}
        self.reports: dict[str, list[float]] = {h.name: [] for h in hosts}  # host -> sent, wall clock
        self.freed: dict[str, list[float]] = {}  # GPU -> when memory on it was given back
        self.commands: list[tuple[str, dict[str, Any], float]] = []  # (host, command, received wall clock)
        self.memory_in_use: list[tuple[float, int]] = []
        self.errors: list[str] = []
        self.room_refused: list[str] = []  # high-priority jobs queued instead: why make-room was refused

    def reported(self, job: SimulatedJob, sent_wall: float) -> None:
        self.reports[job.host.name].append(sent_wall)

    def command(self, job: SimulatedJob, command: dict[str, Any], received: float, received_wall: float) -> None:
        self.commands.append((job.host.name, command, received_wall))
        record = self.records[job.process_id]
        if command["kind"] == "resume" and record.started is None:
            record.start_created = command["created_at"]

    def state(self, job: SimulatedJob, wall: float) -> None:
        record = self.records[job.process_id]
        gpu = None if job.gpu is None else job.gpu.uuid
        was_state, was_gpu = record.on
        if was_state == "RUNNING" and was_gpu is not None and (job.state != "RUNNING" or gpu != was_gpu):
            self.freed.setdefault(was_gpu, []).append(wall)
        if job.state == "RUNNING" and record.started is None:
            record.started = wall
        if job.state == "PAUSED" and was_state == "RUNNING":
            record.paused.append(wall)
        if job.state == "RUNNING" and was_state == "PAUSED" and record.paused:
            record.paused_s += wall - record.paused[-1]
        record.on = (job.state, gpu)
        self.memory_in_use.append((wall, sum(g.memory_used for h in self.hosts for g in h.gpus)))

    def error(self, job: SimulatedJob, what: str) -> None:
        self.errors.append(f"{job.process_id}: {what}")

    def last_report(self, host: str, before: float) -> float | None:
        sent = self.reports[host]
        k = bisect.bisect_right(sent, before)
        return sent[k - 1] if k else None

    def last_freed(self, gpu: str, before: float) -> float | None:
        freed = self.freed.get(gpu, [])
        k = bisect.bisect_right(freed, before)
        return freed[k - 1] if k else None


async def run_job(
    job: SimulatedJob, arrival: Arrival, fleet: Fleet, waits: dict[str, float], stop: asyncio.Event
) -> None:
    """One job from its arrival to its end: registered paused, queued (room made for a high
    priority), carrying out the server's commands until it has trained its time, then gone.
    ``stop`` ends its loops even where a cancellation is lost (``asyncio.wait_for`` can lose one)."""
    await job.register()
    admin = job.control  # the bench's one token is the admin's: the job queues itself
    async with admin.lock:
        body: dict[str, Any] = {"process_id": job.process_id}
        if arrival.priority == "high":
            body["make_room"] = True
        sent = time.time()
        status, answer = await admin.request("POST", f"{BASE}/waits", body)
        if status == 422 and "make_room" in body:  # no GPU of its host can be made room on: it waits
            fleet.room_refused.append(f"{job.process_id}: {answer['message']}")
            sent = time.time()
            status, answer = await admin.request("POST", f"{BASE}/waits", {"process_id": job.process_id})
    fleet.reported(job, sent)
    fleet.records[job.process_id].queued = time.time()
    if status != 201:
        fleet.errors.append(f"{job.process_id}: POST /waits {status} {answer}")
        return
    waits[job.process_id] = sent
    job.watch = answer.get("watch")  # what to watch, at once rather than at its next heartbeat
    life = asyncio.create_task(job.live(stop))
    try:
        left = arrival.running_s
        while left > 0:
            while job.state != "RUNNING":
                await job.changed().wait()
            began = time.monotonic()
            with contextlib.suppress(asyncio.TimeoutError):
                await asyncio.wait_for(job.changed().wait(), left)
            left -= time.monotonic() - began
        while job.executing:
            await job.changed().wait()
    finally:
        stop.set()
        life.cancel()
        await asyncio.wait([life], timeout=job.poll_wait + 5)
    job.poll.close()
    await job.leave()
    job.control.close()


async def policy_run(server: Server, arrivals: list[Arrival], args: argparse.Namespace) -> Measured:
    port, token = server.port, server.token
    hosts = [
        SimulatedHost.make(f"host-{h:03d}", args.gpus_per_host, int(args.gpu_memory * GIB)) for h in range(args.hosts)
    ]
    fleet = Fleet(hosts)
    waits: dict[str, float] = {}
    tasks: list[asyncio.Task[None]] = []
    jobs: list[SimulatedJob] = []
    stops: list[asyncio.Event] = []
    watching = asyncio.Event()
    watches = [asyncio.create_task(host.watch_rooms(watching)) for host in hosts]
    cpu = (server.cpu_seconds(), time.process_time())
    t0 = time.time() + 0.5
    lateness = 0.0
    shown = t0
    for arrival in arrivals:
        delay = t0 + arrival.at - time.time()
        if delay > 0:
            await asyncio.sleep(delay)
        lateness = max(lateness, -delay)
        job = SimulatedJob(
            index=arrival.index,
            process_id=f"fleet-{arrival.index:05d}",
            host=hosts[arrival.host],
            gpu=None,
            memory=arrival.memory,
            control=Conn(port, token),
            poll=Conn(port, token),
            observer=fleet,
            heartbeat_interval=args.heartbeat_interval,
            poll_wait=args.poll_wait,
            report_devices=True,
            operation_s=args.operation_s,
            priority=arrival.rank,
        )
        fleet.records[job.process_id] = JobRecord(arrival, t0 + arrival.at)
        jobs.append(job)
        stops.append(asyncio.Event())
        tasks.append(asyncio.create_task(run_job(job, arrival, fleet, waits, stops[-1])))
        if time.time() >= shown + 30:
            shown = progress(fleet, t0, server, cpu[0])
    end = t0 + args.duration + args.drain
    while time.time() < end:
        await asyncio.sleep(min(30.0, max(0.0, end - time.time())))
        if time.time() >= shown + 30:
            shown = progress(fleet, t0, server, cpu[0])
    progress(fleet, t0, server, cpu[0])
    cpu = (server.cpu_seconds() - cpu[0], time.process_time() - cpu[1])
    wall = time.time() - t0
    watching.set()
    for stop in stops:
        stop.set()
    for task in tasks:
        task.cancel()
    for job in jobs:
        job.stop_telling()
    await asyncio.wait(tasks + watches, timeout=30)
    metrics = await asyncio.to_thread(read_metrics, port, token)
    for conn in [c for job in jobs for c in (job.control, job.poll)]:
        conn.close()
    run = measured(fleet, waits, t0, args, lateness, metrics)
    return dataclasses.replace(run, server_cpu_s=cpu[0], client_cpu_s=cpu[1], wall_s=wall)


def progress(fleet: Fleet, t0: float, server: Server, cpu0: float) -> float:
    """A line of how the run goes (the server's CPU share tells when it cannot keep up: a share well
    under a whole core, with the server behind, is the machine's limit); the time."""
    states = [record.on[0] for record in fleet.records.values()]
    now, cpu = time.time(), server.cpu_seconds() - cpu0
    print(
        f"   {now - t0:5.0f} s: {len(states)} arrived, {states.count('RUNNING')} running, "
        f"{sum(r.started is None for r in fleet.records.values())} not started, "
        f"{states.count('EXITED')} ended, {len(fleet.errors)} errors; server CPU {cpu:.0f} s "
        f"({cpu / max(1e-9, now - t0):.0%} of a core)",
        flush=True,
    )
    return now


def measured(
    fleet: Fleet,
    waits: dict[str, float],
    t0: float,
    args: argparse.Namespace,
    lateness: float,
    metrics: dict[str, float],
) -> Measured:
    started: dict[int, float] = {}
    paused_s: list[float] = []
    pauses = 0
    breakdown: list[tuple[float, float]] = []  # high priority: (arrival -> resume created, created -> running)
    queued = [r.queued - r.arrived for r in fleet.records.values() if r.queued is not None]
    for record in fleet.records.values():
        if record.started is not None:
            started[record.arrival.index] = record.started - t0
            if record.arrival.priority == "high" and record.start_created is not None:
                breakdown.append((record.start_created - record.arrived, record.started - record.start_created))
        pauses += len(record.paused)
        if record.paused:
            paused_s.append(record.paused_s)
    for sent in fleet.reports.values():
        sent.sort()
    decision, room_to_resume = [], []
    for host, command, _received in fleet.commands:
        created = command["created_at"]
        trigger = fleet.last_report(host, created)
        if trigger is not None:
            decision.append(created - trigger)
        if command["kind"] == "resume" and command.get("target_uuid"):
            freed = fleet.last_freed(command["target_uuid"], created) or 0.0
            paused = [t for t in fleet.records[command["process_id"]].paused if t <= created]
            asked = max([waits.get(command["process_id"], 0.0), *paused])
            room_to_resume.append(created - max(freed, asked))
    return Measured(
        started=started,
        memory_in_use=[(t - t0, used) for t, used in fleet.memory_in_use],
        pauses=pauses,
        paused_s=paused_s,
        decision_s=decision,
        room_to_resume_s=room_to_resume,
        high_breakdown=breakdown,
        commands=len(fleet.commands),
        errors=fleet.errors,
        room_refused=fleet.room_refused,
        queued_s=queued,
        lateness_s=lateness,
        server_metrics=metrics,
    )


def read_metrics(port: int, token: str) -> dict[str, float]:
    """The server's own count and time of its queue passes (Prometheus text, GET /metrics); none
    when a server still catching up does not answer within a minute."""
    found: dict[str, float] = {}
    try:
        asked = urllib.request.Request(f"http://127.0.0.1:{port}/metrics", headers={"Authorization": f"Bearer {token}"})
        with urllib.request.urlopen(asked, timeout=60) as answer:
            text = answer.read().decode()
    except OSError:
        return found
    for line in text.splitlines():
        name, _, value = line.partition(" ")
        if name in ("flexium_queue_decision_seconds_sum", "flexium_queue_decision_seconds_count"):
            found[name] = float(value)
    return found


def options(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        description=__doc__.split("\n\n")[0],
        formatter_class=argparse.ArgumentDefaultsHelpFormatter,
        epilog=(
            "The defaults are the documented 400-GPU run (docs/measurements.md, bench/README.md): about 7 minutes. "
            "It needs flexium with the server extra (pip install '.[server]'), no GPU and no network: the server "
            "listens on 127.0.0.1 and its database is a SQLite file in a temporary folder (PostgreSQL with "
            "--backends postgresql). The server's share of a core is printed every 30 s and at the end: on a "
            "machine where it stays well under one core, the figures say what the machine allows. The exit "
            "status is 1 when a job saw an error."
        ),
    )
    fleet = parser.add_argument_group("the fleet")
    fleet.add_argument("--hosts", type=int, default=50, help="simulated hosts")
    fleet.add_argument("--gpus-per-host", type=int, default=8, help="simulated GPUs per host")
    fleet.add_argument("--gpu-memory", type=float, default=141.0, help="GiB per GPU")
    jobs = parser.add_argument_group("the jobs (drawn from --seed)")
    jobs.add_argument("--rate", type=float, default=3.0, help="jobs arriving per second, on the whole fleet")
    jobs.add_argument("--running-s", type=float, default=150.0, help="a job's mean training time (0.5..1.5 x)")
    jobs.add_argument("--sizes", default="16:0.4,40:0.3,80:0.2,130:0.1", help="a job's memory: GiB:weight,...")
    jobs.add_argument("--priorities", default="low:0.3,normal:0.5,high:0.2", help="low|normal|high:weight,...")
    jobs.add_argument("--operation-s", type=float, default=0.5, help="a pause, resume or move of a started job")
    jobs.add_argument("--seed", type=int, default=1, help="the arrivals' random seed")
    jobs.add_argument("--heartbeat-interval", type=float, default=5.0, help="seconds between a job's heartbeats")
    jobs.add_argument("--poll-wait", type=float, default=25.0, help="a long-poll's wait (each 0.5..1 x)")
    run = parser.add_argument_group("the run")
    run.add_argument("--duration", type=float, default=360.0, help="seconds of arrivals")
    run.add_argument("--warmup", type=float, default=150.0, help="seconds before the measured window")
    run.add_argument("--drain", type=float, default=10.0, help="seconds after the arrivals, to start late jobs")
    run.add_argument("--backends", default="sqlite", help="sqlite, postgresql or both (sqlite,postgresql)")
    run.add_argument(
        "--postgres-url",
        default=os.environ.get("FLEXIUM_TEST_POSTGRES_URL"),
        help="an admin URL for --backends postgresql ($FLEXIUM_TEST_POSTGRES_URL; else a throwaway cluster when root)",
    )
    return parser.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    args = options(argv)
    arrivals = draw_arrivals(
        seed=args.seed,
        rate=args.rate,
        window_s=args.duration,
        hosts=args.hosts,
        sizes_gib=parse_mix(args.sizes),
        priorities=parse_mix(args.priorities),
        running_s=args.running_s,
    )
    static = static_measured(
        arrivals, static_placement(arrivals, gpus_per_host=args.gpus_per_host, until=args.duration + args.drain)
    )
    tune_client()
    work = tempfile.mkdtemp(prefix="flexium-fleet.")
    databases = Databases(work, args.postgres_url)
    failed = False
    try:
        for backend in args.backends.split(","):
            with databases.fresh(backend, "fleet") as url:
                server = Server(url, work)
                try:
                    print(f"== {backend}: {len(arrivals)} jobs arriving over {args.duration:g} s", flush=True)
                    policy = asyncio.run(policy_run(server, arrivals, args))
                finally:
                    server.stop()
            print_report(backend, arrivals, policy, static, args)
            failed = failed or bool(policy.errors)
    finally:
        databases.close()
        shutil.rmtree(work, ignore_errors=True)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
