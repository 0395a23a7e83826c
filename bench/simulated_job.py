"""A simulated training job speaking flexium's protocol over real HTTP, and the host whose GPUs it
uses (bench/server.py, bench/fleet.py). It registers, heartbeats, keeps a long-poll open and
carries out what comes: a pause gives its memory back to its GPU, a resume (after the job's own
room check: a resume without room is refused, as the engine refuses it) or a migration puts it on
the target, each reported running and then done. A job that reports its GPUs (``report_devices``)
does what the real client does: every heartbeat carries its host's GPU readings, one goes out
right after each command, and while it waits in the queue (``RoomWatch`` in the server's answers)
it reads its GPUs every ``protocol.ROOM_WATCH_INTERVAL_S`` (``SimulatedHost.watch_rooms``) and
tells the server when the room appears (``room_seen``)."""

from __future__ import annotations

import asyncio
import contextlib
import random
import time
from dataclasses import dataclass, field
from typing import Any

from flexium import protocol
from http_client import Conn

GIB = 1 << 30


@dataclass
class SimulatedGpu:
    uuid: str
    index: int
    memory_total: int
    memory_used: int = 0
    freed_at: float = 0.0  # wall clock: when memory on it was last given back

    @property
    def memory_free(self) -> int:
        return self.memory_total - self.memory_used


@dataclass
class SimulatedHost:
    name: str
    gpus: list[SimulatedGpu] = field(default_factory=list)
    watchers: set[SimulatedJob] = field(default_factory=set)  # its jobs that report their GPUs

    @classmethod
    def make(cls, name: str, gpus: int, memory_total: int = 141 * GIB) -> SimulatedHost:
        return cls(name, [SimulatedGpu(f"GPU-{name}-{g}", g, memory_total) for g in range(gpus)])

    def gpu(self, uuid: str) -> SimulatedGpu:
        return next(g for g in self.gpus if g.uuid == uuid)

    async def watch_rooms(self, stop: asyncio.Event) -> None:
        """The room watch of its jobs, on one timer: each waiting job reads its GPUs every
        ``protocol.ROOM_WATCH_INTERVAL_S`` as the real client does, without a timer of its own
        (thousands of them would take the cores the server needs)."""
        while not stop.is_set():
            await asyncio.sleep(protocol.ROOM_WATCH_INTERVAL_S)
            for job in list(self.watchers):
                job.look_for_room()

    def reports(self) -> list[dict[str, Any]]:
        return [
            {
                "uuid": g.uuid,
                "index": g.index,
                "name": "NVIDIA H200",
                "memory_total": g.memory_total,
                "memory_used": g.memory_used,
                "utilization": 90,
                "temperature": 60,
                "health": "ok",
            }
            for g in self.gpus
        ]


class Observer:
    """What a benchmark records of its jobs; each method is called as it happens (no-ops here)."""

    def heartbeat(self, job: SimulatedJob, seconds: float) -> None:
        pass

    def command(self, job: SimulatedJob, command: dict[str, Any], received: float, received_wall: float) -> None:
        pass

    def reported(self, job: SimulatedJob, sent_wall: float) -> None:
        """A request that can let the server decide (GPUs, a command's end, an exit) was sent."""

    def state(self, job: SimulatedJob, wall: float) -> None:
        """The job's state or GPU changed (``job.state``, ``job.gpu``)."""

    def error(self, job: SimulatedJob, what: str) -> None:
        pass


BASE = "/api/w/default"


