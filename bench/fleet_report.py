"""bench/fleet.py's table: what the policy run and the static baseline measured over the same
window, side by side with their ratio. Every figure is computed here from the runs' records."""

from __future__ import annotations

import argparse
from collections.abc import Sequence
from dataclasses import dataclass, field

from arrivals import Arrival, StaticRun
from tables import pct, print_table

TIB = 1 << 40
GOAL_HIGH_START_S = 2.0


@dataclass(frozen=True)
class Measured:
    started: dict[int, float]  # arrival index -> when it first ran (seconds from the start)
    memory_in_use: list[tuple[float, int]]  # (seconds, bytes in use on the fleet from then on)
    pauses: int = 0  # jobs paused to make room
    paused_s: list[float] = field(default_factory=list)  # per job paused: its time paused
    decision_s: list[float] = field(default_factory=list)  # the last report of its host -> a command created
    room_to_resume_s: list[float] = field(default_factory=list)  # room given back (or the wait) -> its resume
    high_breakdown: list[tuple[float, float]] = field(default_factory=list)  # (arrival -> resume, -> running)
    commands: int = 0
    errors: list[str] = field(default_factory=list)
    room_refused: list[str] = field(default_factory=list)  # high priority queued instead, and why
    queued_s: list[float] = field(default_factory=list)  # arrival -> registered and its POST /waits answered
    lateness_s: float = 0.0  # how late the client started the latest arrival
    server_metrics: dict[str, float] = field(default_factory=dict)
    server_cpu_s: float = 0.0  # CPU time the server used during the run
    client_cpu_s: float = 0.0  # and this process, every simulated job's
    wall_s: float = 0.0


def static_measured(arrivals: Sequence[Arrival], run: StaticRun) -> Measured:
    return Measured(started=run.started, memory_in_use=run.memory_in_use)


def mean_in_use(points: Sequence[tuple[float, int]], start: float, end: float) -> float:
    """The time-weighted mean of a step function given by its change points, over [start, end]."""
    ordered = sorted(points)
    area, value, at = 0.0, 0, start
    for t, used in ordered:
        if t > at:
            area += value * (min(t, end) - at)
            at = min(t, end)
        value = used
    area += value * max(0.0, end - at)
    return area / (end - start) if end > start else float("nan")


def waits_by_priority(
    arrivals: Sequence[Arrival], started: dict[int, float], start: float, end: float, cutoff: float
) -> tuple[dict[str, list[float]], int]:
    """Waits to start of the jobs arriving in [start, end], by priority; a job not started by
    ``cutoff`` counts its wait until then. The count of those is the second value."""
    waits: dict[str, list[float]] = {}
    unstarted = 0
    for a in arrivals:
        if not start <= a.at <= end:
            continue
        began = started.get(a.index)
        if began is None or began > cutoff:
            unstarted += 1
            began = cutoff
        waits.setdefault(a.priority, []).append(max(0.0, began - a.at))
    return waits, unstarted


def seconds(value: float) -> str:
    if value != value:
        return "-"
    return f"{value * 1000:.0f} ms" if value < 1 else f"{value:.1f} s"


def ratio(policy: float, static: float) -> str:
    if policy != policy or static != static or static == 0:
        return "-"
    return f"{policy / static:.2f}"


