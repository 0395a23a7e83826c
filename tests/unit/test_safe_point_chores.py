"""SafePoints.between_operations: bounded chores an operation leaves behind (the own slices after
a fast move) run at safe points that no operation takes, and never break the training loop."""

from __future__ import annotations

import logging
import threading

import pytest

from flexium.engine.safe_point import SafePoints
from support.engine import wait_until


def test_a_chore_runs_at_each_step_until_it_says_it_is_done() -> None:
    points = SafePoints(wait_seconds=1.0)
    calls: list[bool] = []

    def chore() -> bool:
        calls.append(points.in_safe_point())
        return len(calls) < 3

    points.between_operations(chore)
    for _ in range(5):
        points._on_step()
    assert calls == [True, True, True]  # inside the safe point each time, then no more
    assert not points.in_safe_point()


def test_a_step_taken_by_an_operation_runs_no_chore() -> None:
    points = SafePoints(wait_seconds=5.0)
    points._handle = object()  # as if installed: requests wait for the optimizer's next step
    points._on_step()  # a step was seen
    ran: list[str] = []
    points.between_operations(lambda: ran.append("chore") is None)
    caller = threading.Thread(target=lambda: points.run(lambda at_safe_point: ran.append(f"op {at_safe_point}")))
    caller.start()
    wait_until(lambda: points._pending is not None, what="the request to wait for a step")
    points._on_step()  # the operation's step
    caller.join(5)
    points._on_step()  # the next one is free for the chore
    assert ran == ["op True", "chore"]


def test_a_failing_chore_is_logged_and_dropped(caplog: pytest.LogCaptureFixture) -> None:
    points = SafePoints(wait_seconds=1.0)
    calls = []

    def chore() -> bool:
        calls.append(1)
        raise RuntimeError("no memory for the job's own copy")

    points.between_operations(chore)
    with caplog.at_level(logging.WARNING, logger="flexium"):
        points._on_step()
        points._on_step()
    assert calls == [1]
    assert "work between operations stopped: RuntimeError: no memory for the job's own copy" in caplog.text


def test_none_stops_the_chore() -> None:
    points = SafePoints(wait_seconds=1.0)
    calls = []
    points.between_operations(lambda: calls.append(1) is None)
    points._on_step()
    points.between_operations(None)
    points._on_step()
    assert calls == [1]
