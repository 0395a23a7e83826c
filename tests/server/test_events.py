"""Event ids and Last-Event-ID across a server restart and across replicas (the EventBus without HTTP)."""

from __future__ import annotations

import asyncio
import json

from flexium import protocol
from flexium.server.live import EventBus


def _events(frames: list[str]) -> list[str]:
    return [line.split(": ", 1)[1] for text in frames for line in text.splitlines() if line.startswith("event: ")]


def _subscribe(bus: EventBus, last_event_id: int) -> list[str]:
    async def run() -> list[str]:
        sub, backlog = bus.subscribe(1, last_event_id=last_event_id)
        bus.unsubscribe(sub)
        return backlog

    return asyncio.run(run())


def test_an_id_larger_than_the_last_gets_resync() -> None:
    bus = EventBus(first_id=1)
    for n in range(3):
        bus.publish(1, protocol.EVENT_DEVICES, {"host": f"h{n}"})
    assert bus.last_id == 3
    # a browser that saw id 500 from the server before a restart whose clock went back
    assert _events(_subscribe(bus, 500)) == [protocol.EVENT_RESYNC]
    assert _events(_subscribe(bus, 1)) == [protocol.EVENT_DEVICES] * 2
    assert _subscribe(bus, 3) == []


def test_an_id_of_another_bus_gets_resync() -> None:
    """Another replica numbers the same events in its own order, and a restarted server has an empty
    history: an id either gave, however close its number, is answered with a resync, not a replay."""
    other = EventBus(first_id=1)  # another replica, or this server before a restart
    bus = EventBus(first_id=1)
    for _ in range(5):
        other.publish(1, protocol.EVENT_DEVICES, {"host": "h"})
        bus.publish(1, protocol.EVENT_DEVICES, {"host": "h"})
    assert other.last_id == bus.last_id and other.last_event_id != bus.last_event_id
    for foreign in (other.event_id(3), str(3), "", "not-an-id"):
        assert _events(_subscribe(bus, bus.resume_point(foreign))) == [protocol.EVENT_RESYNC], foreign
    assert _events(_subscribe(bus, bus.resume_point(bus.event_id(3)))) == [protocol.EVENT_DEVICES] * 2
    frame = bus.frame(bus.last_id, protocol.EVENT_HELLO, {"last_event_id": bus.last_event_id})
    assert frame.startswith(f"id: {bus.last_event_id}\n")
    assert json.loads(frame.split("data: ", 1)[1])["last_event_id"] == bus.last_event_id


def test_the_history_is_bounded_in_bytes_and_what_fell_out_asks_for_a_resync() -> None:
    bus = EventBus(first_id=1, history=1000, history_bytes=64 << 10)
    big = {"result": "x" * (20 << 10)}  # a command's result rides in its event
    for _ in range(50):
        bus.publish(1, protocol.EVENT_COMMAND, big)
    assert bus.history_bytes(1) <= 64 << 10
    kept = _subscribe(bus, bus.last_id - 2)
    assert _events(kept) == [protocol.EVENT_COMMAND] * 2  # the newest are kept
    assert _events(_subscribe(bus, 1)) == [protocol.EVENT_RESYNC]  # the oldest fell out
    huge = {"result": "y" * (128 << 10)}  # larger than the whole budget: never kept
    bus.publish(1, protocol.EVENT_COMMAND, huge)
    assert bus.history_bytes(1) == 0
    assert _events(_subscribe(bus, bus.last_id - 1)) == [protocol.EVENT_RESYNC]


def test_a_stream_too_slow_for_the_bytes_it_is_sent_is_cut_off_with_a_resync() -> None:
    async def run() -> tuple[list[str | None], bool, int]:
        bus = EventBus(first_id=1, queue_size=1000, queue_bytes=64 << 10)
        sub, _ = bus.subscribe(1)
        for _ in range(10):  # 200 KiB for a client that reads nothing
            bus.publish(1, protocol.EVENT_COMMAND, {"result": "x" * (20 << 10)})
        overflowed, queued = sub.overflowed, sub.queued_bytes
        sub.drop_queued()
        bus.publish(1, protocol.EVENT_DEVICES, {"host": "h"})
        taken = [await sub.take(1.0)]
        bus.unsubscribe(sub)
        return taken, overflowed, queued

    taken, overflowed, queued = asyncio.run(run())
    assert overflowed and queued <= 64 << 10
    assert _events([t for t in taken if t]) == [protocol.EVENT_DEVICES]  # after the resync, events flow again