def print_report(
    backend: str, arrivals: Sequence[Arrival], policy: Measured, static: Measured, args: argparse.Namespace
) -> None:
    start, end, cutoff = args.warmup, args.duration, args.duration + args.drain
    gpus = args.hosts * args.gpus_per_host
    fleet_bytes = gpus * args.gpu_memory * (1 << 30)
    rows: list[tuple[str, str, str, str]] = []

    def row(name: str, p: float, s: float, show: str = "s") -> None:
        shown = {
            "s": seconds,
            "%": lambda v: "-" if v != v else f"{v:.1%}",
            "n": lambda v: "-" if v != v else f"{v:.0f}",
        }[show]
        rows.append((name, shown(p), shown(s), ratio(p, s)))

    measured_in = [a for a in arrivals if start <= a.at <= end]
    row("jobs arriving in the window", len(measured_in), len(measured_in), "n")
    p_mem = mean_in_use(policy.memory_in_use, start, end)
    s_mem = mean_in_use(static.memory_in_use, start, end)
    row("mean GPU memory in use", p_mem / fleet_bytes, s_mem / fleet_bytes, "%")
    p_waits, p_unstarted = waits_by_priority(arrivals, policy.started, start, end, cutoff)
    s_waits, s_unstarted = waits_by_priority(arrivals, static.started, start, end, cutoff)
    for name in ("high", "normal", "low"):
        if name in p_waits or name in s_waits:
            for q, label in ((0.5, "p50"), (0.99, "p99")):
                row(f"wait to start, {name}, {label}", pct(p_waits.get(name, []), q), pct(s_waits.get(name, []), q))
    row(f"not started by {cutoff:g} s", p_unstarted, s_unstarted, "n")
    high_p, high_s = p_waits.get("high", []), s_waits.get("high", [])
    row("high-priority time-to-start, max", max(high_p, default=float("nan")), max(high_s, default=float("nan")))
    within = sum(w < GOAL_HIGH_START_S for w in high_p) / len(high_p) if high_p else float("nan")
    within_s = sum(w < GOAL_HIGH_START_S for w in high_s) / len(high_s) if high_s else float("nan")
    row(f"high-priority started within {GOAL_HIGH_START_S:g} s", within, within_s, "%")
    rows.append(
        (
            "arrival -> registered and queued, p50 / p99",
            f"{seconds(pct(policy.queued_s, 0.5))} / {seconds(pct(policy.queued_s, 0.99))}",
            "-",
            "-",
        )
    )
    rows.append(("high priority: make-room refused, queued", str(len(policy.room_refused)), "-", "-"))
    rows.append(("jobs paused to make room", str(policy.pauses), "0", "-"))
    rows.append(
        (
            "  their time paused, p50 / p99",
            f"{seconds(pct(policy.paused_s, 0.5))} / {seconds(pct(policy.paused_s, 0.99))}",
            "-",
            "-",
        )
    )
    rows.append(
        (
            "decision: last report -> command, p50 / p99",
            f"{seconds(pct(policy.decision_s, 0.5))} / {seconds(pct(policy.decision_s, 0.99))}",
            "-",
            "-",
        )
    )
    rows.append(
        (
            "room freed -> its resume created, p50 / p99",
            f"{seconds(pct(policy.room_to_resume_s, 0.5))} / {seconds(pct(policy.room_to_resume_s, 0.99))}",
            "-",
            "-",
        )
    )
    passes = policy.server_metrics.get("flexium_queue_decision_seconds_count", 0.0)
    spent = policy.server_metrics.get("flexium_queue_decision_seconds_sum", float("nan"))
    rows.append(
        ("queue passes, mean time in one", f"{passes:.0f}, {seconds(spent / passes if passes else spent)}", "-", "-")
    )
    print()
    print(
        f"fleet benchmark ({backend}): {args.hosts} hosts x {args.gpus_per_host} GPUs of {args.gpu_memory:g} GiB "
        f"({gpus} GPUs); {len(arrivals)} jobs at {args.rate:g}/s for {args.duration:g} s (seed {args.seed}), "
        f"running {args.running_s:g} s x 0.5..1.5, sizes {args.sizes} GiB, priorities {args.priorities}; "
        f"pause/resume/move {args.operation_s:g} s; measured on arrivals in {start:g}..{end:g} s"
    )
    print_table(("", "flexium", "static", "flexium/static"), rows)
    if policy.high_breakdown:
        to_command = pct([b[0] for b in policy.high_breakdown], 0.5)
        to_running = pct([b[1] for b in policy.high_breakdown], 0.5)
        print(
            f"high priority, median: arrival -> its resume created {seconds(to_command)}, "
            f"-> running {seconds(to_running)} (its delivery; the pauses that made room come before its resume)"
        )
    print(
        f"{policy.commands} commands; the client started its latest arrival {seconds(policy.lateness_s)} late; "
        f"{len(policy.errors)} errors; CPU over the {policy.wall_s:.0f} s run: the server "
        f"{policy.server_cpu_s:.0f} s ({policy.server_cpu_s / max(policy.wall_s, 1e-9):.0%} of a core), "
        f"the simulated jobs {policy.client_cpu_s:.0f} s"
    )
    for error in policy.errors[:5]:
        print(f"  {error}")
    for refusal in policy.room_refused[:3]:
        print(f"  make-room refused: {refusal}")
