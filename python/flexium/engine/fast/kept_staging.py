"""Keeps a fast pause ready between pauses: the host staging holds what a pause of the job needs
and the copier process keeps it pinned, so that a pause frees the GPU after one copy and the
checkpoint instead of seconds of touching and pinning first (fact `staging-kept-pinned-ahead`).

It costs host memory (the staging, within the machine's pinned host memory budget:
pinned_budget.py) and the copier's context on the job's GPU (518 MiB), not training speed. The
job's memory comes first: when one of its allocations runs out of GPU memory the allocator kills
the copier (csrc/gpu_memory_yield.h) and the keeper stops pinning ahead on that GPU.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable

from flexium import _C
from flexium.engine.fast import pinned_budget
from flexium.engine.fast.host_copier import copier_enabled
from flexium.engine.fast.path import FastPath

log = logging.getLogger("flexium")
CHECK_S = 2.0  # how often it looks; a pool must stay the same size between two looks


class StagingKeeper:
    def __init__(
        self,
        fast: FastPath,
        *,
        placement: Callable[[], tuple[int, str]],
        ready: Callable[[], bool],
        refused: Callable[[], str | None],
    ) -> None:
        """`placement`: the job's logical ordinal and its GPU's UUID now; `ready`: the job runs,
        has trained a step and no operation is under way; `refused`: why a pause of the job would
        be refused now, whenever it came (None: it could run)."""
        self._fast = fast
        self._placement = placement
        self._ready = ready
        self._refused = refused
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._last_pool = 0
        self._kept_for_pool = 0  # the pool's size when the staging was last made to fit it
        self._yields_seen = _C.gpu_memory_yields()
        self._gave_way_on: str | None = None  # the GPU where the job needed the copier's memory
        self.note: str | None = None  # what it did last, or why it keeps nothing

    def start(self) -> None:
        limit = pinned_budget.budget()
        if limit.bytes == 0:
            self.note = f"nothing is kept pinned between pauses: {pinned_budget.ENV}={limit.setting}"
            return
        if not copier_enabled():
            self.note = "nothing is kept pinned between pauses: the copier process is off"
            return
        self._thread = threading.Thread(target=self._run, name="flexium-staging-keeper", daemon=True)
        self._thread.start()

    def stop(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join()
            self._thread = None

    def _run(self) -> None:
        while not self._stop.wait(CHECK_S):
            try:
                self.check()
            except Exception as exc:  # the next look tries again; a pause prepares its own staging
                log.debug("keeping the host staging ready failed: %s: %s", type(exc).__name__, exc)

    def check(self) -> None:
        if not self._ready():
            return
        refused = self._refused()
        if refused is not None:
            # Host memory pinned for a pause that would be refused is taken from other jobs for
            # nothing (e.g. every rank of a job whose NCCL cannot suspend); it comes back when the
            # refusal goes (a CUDA graph freed).
            self._fast.give_back_kept()
            self._kept_for_pool = 0
            self._say(f"nothing is kept pinned between pauses: a pause of this job is refused now: {refused}")
            return
        logical, uuid = self._placement()
        if self._fast.blocker(logical) is not None:
            return
        pool = self._fast.pool_bytes(logical)
        settled = pool > 0 and pool == self._last_pool
        self._last_pool = pool
        if not settled:  # still growing (the first steps): a staging made now would soon be short
            return
        yields = _C.gpu_memory_yields()
        if yields != self._yields_seen:
            self._yields_seen = yields
            self._gave_way_on = uuid
            self._say(
                "the job needed the GPU memory of the copier process, which kept the host staging pinned: "
                "a pause of this job on this GPU now pins its staging when asked for (seconds more per 16 GiB)",
                logging.WARNING,
            )
        if uuid == self._gave_way_on:
            return
        # Kept for this pool already: nothing to ask (a pool's live ranges come from a snapshot of
        # PyTorch's allocator, which holds the GIL while it is taken).
        if pool == self._kept_for_pool and self._fast.kept_on(uuid):
            self._follow_pinning(uuid)
            return
        note = self._fast.keep_ready(logical, uuid, keep_going=self._keep_going)
        if note is not None:
            self._say(note)
        if self._fast.kept_on(uuid):
            self._kept_for_pool = pool

    def _keep_going(self) -> bool:
        """Whether the keeper's making may go on: not once it is stopped (the engine's stop waits for it)."""
        return not self._stop.is_set() and self._ready()

    def _follow_pinning(self, uuid: str) -> None:
        """The copier pins the kept staging in the background, after the keeper made it or a resume
        kept it (a pause coming meanwhile streams what is not pinned yet): says so once it has pinned
        it all, or gives it back if its pinning stopped short (the next look keeps it again, with a new
        copier if that one is gone)."""
        ahead = self._fast.kept_pinning(uuid)
        if ahead is None or ahead.pinning:
            return
        if ahead.complete:
            part = f"; only part of what a pause needs, as {self._fast.kept_in_part}" if self._fast.kept_in_part else ""
            self._say(
                f"keeps {ahead.staging / (1 << 30):.2f} GiB of host staging pinned by the copier process for a "
                f"pause (its pinning ahead: {ahead.pinner}){part}"
            )
            return
        self._fast.give_back_kept()
        self._kept_for_pool = 0
        self._say(
            f"the staging for a pause is prepared when one is asked for: the copier's pinning ahead stopped at "
            f"{ahead.pinned / (1 << 30):.2f} of {ahead.staging / (1 << 30):.2f} GiB ({ahead.pinner})",
            logging.WARNING,
        )

    def _say(self, note: str, level: int = logging.INFO) -> None:
        if note != self.note:
            log.log(level, "%s", note)
        self.note = note
