"""A paused job waiting in the server's queue watches the GPUs the server names: the reporter thread
reads them every ROOM_WATCH_INTERVAL_S and sends a heartbeat saying room_seen as soon as one has the
room free, once each time it appears; a job that is not paused, or not waiting, reads nothing."""

from __future__ import annotations

import threading
import time
from types import SimpleNamespace
from typing import Any

import pytest

from flexium import protocol, wire
from flexium.client import ProcessClient
from flexium.client import process as client_process
from flexium.client.reports import GpuReading
from flexium.client.room_watch import RoomWatch
from flexium.engine import nvml
from flexium.engine.operations import EngineState
from support.engine import wait_until

pytestmark = pytest.mark.timeout(60)
GIB = 1 << 30
WATCH = wire.RoomWatch(wait_id=7, gpus=["GPU-1"], need_bytes=30 * GIB)


def _gpu(uuid: str, free: int) -> nvml.HostGpu:
    total = 140 * GIB
    return nvml.HostGpu(
        index=int(uuid[-1]),
        uuid=uuid,
        name="NVIDIA H200",
        memory_total=total,
        memory_used=total - free,
        memory_free=free,
        utilization_percent=0,
        temperature_c=40,
        health="ok",
        processes=(),
    )


def test_room_is_told_once_each_time_it_appears() -> None:
    watch = RoomWatch()
    full, roomy = [_gpu("GPU-0", 100 * GIB), _gpu("GPU-1", GIB)], [_gpu("GPU-0", 100 * GIB), _gpu("GPU-1", 40 * GIB)]
    assert not watch.room_appeared(roomy)  # nothing to watch yet: GPU 0's room is not asked for
    watch.follow(WATCH)
    assert not watch.room_appeared(full)
    assert watch.room_appeared(roomy)
    assert not watch.room_appeared(roomy)  # told: the server decides on it
    assert not watch.room_appeared(full)
    assert watch.room_appeared(roomy)  # gone and back
    watch.follow(WATCH)  # the same wait again changes nothing
    assert not watch.room_appeared(roomy)
    watch.follow(wire.RoomWatch(wait_id=8, gpus=["GPU-1"], need_bytes=30 * GIB))
    assert watch.room_appeared(roomy)  # a new wait: told again
    watch.follow(None)
    assert not watch.room_appeared(roomy)


class _Api:
    """The server as the reporter thread meets it: every answer names the wait to watch."""

    base_url = "http://unit"
    workspace = "unit"

    def __init__(self) -> None:
        self.beats: list[tuple[float, bool]] = []
        self.seen = threading.Event()

    def register(self, body: wire.RegisterRequest, *, timeout: float) -> wire.RegisterResponse:
        # The process as the server shows it is not read by the reporter thread.
        return wire.RegisterResponse.model_construct(
            heartbeat_interval_s=30.0, poll_timeout_s=25.0, stale_after_s=60.0, server_time=0.0, watch=WATCH
        )

    def heartbeat(self, process_id: str, body: wire.HeartbeatRequest, *, timeout: float) -> wire.HeartbeatResponse:
        self.beats.append((time.monotonic(), body.room_seen))
        if body.room_seen:
            self.seen.set()
        return wire.HeartbeatResponse(
            ok=True, pending_command=None, heartbeat_interval_s=30.0, server_time=0.0, watch=WATCH
        )

    def next_command(self, *_args: Any, wait: float, stop: threading.Event, **_kw: Any) -> None:
        stop.wait(wait)  # nothing to hand out within the wait (an early empty answer would be news)

    def unregister(self, *_args: Any, **_kw: Any) -> None:
        pass

    def close(self) -> None:
        pass


class _Reporter:
    def capabilities(self) -> wire.ProcessCapabilities:
        return wire.ProcessCapabilities()

    def register_body(self, reading: GpuReading) -> wire.RegisterRequest:
        return wire.RegisterRequest(process_id="gpu-unit", host="unit", state="PAUSED")

    def heartbeat_body(self, reading: GpuReading) -> wire.HeartbeatRequest:
        return wire.HeartbeatRequest(state="PAUSED")