class SimulatedJob:
    """One job of ``memory`` bytes on ``host``: running on ``gpu``, or paused (``gpu`` None: not
    started yet, placed by the server's first resume)."""

    def __init__(
        self,
        *,
        index: int,
        process_id: str,
        host: SimulatedHost,
        gpu: SimulatedGpu | None,
        memory: int,
        control: Conn,
        poll: Conn,
        observer: Observer,
        heartbeat_interval: float,
        poll_wait: float,
        report_devices: bool = False,
        operation_s: float = 0.0,
        priority: int | None = None,
    ) -> None:
        self.index = index
        self.process_id = process_id
        self.host = host
        self.gpu = gpu
        self.memory = memory
        self.control = control
        self.poll = poll
        self.observer = observer
        self.heartbeat_interval = heartbeat_interval
        self.poll_wait = poll_wait
        self.report_devices = report_devices
        self.operation_s = operation_s
        self.priority = priority
        self.state = "RUNNING" if gpu is not None else "PAUSED"
        self.started = gpu is not None
        self.busy = False  # a command is on its way or under way (bench/server.py's controller sets it)
        self.executing = False
        self.watch: dict[str, Any] | None = None
        self._told = False  # the room it waits for is there, and the server was told
        self._telling: asyncio.Task[None] | None = None
        self._wake = asyncio.Event()
        self._outcomes: dict[int, dict[str, Any]] = {}  # command id -> the report that ended it
        self._changed = asyncio.Event()
        if gpu is not None:
            gpu.memory_used += memory

    # --- what the job tells the server ------------------------------------------------------

    def register_body(self) -> dict[str, Any]:
        body: dict[str, Any] = {
            "process_id": self.process_id,
            "host": self.host.name,
            "user": "bench",
            "pid": 10000 + self.index,
            "gpu_uuid": None if self.gpu is None else self.gpu.uuid,
            "gpu_model": "NVIDIA H200",
            "logical_device": "cuda:0",
            "visible_gpus": [g.uuid for g in self.host.gpus],
            "torch_version": "2.11.0",
            "driver_version": "580.159.04",
            "flexium_version": "0.1.0",
            "capabilities": {"pause_resume": True, "migration": True},
            "memory_bytes": self.held(),
            "footprint_bytes": self.memory,
            "state": self.state,
            "started_at": time.time(),
            "cmdline": "python train.py",
            "devices": self.host.reports(),
        }
        if self.priority is not None:
            body["priority"] = self.priority
        return body

    def held(self) -> int:
        return self.memory if self.state == "RUNNING" else 0

    def heartbeat_body(self, room_seen: bool) -> dict[str, Any]:
        body: dict[str, Any] = {"state": self.state, "memory_bytes": self.held()}
        if self.report_devices:
            body |= {"footprint_bytes": self.memory, "devices": self.host.reports(), "room_seen": room_seen}
            if self.gpu is not None:
                body["gpu_uuid"] = self.gpu.uuid
        return body

    async def register(self) -> None:
        sent = time.time()
        status, answer = await self.control.request("POST", f"{BASE}/processes", self.register_body())
        if status not in (200, 201):
            raise RuntimeError(f"register {self.process_id}: {status} {answer}")
        self.observer.reported(self, sent)
        self.watch = answer.get("watch")

    async def heartbeat(self, room_seen: bool = False) -> None:
        if self.state == "EXITED":
            return  # a room-seen heartbeat set going just before the job ended
        start, sent = time.perf_counter(), time.time()
        try:
            async with self.control.lock:
                status, answer = await self.control.request(
                    "POST", f"{BASE}/processes/{self.process_id}/heartbeat", self.heartbeat_body(room_seen)
                )
        except Exception as exc:
            self.observer.error(self, f"heartbeat: {exc!r}")
            return
        if status != 200:
            self.observer.error(self, f"heartbeat: {status} {answer}")
            return
        self.observer.heartbeat(self, time.perf_counter() - start)
        if self.report_devices:
            self.observer.reported(self, sent)
            self.watch = answer.get("watch")

    async def leave(self) -> None:
        """The job ended: its memory goes back to its GPU and it unregisters, as a real job at exit."""
        self._give_back()
        self.state = "EXITED"
        self.observer.state(self, time.time())
        sent = time.time()
        async with self.control.lock:
            await self.control.request("DELETE", f"{BASE}/processes/{self.process_id}")
        self.observer.reported(self, sent)

    # --- its life -----------------------------------------------------------------------------

    async def live(self, stop: asyncio.Event) -> None:
        """Heartbeats and the long-poll (and the room watch, for a job that reports its GPUs) until
        ``stop`` is set."""
        if self.report_devices:
            self.host.watchers.add(self)
        try:
            await asyncio.gather(self._heartbeats(stop), self._polls(stop))
        finally:
            self.host.watchers.discard(self)

    def changed(self) -> asyncio.Event:
        """Set at the job's next change of state or GPU, and when a command it carries out ends."""
        return self._changed

    def _signal(self) -> None:
        self._changed.set()
        self._changed = asyncio.Event()

    async def _heartbeats(self, stop: asyncio.Event) -> None:
        await asyncio.sleep(random.uniform(0, self.heartbeat_interval))
        while not stop.is_set():
            self._wake.clear()
            await self.heartbeat()
            with contextlib.suppress(asyncio.TimeoutError):
                await asyncio.wait_for(self._wake.wait(), self.heartbeat_interval)

    def stop_telling(self) -> None:
        """The run ends: a room-seen heartbeat under way is not waited for."""
        if self._telling is not None:
            self._telling.cancel()

    def look_for_room(self) -> None:
        """One reading of the GPUs it waits for (``SimulatedHost.watch_rooms``): a heartbeat with
        ``room_seen`` when the room appeared since the last one."""
        watch = self.watch
        if watch is None or self.state != "PAUSED" or self.executing:
            self._told = False
            return
        there = any(g.uuid in watch["gpus"] and g.memory_free >= watch["need_bytes"] for g in self.host.gpus)
        if there and not self._told and (self._telling is None or self._telling.done()):
            self._telling = asyncio.create_task(self.heartbeat(room_seen=True))
        self._told = there

    async def _polls(self, stop: asyncio.Event) -> None:
        while not stop.is_set():
            wait = round(random.uniform(0.5, 1.0) * self.poll_wait, 2)  # real jobs are not in step
            try:
                status, command = await self.poll.request(
                    "GET", f"{BASE}/processes/{self.process_id}/commands/next?wait={wait}", timeout=wait + 30
                )
            except Exception as exc:
                self.observer.error(self, f"poll: {exc!r}")
                await asyncio.sleep(0.1)
                continue
            if status != 200:
                if status != 204:
                    self.observer.error(self, f"poll: {status} {command}")
                continue
            done = self._outcomes.get(command["id"])
            if done is not None:  # delivered again (its answer was lost): told again, never run twice
                with contextlib.suppress(Exception):
                    async with self.control.lock:
                        await self.control.request("POST", f"{BASE}/commands/{command['id']}/report", done)
                continue
            self.observer.command(self, command, time.perf_counter(), time.time())
            await self._carry_out(command)

    async def _carry_out(self, command: dict[str, Any]) -> None:
        self.executing = True
        report = f"{BASE}/commands/{command['id']}/report"
        try:
            async with self.control.lock:
                await self.control.request("POST", report, {"state": "running"})
            if self.operation_s and self.started:
                await asyncio.sleep(self.operation_s)
            refusal = self._apply(command)
            if refusal is None:
                outcome = {
                    "state": "succeeded",
                    "process": self._placement(),
                    "result": {"kind": command["kind"], "path": "driver", "ok": True, "seconds": self.operation_s},
                }
            else:
                outcome = {"state": "failed", "error": refusal, "process": self._placement()}
            self._outcomes[command["id"]] = outcome
            sent = time.time()
            async with self.control.lock:
                await self.control.request("POST", report, outcome)
            self.observer.reported(self, sent)
        except Exception as exc:
            self.observer.error(self, f"report: {exc!r}")
        finally:
            self.executing = False
            self.busy = False
            self._signal()
        if self.report_devices:
            self._wake.set()  # the real client's heartbeat right after a command: where its memory went

    def _placement(self) -> dict[str, Any]:
        placement: dict[str, Any] = {"state": self.state, "memory_bytes": self.held()}
        if self.report_devices and self.gpu is not None:
            placement["gpu_uuid"] = self.gpu.uuid
        return placement

    def _apply(self, command: dict[str, Any]) -> str | None:
        """The command done to the simulated GPUs; a refusal (the resume's room check) says why."""
        kind = command["kind"]
        if kind == "pause":
            self._give_back()
            self.state = "PAUSED"
        elif kind == "resume":
            target = self._target(command)
            if target is None:
                return "resume: the job was never placed and the command names no GPU"
            need = self.memory
            if target is not self.gpu or target.memory_used > 0:
                need += protocol.ROOM_MARGIN_BYTES  # the engine's own room check, beside others
            if target.memory_free < need:
                return (
                    f"{target.uuid} has {target.memory_free / GIB:.2f} GiB free; the paused job needs "
                    f"{need / GIB:.2f} GiB: it stays paused"
                )
            self._take(target)
            self.state = "RUNNING"
            self.started = True
        elif kind == "migrate":
            target = self._target(command)
            if target is not None and target is not self.gpu:
                self._give_back()
                self._take(target)
        self.observer.state(self, time.time())
        self._signal()
        return None

    def _target(self, command: dict[str, Any]) -> SimulatedGpu | None:
        uuid = command.get("target_uuid")
        return self.gpu if not uuid else self.host.gpu(uuid)

    def _take(self, gpu: SimulatedGpu) -> None:
        self.gpu = gpu
        gpu.memory_used += self.memory

    def _give_back(self) -> None:
        if self.gpu is not None and self.state == "RUNNING":
            self.gpu.memory_used -= self.memory
            self.gpu.freed_at = time.time()
