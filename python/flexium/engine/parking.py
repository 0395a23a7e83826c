"""Where the training thread waits while its job is paused at a safe point.

The thread blocks here with the GIL released, so the control thread stays free to receive the
resume command; the resume itself then runs on this thread, which owns the step it paused in.
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from typing import TypeVar, cast

T = TypeVar("T")


class Parking:
    def __init__(self) -> None:
        self._cond = threading.Condition()
        self._work: Callable[[], object] | None = None
        self._outcome: tuple[object, BaseException | None] | None = None
        self._released = False
        self.occupied = False

    def park(self, still_paused: Callable[[], bool]) -> None:
        """Runs submitted work until the job is no longer paused or release() is called."""
        with self._cond:
            self.occupied = True
            self._released = False
            self._cond.notify_all()
        try:
            while True:
                with self._cond:
                    self._cond.wait_for(lambda: self._work is not None or self._released or not still_paused())
                    if self._work is None:
                        return
                    work, self._work = self._work, None
                try:
                    outcome: tuple[object, BaseException | None] = (work(), None)
                except BaseException as exc:  # given to the submitter
                    outcome = (None, exc)
                with self._cond:
                    self._outcome = outcome
                    self._cond.notify_all()
                if not still_paused():
                    return
        finally:
            with self._cond:
                self.occupied = False
                self._cond.notify_all()

    def submit(self, work: Callable[[], T]) -> T:
        """Runs `work` on the parked thread and returns its result (or raises its error)."""
        with self._cond:
            self._outcome = None
            self._work = work
            self._cond.notify_all()
            self._cond.wait_for(lambda: self._outcome is not None)
            outcome = self._outcome
            self._outcome = None
        assert outcome is not None
        result, error = outcome
        if error is not None:
            raise error
        return cast(T, result)  # what `work` returned

    def release(self) -> None:
        with self._cond:
            self._released = True
            self._cond.notify_all()
