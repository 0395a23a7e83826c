"""Runs engine operations on the training thread at the end of an optimizer step.

Between optimizer steps autograd is idle and no tensor is half-written, and the training
thread is the one that would otherwise block inside a CUDA call, perhaps holding the GIL,
while the process is locked. PyTorch's global optimizer step hook gives this point in plain
loops, Lightning, Hugging Face Trainer and Accelerate alike; fastai's own optimizers report their
steps through foreign_steps.py. Jobs without torch.optim steps
(or whose steps stop) get the operation run on the caller's thread after a bounded wait.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable
from typing import Any, Generic, TypeVar, cast

from flexium.engine import foreign_steps

T = TypeVar("T")
log = logging.getLogger("flexium")


class SafePointMissed(Exception):
    """No safe point took the work within its deadline; it was withdrawn and never ran."""


class _Request(Generic[T]):
    def __init__(
        self,
        work: Callable[[bool], T],
        then: Callable[[T], None] | None,
        ready: Callable[[int], bool] | None = None,
    ) -> None:
        self.work = work
        self.then = then
        self.ready = ready  # None: the first safe point takes it
        self.taken = False
        self.withdrawn = False  # by uninstall(): no safe point will come
        self.done = threading.Event()
        self.result: T | None = None
        self.error: BaseException | None = None


class SafePoints:
    def __init__(self, wait_seconds: float) -> None:
        self.wait_seconds = wait_seconds
        self._lock = threading.Lock()
        self._pending: _Request[Any] | None = None
        self._handle: Any | None = None  # torch's RemovableHandle
        self._training_thread: int | None = None
        self._in_hook = threading.local()
        self._between: Callable[[], bool] | None = None
        self.steps_seen = 0

    def install(self) -> bool:
        try:
            from torch.optim.optimizer import register_optimizer_step_post_hook
        except ImportError:
            return False
        if self._handle is None:
            self._handle = register_optimizer_step_post_hook(self._on_step)
            foreign_steps.watch(self._on_step)
        return True

    def uninstall(self) -> None:
        """No safe point comes after it: a request still waiting for one is withdrawn, and its
        caller runs it at once, as after the bounded wait (run), or is told so (run_when)."""
        if self._handle is not None:
            self._handle.remove()
            self._handle = None
            foreign_steps.unwatch(self._on_step)
        with self._lock:
            request, self._pending = self._pending, None
            if request is not None and not request.taken:
                request.withdrawn = True
                request.done.set()

    def between_operations(self, work: Callable[[], bool] | None) -> None:
        """`work()` runs at each safe point no operation takes, until it returns False or raises
        (logged); None stops it. For bounded chores an operation leaves behind."""
        with self._lock:
            self._between = work

    def in_safe_point(self) -> bool:
        return bool(getattr(self._in_hook, "active", False))

    def on_training_thread(self) -> bool:
        return self._training_thread == threading.get_ident()

    def missed(self) -> str:
        """Why an operation just ran outside a safe point, for its notes and errors."""
        if self.on_training_thread():
            return "called on the training thread outside an optimizer step"
        if self._handle is None:
            return "this torch has no global optimizer step hook"
        if self.steps_seen == 0:
            return "no optimizer step has run yet (training has not started)"
        return f"no optimizer step (safe point) came within {self.wait_seconds:g} s"

    def run(self, work: Callable[[bool], T], *, then: Callable[[T], None] | None = None) -> tuple[T, bool]:
        """Runs `work(at_safe_point)` at the next safe point, or here after the bounded wait.
        Returns its result and whether it ran at a safe point. `then(result)` runs on the
        training thread after the caller has been given the result, and only when the work ran
        at a safe point."""
        if self._handle is None or self.steps_seen == 0 or self.on_training_thread():
            return work(False), False
        request: _Request[T] = _Request(work, then)
        with self._lock:
            self._pending = request
        if not request.done.wait(self.wait_seconds):
            with self._lock:
                if not request.taken:
                    self._pending = None
                    log.info("no optimizer step within %.1f s: running the operation now", self.wait_seconds)
                    return work(False), False
            request.done.wait()
        if request.withdrawn:
            return work(False), False
        if request.error is not None:
            raise request.error
        return cast(T, request.result), True  # set with no error: what `work` returned

    def run_when(
        self,
        work: Callable[[], T],
        *,
        ready: Callable[[int], bool],
        deadline_s: float,
        then: Callable[[T], None] | None = None,
    ) -> T:
        """Runs `work()` on the training thread at the first safe point where `ready(step)`
        (step: the safe points seen so far, this one included) says True; `ready` runs at each
        safe point until then and may raise, which ends the wait with its error. Never runs
        the work anywhere else: raises SafePointMissed when no safe point took it within
        `deadline_s` (the job is not training), after withdrawing it."""
        if self._handle is None:
            raise SafePointMissed("this torch has no global optimizer step hook")
        if self.on_training_thread():
            raise SafePointMissed("called on the training thread, which cannot wait for its own next step")
        request: _Request[T] = _Request(lambda _at_safe_point: work(), then, ready)
        with self._lock:
            self._pending = request
        if not request.done.wait(deadline_s):
            with self._lock:
                if not request.taken:
                    if self._pending is request:
                        self._pending = None
                    raise SafePointMissed(
                        f"no optimizer step ended within {deadline_s:g} s"
                        if self.steps_seen == 0 or request.ready is None
                        else f"the job's ranks did not reach the same optimizer step within {deadline_s:g} s"
                    )
            request.done.wait()
        if request.withdrawn:
            raise SafePointMissed("the job is shutting down flexium: no optimizer step will take it")
        if request.error is not None:
            raise request.error
        return cast(T, request.result)

    def _take(self) -> tuple[_Request[Any] | None, Callable[[], bool] | None]:
        """The request this safe point runs, else the chore it runs."""
        with self._lock:
            request = self._pending
            if request is None:
                return None, self._between
            if request.ready is None:
                self._pending = None
                request.taken = True
                return request, None
        try:
            go, error = request.ready(self.steps_seen), None
        except BaseException as exc:  # handed to the waiter, who raises it
            go, error = False, exc
        with self._lock:
            if self._pending is not request:
                return None, None  # withdrawn meanwhile
            if error is not None:
                self._pending = None
                request.taken = True
                request.error = error
                request.done.set()
                return None, None
            if not go:
                return None, None
            self._pending = None
            request.taken = True
            return request, None

    def _on_step(self, *_: Any) -> None:
        self._training_thread = threading.get_ident()
        self.steps_seen += 1
        request, between = self._take()
        if request is None:
            if between is not None:
                self._run_between(between)
            return
        self._in_hook.active = True
        try:
            try:
                request.result = request.work(True)
            except BaseException as exc:  # handed to the caller, who raises it
                request.error = exc
            request.done.set()
            if request.error is None and request.then is not None:
                request.then(request.result)
        finally:
            self._in_hook.active = False

    def _run_between(self, work: Callable[[], bool]) -> None:
        self._in_hook.active = True
        try:
            more = work()
        except Exception as exc:  # a chore must never break the training loop
            log.warning("work between operations stopped: %s: %s", type(exc).__name__, exc)
            more = False
        finally:
            self._in_hook.active = False
        if not more:
            with self._lock:
                if self._between is work:
                    self._between = None
