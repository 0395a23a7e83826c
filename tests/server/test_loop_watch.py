"""The event loop's watcher (server/loop_watch.py) on a real loop: a loop held by a sleep, by its
own work, or by another thread's, is reported once it runs again, with what the time went to and
where the loop's thread was; a loop that keeps running is not."""

from __future__ import annotations

import asyncio
import logging
import threading
import time

import pytest

from flexium.server.loop_watch import LoopWatch, Stall
from flexium.server.metrics import Metrics

pytestmark = pytest.mark.timeout(60)

HELD_S = 1.6


async def watched(hold: object, *, metrics: Metrics | None = None) -> LoopWatch:
    watch = LoopWatch(metrics)
    watch.start()
    await asyncio.sleep(0.3)
    hold()  # type: ignore[operator]
    for _ in range(40):  # the watcher reports at its next look after the loop ran again
        await asyncio.sleep(0.1)
        if watch.stalls:
            break
    await watch.stop()
    return watch


def sleeps_on_the_loop() -> None:
    time.sleep(HELD_S)


def works_on_the_loop() -> None:
    started = time.thread_time()
    total = 0
    while time.thread_time() - started < HELD_S:
        total += 1


def waits_for_a_busy_thread() -> None:
    lock = threading.Lock()
    lock.acquire()
    holding = threading.Event()

    def busy() -> None:
        holding.set()
        started = time.thread_time()
        total = 0
        while time.thread_time() - started < HELD_S:
            total += 1
        lock.release()

    threading.Thread(target=busy).start()
    holding.wait()
    lock.acquire()


def only_stall(watch: LoopWatch) -> Stall:
    assert len(watch.stalls) == 1, watch.stalls
    return watch.stalls[0]


def test_a_sleep_on_the_loop_is_a_wait_and_named(caplog: pytest.LogCaptureFixture) -> None:
    metrics = Metrics()
    with caplog.at_level(logging.WARNING, logger="flexium.server"):
        watch = asyncio.run(watched(sleeps_on_the_loop, metrics=metrics))
    stall = only_stall(watch)
    assert stall.seconds >= HELD_S - 0.05, stall
    assert stall.loop_cpu_s < 0.5, stall
    assert "sleeps_on_the_loop" in stall.places[0][0], stall.places
    assert "test_loop_watch.py" in stall.places[0][0], stall.places
    [record] = [r for r in caplog.records if "event loop did not run" in r.getMessage()]
    message = record.getMessage()
    assert f"did not run for {stall.seconds:.1f} s" in message
    assert "sleeps_on_the_loop" in message
    assert metrics.registry.get_sample_value("flexium_server_loop_stall_seconds_count") == 1
    assert metrics.registry.get_sample_value("flexium_server_loop_stall_seconds_sum") == pytest.approx(stall.seconds)


def test_work_on_the_loop_counts_as_its_own_cpu() -> None:
    stall = only_stall(asyncio.run(watched(works_on_the_loop)))
    assert stall.loop_cpu_s >= HELD_S - 0.05, stall
    assert "works_on_the_loop" in stall.places[0][0], stall.places
    assert f"its thread worked {stall.loop_cpu_s:.1f} s" in stall.message()


def test_another_threads_work_counts_as_theirs() -> None:
    stall = only_stall(asyncio.run(watched(waits_for_a_busy_thread)))
    assert stall.process_cpu_s - stall.loop_cpu_s >= HELD_S - 0.05, stall
    assert stall.loop_cpu_s < 0.5, stall
    assert "waits_for_a_busy_thread" in stall.places[0][0], stall.places


def test_a_loop_that_keeps_running_has_no_stall() -> None:
    async def short_holds() -> LoopWatch:
        watch = LoopWatch()
        watch.start()
        for _ in range(20):  # held 50 ms at a time, as a busy server's requests may
            time.sleep(0.05)
            await asyncio.sleep(0.05)
        await asyncio.sleep(0.5)
        await watch.stop()
        return watch

    assert asyncio.run(short_holds()).stalls == []
