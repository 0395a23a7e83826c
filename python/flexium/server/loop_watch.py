"""Stalls of the server's event loop, found and named.

Every request, heartbeat and long-poll of a server is answered on one thread, so a stretch in
which that thread does not come back to its loop delays them all, and a training job's heartbeat
times out without anyone knowing why. A ticker on the loop notes when it last ran and how much CPU
its thread had used by then; a thread of its own looks four times a second. Once the loop is late
by ``stall_s``, the watcher samples where the loop's thread is at each look; when the loop runs
again, one warning says for how long it did not, what the time went to, and where the thread was:

- the CPU its own thread used: it was working (a slow query, a page too big);
- the CPU the server's other threads used: they held the interpreter (the GIL) meanwhile;
- the rest: it waited, for the CPU (the load average says whether the machine had any to give),
  the disk or a lock.

Each stall is counted in ``/metrics`` (``flexium_server_loop_stall_seconds``, a histogram of their lengths).
"""

from __future__ import annotations

import asyncio
import logging
import os
import re
import sys
import threading
import time
import traceback
from collections import Counter
from dataclasses import dataclass, field
from types import FrameType
from typing import NamedTuple

from flexium.server.metrics import Metrics

log = logging.getLogger("flexium.server")

STALL_S = 1.0  # a loop this late is stalled: heartbeats and polls are answered in milliseconds
TICK_S = 0.1
LOOK_S = 0.25
FRAMES_SHOWN = 4  # the innermost frames of each place named
_INSTALLED_UNDER = re.compile(r"^.*/(?:site-packages|dist-packages|lib/python3\.\d+)/")


class Ran(NamedTuple):
    """When the loop last ran, and the CPU its thread and the whole process had used by then."""

    at: float
    loop_cpu: float
    process_cpu: float

    @classmethod
    def now(cls) -> Ran:
        return cls(time.monotonic(), time.thread_time(), time.process_time())


@dataclass(frozen=True)
class Stall:
    """One stretch in which the loop did not run: ``seconds`` long, in which its thread used
    ``loop_cpu_s`` of CPU and the whole server process ``process_cpu_s``; ``places`` are where
    the watcher found the loop's thread, most seen first, with how often."""

    seconds: float
    loop_cpu_s: float
    process_cpu_s: float
    places: list[tuple[str, int]] = field(default_factory=list)
    load_average: float | None = None

    @property
    def cause(self) -> str:
        others = max(0.0, self.process_cpu_s - self.loop_cpu_s)
        waited = max(0.0, self.seconds - self.loop_cpu_s - others)
        load = "" if self.load_average is None else f"; load average {self.load_average:.1f} on {os.cpu_count()} cores"
        return (
            f"its thread worked {self.loop_cpu_s:.1f} s of it, the server's other threads {others:.1f} s, "
            f"and it waited {waited:.1f} s (for the CPU, the disk or a lock{load})"
        )

    def message(self) -> str:
        where = (
            "; ".join(f"{place} ({n}×)" for place, n in self.places[:2])
            if self.places
            else "not seen (the watcher itself got no turn)"
        )
        return (
            f"the event loop did not run for {self.seconds:.1f} s (every request, heartbeat and poll waited): "
            f"{self.cause}. Its thread was at: {where}. If this repeats, give the server more CPU or a faster "
            "disk, or move its database to PostgreSQL"
        )


class LoopWatch:
    """Started on the loop (``start``), stopped there (``stop``); ``stalls`` keeps the last few."""

    def __init__(self, metrics: Metrics | None = None, *, stall_s: float = STALL_S) -> None:
        self.metrics = metrics
        self.stall_s = stall_s
        self.stalls: list[Stall] = []
        self._ran = Ran.now()
        self._loop_thread: int | None = None
        self._ticker: asyncio.Task[None] | None = None
        self._watcher: threading.Thread | None = None
        self._stop = threading.Event()

    def start(self) -> None:
        self._loop_thread = threading.get_ident()
        self._ran = Ran.now()
        self._stop.clear()
        self._ticker = asyncio.get_running_loop().create_task(self._tick())
        self._watcher = threading.Thread(target=self._watch, name="flexium-loop-watch", daemon=True)
        self._watcher.start()

    async def stop(self) -> None:
        self._stop.set()
        if self._ticker is not None:
            self._ticker.cancel()
            try:
                await self._ticker
            except asyncio.CancelledError:
                pass
        if self._watcher is not None:
            await asyncio.to_thread(self._watcher.join, 5)

    async def _tick(self) -> None:
        while True:
            self._ran = Ran.now()
            await asyncio.sleep(TICK_S)

    def _watch(self) -> None:
        stalled_since: Ran | None = None
        places: Counter[str] = Counter()
        while not self._stop.wait(LOOK_S):
            ran = self._ran
            if stalled_since is not None and ran.at > stalled_since.at:
                self._report(stalled_since, ran, places)
                stalled_since, places = None, Counter()
            if time.monotonic() - ran.at >= self.stall_s + TICK_S:
                stalled_since = ran
                place = self._loop_place()
                if place is not None:
                    places[place] += 1

    def _loop_place(self) -> str | None:
        frame = sys._current_frames().get(self._loop_thread or -1)
        return None if frame is None else describe_place(frame)

    def _report(self, before: Ran, after: Ran, places: Counter[str]) -> None:
        seconds = after.at - before.at - TICK_S  # the ticker sleeps TICK_S between notes by design
        try:
            load: float | None = os.getloadavg()[0]
        except OSError:
            load = None
        stall = Stall(
            seconds=seconds,
            loop_cpu_s=after.loop_cpu - before.loop_cpu,
            process_cpu_s=after.process_cpu - before.process_cpu,
            places=places.most_common(),
            load_average=load,
        )
        self.stalls = [*self.stalls[-9:], stall]
        if self.metrics is not None:
            self.metrics.loop_stalls.observe(seconds)
        log.warning("%s", stall.message())


def describe_place(frame: FrameType) -> str:
    """The innermost frames of a stack, innermost first: ``flexium/server/db.py:229 call ← ...``,
    paths from the package folder on."""
    frames = traceback.extract_stack(frame)[-FRAMES_SHOWN:]
    return " ← ".join(f"{_short_path(f.filename)}:{f.lineno} {f.name}" for f in reversed(frames))


def _short_path(path: str) -> str:
    return _INSTALLED_UNDER.sub("", path)
