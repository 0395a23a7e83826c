"""What a measured phase used of this machine's cores, and so what bounded it: the server
processes, this benchmark's own client, and the rest (nginx, PostgreSQL, other processes), from
``/proc`` (Linux)."""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass

SATURATED = 0.9  # a share of the cores (or of one core) this high is where the phase was bound


def _machine_jiffies() -> tuple[int, int, int]:
    """(busy, total) jiffies of every core since boot, and how many cores."""
    with open("/proc/stat") as stat:
        lines = stat.read().splitlines()
    fields = [int(x) for x in lines[0].split()[1:]]
    idle = fields[3] + fields[4]  # idle, iowait
    cores = sum(1 for line in lines if line.startswith("cpu") and line[3:4].isdigit())
    return sum(fields) - idle, sum(fields), cores


@dataclass(frozen=True)
class CpuUse:
    """Cores used on average over a phase (1.0: one core all the time)."""

    cores: int
    machine: float
    servers: tuple[float, ...]
    client: float

    @property
    def rest(self) -> float:
        return max(0.0, self.machine - sum(self.servers) - self.client)

    def bound(self) -> str:
        """What bounded the phase, in words."""
        if self.machine >= SATURATED * self.cores:
            return (
                f"the machine's {self.cores} cores (all busy): the ratio is what more replicas gain on this "
                "machine, not on machines of their own"
            )
        busiest = max(self.servers)
        if busiest >= SATURATED:
            return "one server process's core (its event loop): more replicas, or cores for them, raise it"
        return "neither the cores nor one server's core: the client's round trips (more connections raise it)"

    def said(self) -> str:
        servers = " + ".join(f"{s:.2f}" for s in self.servers)
        return (
            f"{self.machine:.2f} of {self.cores} cores busy: servers {servers}, this client {self.client:.2f}, "
            f"the rest (nginx, PostgreSQL, other processes) {self.rest:.2f}; bound by {self.bound()}"
        )


class CpuWindow:
    """Started at a phase's beginning; ``end`` says what the phase used."""

    def __init__(self, server_cpu: Callable[[], list[float]]) -> None:
        self._server_cpu = server_cpu
        self._wall = time.perf_counter()
        self._machine = _machine_jiffies()
        self._servers = server_cpu()
        self._client = time.process_time()

    def end(self) -> CpuUse:
        wall = time.perf_counter() - self._wall
        busy, total, cores = _machine_jiffies()
        machine = (busy - self._machine[0]) / max(1, total - self._machine[1]) * cores
        servers = tuple((b - a) / wall for a, b in zip(self._servers, self._server_cpu(), strict=True))
        return CpuUse(cores=cores, machine=machine, servers=servers, client=(time.process_time() - self._client) / wall)