def _client(state: EngineState, api: _Api) -> ProcessClient:
    engine = SimpleNamespace(state=state, add_state_listener=lambda _listener: None)
    training = SimpleNamespace(process_id="gpu-unit", engine=engine, capabilities=None, config=None)
    return ProcessClient(training, api, reporter=_Reporter())  # type: ignore[arg-type]


@pytest.fixture
def gpus(monkeypatch: pytest.MonkeyPatch) -> list[nvml.HostGpu]:
    """The host's GPUs as the watch reads them (change the list to change the host)."""
    host = [_gpu("GPU-0", 100 * GIB), _gpu("GPU-1", GIB)]
    monkeypatch.setattr(
        client_process.GpuReading, "take", classmethod(lambda cls: cls(time.monotonic_ns(), list(host)))
    )
    return host


def test_a_paused_waiting_job_tells_the_room_within_a_watch_interval(gpus: list[nvml.HostGpu]) -> None:
    api = _Api()
    client = _client(EngineState.PAUSED, api).start()
    try:
        assert client.wait_registered(5)
        time.sleep(4 * protocol.ROOM_WATCH_INTERVAL_S)
        assert api.beats == []  # nothing to tell, and the next heartbeat is 30 s away
        gpus[1] = _gpu("GPU-1", 40 * GIB)
        freed = time.monotonic()
        assert api.seen.wait(5)
        told = next(at for at, seen in api.beats if seen)
        print(f"FIGURES room told {1e3 * (told - freed):.0f} ms after it appeared")
        assert told - freed < 2.0  # a few watch intervals, whatever the machine's load
        time.sleep(4 * protocol.ROOM_WATCH_INTERVAL_S)
        assert sum(seen for _at, seen in api.beats) == 1  # told once while it stays
    finally:
        client.stop()


def test_a_running_job_reads_nothing(gpus: list[nvml.HostGpu], monkeypatch: pytest.MonkeyPatch) -> None:
    reads: list[int] = []
    take = GpuReading.take
    monkeypatch.setattr(client_process.GpuReading, "take", classmethod(lambda cls: reads.append(1) or take()))
    client = _client(EngineState.RUNNING, _Api()).start()
    try:
        assert client.wait_registered(5)
        reads.clear()
        time.sleep(5 * protocol.ROOM_WATCH_INTERVAL_S)
        assert reads == []
    finally:
        client.stop()


class _QueuedLater(_Api):
    """A job registered before anyone queued it; queued 0.3 s into its first long-poll, which the
    server then answers empty (what it should watch changed): only a heartbeat's answer says what."""

    def __init__(self) -> None:
        super().__init__()
        self.polls = 0

    def register(self, body: wire.RegisterRequest, *, timeout: float) -> wire.RegisterResponse:
        return wire.RegisterResponse.model_construct(
            heartbeat_interval_s=30.0, poll_timeout_s=25.0, stale_after_s=60.0, server_time=0.0, watch=None
        )

    def next_command(self, *_args: Any, wait: float, stop: threading.Event, **_kw: Any) -> None:
        self.polls += 1
        stop.wait(0.3 if self.polls == 1 else wait)


def test_a_job_queued_after_it_registered_asks_what_to_watch_when_its_poll_ends_early(
    gpus: list[nvml.HostGpu],
) -> None:
    api = _QueuedLater()
    client = _client(EngineState.PAUSED, api).start()
    try:
        assert client.wait_registered(5)
        wait_until(lambda: api.beats != [], 5, "a heartbeat after the poll's early end")
        assert client.room_watch.watching == WATCH  # its answer named the wait: watched from now on
        gpus[1] = _gpu("GPU-1", 40 * GIB)
        assert api.seen.wait(5)  # and the room, when it came, was told at once
    finally:
        client.stop()
