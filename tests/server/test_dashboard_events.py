"""What the event stream tells a job's page beyond processes and commands: training progress once
it is stored (one event per batch of buffered beats, not one per beat) and a command the server
refused; against SQLite and PostgreSQL."""

from __future__ import annotations

import time
from typing import Any

from flexium import protocol, wire
from flexium.server import services, storage
from support.server import GIB, Api


def _until(condition: Any, timeout: float = 5.0) -> Any:
    deadline = time.monotonic() + timeout
    while not (value := condition()) and time.monotonic() < deadline:
        time.sleep(0.05)
    return value


def _progress(api: Api, after: int, *, on_loop: bool = False) -> list[dict[str, Any]]:
    return [data for kind, data in api.events(after, on_loop=on_loop) if kind == protocol.EVENT_PROGRESS]


def test_progress_is_announced_once_stored_one_event_for_a_batch_of_beats(api: Api) -> None:
    api.register("gpu-1")
    api.register("gpu-2")
    before = api.ctx.bus.last_id
    workspace_id = api.db.run(storage.authenticate, write=False, token=api.token, now=time.time()).workspace_id

    async def two_beats_then_their_write() -> None:
        for process_id, steps in (("gpu-1", 100), ("gpu-2", 7)):
            answer = services.heartbeat_from_memory(
                api.ctx,
                workspace_id=workspace_id,
                process_id=process_id,
                body=wire.HeartbeatRequest(steps=steps, loss=2.5),
                now=time.time(),
            )
            assert answer is not None  # answered from memory: buffered, not written yet
        assert _progress(api, before, on_loop=True) == []  # nothing stored, nothing said
        await api.ctx.flush_beats()

    api.client.portal.call(two_beats_then_their_write)
    [event] = _progress(api, before)
    assert [(p["process_id"], p["steps"], p["loss"]) for p in event["processes"]] == [
        ("gpu-1", 100, 2.5),
        ("gpu-2", 7, 2.5),
    ]
    assert api.get("/processes/gpu-1").json()["steps"] == 100  # stored before it was said


def test_progress_of_a_beat_written_through_is_announced_too(api: Api) -> None:
    api.register("gpu-1")
    before = api.ctx.bus.last_id
    beat = {"state": "RUNNING", "memory_bytes": 11 * GIB, "gpu_uuid": "GPU-0000", "steps": 40}  # a change
    assert api.post("/processes/gpu-1/heartbeat", beat).status_code == 200
    events = _until(lambda: _progress(api, before))
    assert [(p["process_id"], p["steps"]) for e in events for p in e["processes"]] == [("gpu-1", 40)]
    # a plain beat with progress, answered from memory, is announced by the next batched write
    later = api.ctx.bus.last_id
    assert api.post("/processes/gpu-1/heartbeat", {**beat, "steps": 45}).status_code == 200
    events = _until(lambda: _progress(api, later))
    assert [(p["process_id"], p["steps"]) for e in events for p in e["processes"]] == [("gpu-1", 45)]


def test_a_refused_command_is_announced_with_its_reason(api: Api) -> None:
    api.register("gpu-1")
    before = api.ctx.bus.last_id
    refused = api.command("resume", "gpu-1", target=2)
    assert refused.status_code == 409
    [(kind, data)] = [(k, d) for k, d in api.events(before) if k == protocol.EVENT_COMMAND_REFUSED]
    assert data["request"]["kind"] == "resume" and data["request"]["process_id"] == "gpu-1"
    assert data["reason"] == refused.json()["message"]
