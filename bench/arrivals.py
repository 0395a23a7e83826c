"""bench/fleet.py's workload and its baseline. The workload: jobs arriving at random on a fleet of
hosts (a seeded Poisson process), each with a host, a memory size, a priority and a running time
drawn from given mixes. The baseline: the same arrivals with static placement, as a team without
flexium shares GPUs: a job waits until a whole GPU of its host is free (a higher priority first,
first come first served within one), holds it until it ends and never moves."""

from __future__ import annotations

import heapq
import random
from collections.abc import Sequence
from dataclasses import dataclass

from flexium import protocol

GIB = 1 << 30


@dataclass(frozen=True)
class Arrival:
    index: int
    at: float  # seconds from the start of the run
    host: int
    memory: int  # bytes
    priority: str  # a name of protocol.PRIORITIES
    running_s: float  # how long it trains before it ends (paused time does not count)

    @property
    def rank(self) -> int:
        return protocol.PRIORITIES[self.priority]


def parse_mix(text: str) -> list[tuple[str, float]]:
    """``"16:0.4,40:0.6"`` -> [("16", 0.4), ("40", 0.6)]: values and their weights."""
    mix = []
    for part in text.split(","):
        value, _, weight = part.partition(":")
        mix.append((value.strip(), float(weight) if weight else 1.0))
    if not mix or any(weight < 0 for _, weight in mix) or sum(weight for _, weight in mix) <= 0:
        raise ValueError(f"{text!r} is not a mix like 16:0.4,40:0.6")
    return mix


def draw_arrivals(
    *,
    seed: int,
    rate: float,
    window_s: float,
    hosts: int,
    sizes_gib: Sequence[tuple[str, float]],
    priorities: Sequence[tuple[str, float]],
    running_s: float,
) -> list[Arrival]:
    """Arrivals at ``rate`` per second for ``window_s`` seconds; a job's running time is uniform in
    0.5..1.5 x ``running_s``."""
    rng = random.Random(seed)
    sizes = [int(float(value) * GIB) for value, _ in sizes_gib]
    size_weights = [weight for _, weight in sizes_gib]
    names = [name for name, _ in priorities]
    for name in names:
        if name not in protocol.PRIORITIES:
            raise ValueError(f"priority {name!r} is not one of {', '.join(protocol.PRIORITIES)}")
    name_weights = [weight for _, weight in priorities]
    arrivals: list[Arrival] = []
    at = rng.expovariate(rate)
    while at < window_s:
        arrivals.append(
            Arrival(
                index=len(arrivals),
                at=at,
                host=rng.randrange(hosts),
                memory=rng.choices(sizes, size_weights)[0],
                priority=rng.choices(names, name_weights)[0],
                running_s=rng.uniform(0.5, 1.5) * running_s,
            )
        )
        at += rng.expovariate(rate)
    return arrivals


@dataclass(frozen=True)
class StaticRun:
    started: dict[int, float]  # arrival index -> when it started (seconds from the start)
    memory_in_use: list[tuple[float, int]]  # (seconds, bytes in use on the fleet from then on)


def static_placement(arrivals: Sequence[Arrival], *, gpus_per_host: int, until: float) -> StaticRun:
    """The baseline, as a discrete-event simulation of the same arrivals up to ``until``."""
    free = {host: gpus_per_host for host in {a.host for a in arrivals}}
    waiting: dict[int, list[tuple[int, int, Arrival]]] = {host: [] for host in free}  # (-rank, index, job)
    events: list[tuple[float, int, int]] = [(a.at, 1, a.index) for a in arrivals]  # (t, 0 ends / 1 arrives, index)
    heapq.heapify(events)
    started: dict[int, float] = {}
    in_use, memory_in_use = 0, [(0.0, 0)]
    while events and events[0][0] <= until:
        t, kind, index = heapq.heappop(events)
        job = arrivals[index]
        if kind == 0:
            free[job.host] += 1
            in_use -= job.memory
        else:
            heapq.heappush(waiting[job.host], (-job.rank, index, job))
        while free[job.host] and waiting[job.host]:
            _, _, next_job = heapq.heappop(waiting[job.host])
            free[job.host] -= 1
            in_use += next_job.memory
            started[next_job.index] = t
            heapq.heappush(events, (t + next_job.running_s, 0, next_job.index))
        memory_in_use.append((t, in_use))
    return StaticRun(started=started, memory_in_use=memory_in_use)
