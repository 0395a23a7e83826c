"""The fast path: what a move of our pool's segments needs and does, each step timed and named on
failure; the GPU-to-GPU steps are device_moves.py's, this file the pause's host staging and the
copier process that pins it and runs its copies.

docs/fast-path.md: at a safe point, holding the GIL, the segments are copied to the target
GPU over NVLink (or to host memory, pinned by the copier process, for a pause) and their source
memory released, so the driver checkpoint only carries the rest (context, library workspaces,
anything outside the pool); after the restore they are mapped back at their own addresses. The
engine orders these steps around the locked section and decides what a failure means.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager, nullcontext
from dataclasses import replace
from typing import Literal

from flexium import _C
from flexium.engine.fast import checksum, pinned_budget, resume_overlap
from flexium.engine.fast.device_moves import DeviceMoves
from flexium.engine.fast.host_copier import (
    Copier,
    CopierError,
    CopierRefused,
    close_all,
    copier_enabled,
    written_staging_enabled,
)
from flexium.engine.fast.host_staging import (
    BY_COPIER,
    DISABLE_NOTE,
    DRIVER_MADE_PIECE,
    HOST_STAGING_SLACK,
    KEPT_PART_AT_LEAST,
    PIN_PAUSE_MS,
    POOL_GROWTH_ROOM,
    STAGING_STEP,
    CopierCopy,
    HostCopy,
    PinnedAhead,
    Reserved,
    copier_room_problem,
    driver_memory_enabled,
    release_host_staging,
)
from flexium.engine.fast.memory_pool import LiveRanges, MemoryPool, open_file_headroom
from flexium.engine.fast.steps import timed
from flexium.engine.operations import StepTiming
from flexium.errors import DriverError
from flexium.units import gib_or_mib

log = logging.getLogger("flexium")
# Files kept free besides one per segment (sockets, logs, the NVML helper's pipes).
FD_RESERVE = 256
# When the copier pins a staging it was given: before the call returns (a pause topping up a kept
# staging, while the job trains), ahead in the background with breaks for the job's CUDA calls (the
# keeper), or as the copies reach each chunk (a pause at its safe point, the job stopped).
PinWhen = Literal["before returning", "ahead", "as copied"]


def memory_elsewhere(devices: list[str]) -> str:
    """Why a job holding memory on other GPUs than its own takes the driver path."""
    return f"the job also holds memory on {', '.join(devices)}; the fast path moves one GPU's memory"


class FastPath(DeviceMoves):
    def __init__(self, pool: MemoryPool) -> None:
        self.pool = pool
        self._releasing: threading.Thread | None = None
        self._copier: Copier | None = None
        self._starting: threading.Thread | None = None
        # Why the last host move ran in this process instead of the copier ("" if it did not).
        self.copier_fallback = ""
        # Why the coming copy back runs in this process (wake_for_restore found too little room).
        self._copy_back_here: str | None = None
        # The copy back the copier makes while the job restores (resume_overlap.py), what the last
        # one did, and why the last resume's could not be made so ("": it was, or none was tried).
        self._filling: resume_overlap.Filling | None = None
        self.overlap: resume_overlap.Overlap | None = None
        self.overlap_fallback = ""
        # One preparation of the staging at a time: a pause's, or the keeper's between pauses.
        self._host_lock = threading.RLock()
        # The staging stays (pinned by the copier) between pauses: claimed in pinned_budget.
        self.keeping = False
        # Why the staging kept holds only part of what a pause needs ("" when it holds all, or none is kept).
        self.kept_in_part = ""
        self._kernel_loaded: set[int] = set()  # devices whose context has the checksum kernel
        # Why the copier could not make host memory (a kept staging is then memfds); "" while it can.
        self.driver_memory_refused = ""
        self.last_copy: CopierCopy | None = None  # what the copier's last order did (None: it ran here)

    def warm_up(self) -> None:
        """Starts the copier process in the background: it loads the driver and waits, holding
        nothing on any GPU, so that a pause's preparation only pins."""
        if not copier_enabled() or self._copier is not None or self._starting is not None:
            return

        def start() -> None:
            try:
                self._copier = Copier.start()
            except CopierError as exc:  # the first pause tries again, and copies here if it fails
                log.debug("the copier process did not start: %s", exc)

        self._starting = threading.Thread(target=start, name="flexium-copier-start", daemon=True)
        self._starting.start()

    def close(self) -> None:
        """Lets the copier go (at the engine's stop)."""
        self._wait_for_start()
        self._wait_for_release()
        if self._copier is not None:
            self._copier.close()
            self._copier = None
        self._stop_keeping()

    def _wait_for_start(self) -> None:
        if self._starting is not None:
            self._starting.join()
            self._starting = None

    def blocker(self, logical: int) -> str | None:
        """Why the fast path cannot move this job now (None: it can)."""
        if not self.pool.active:
            return f"the memory pool is off: {self.pool.reason_off}"
        segments = _C.vmm_segments()
        elsewhere = sorted({s.device for s in segments if s.device != logical})
        if elsewhere:
            return memory_elsewhere([f"cuda:{d}" for d in elsewhere])
        if any(not s.mapped for s in segments):
            return "some segments have no memory behind them (an earlier move did not finish)"
        headroom = open_file_headroom()
        if len(segments) + FD_RESERVE > headroom:
            return f"{len(segments)} segments need as many open files and only {headroom} are left (raise ulimit -n)"
        return None

    def pool_bytes(self, logical: int) -> int:
        return int(_C.vmm_bytes_on(logical))

    # ---- GPU to host memory ----------------------------------------------------------------

    def host_bytes_wanted(self, logical: int, *, stopped: bool = False, live: LiveRanges | None = None) -> int:
        """Host staging a pause of `logical` would fill: the pool's live bytes now, with room for
        what the job may allocate before the safe point, never more than an eighth over what the
        pool holds now (the pool grows meanwhile: fact `pool-grows-before-safe-point`). Should it need more at
        the safe point, the copies run in this process, which maps the rest there. `stopped`: at the
        safe point, where the pool no longer grows: its live bytes and a chunk for the layout alone
        (every byte more would be touched for nothing while the GPU waits to be freed). `live`: the
        allocator's snapshot the caller holds already (else one is taken)."""
        live = self.pool.live_ranges(logical) if live is None else live
        segments = [(s.address, s.size) for s in _C.vmm_segments() if s.device == logical]
        live_bytes = sum(sum(length for _o, length in live[a]) if a in live else size for a, size in segments)
        pool_bytes = sum(size for _a, size in segments)
        growth = 0 if stopped else live_bytes // 16
        return min(pool_bytes + pool_bytes // POOL_GROWTH_ROOM, live_bytes + growth + HOST_STAGING_SLACK)

    def host_bytes_to_map(self, wanted: int) -> int:
        """New host memory a staging of `wanted` bytes would take (what is kept from before counts)."""
        self._wait_for_release()
        return max(0, wanted - int(_C.host_staging_pool_bytes()))

    def reserve_host(self, logical: int, wanted: int, uuid: str) -> Reserved:
        """Touches `wanted` bytes of staging and pins them before the safe point, while the job
        trains: in the copier process (GPU `uuid`), or here if the copier is off or fails (the
        stage then unpins each chunk once copied, so the checkpoint sees no pinned memory)."""
        with self._host_lock:
            return self._reserve_host(logical, wanted, uuid, pin="before returning")

    def _reserve_host(self, logical: int, wanted: int, uuid: str, *, pin: PinWhen) -> Reserved:
        """`pin` "as copied" (at a pause's safe point): the copier takes its context while it
        touches the staging in the background; its copies pin each chunk as they reach it, once
        touched, so that touching, pinning and copying overlap, and nothing waits between chunks
        for the job's CUDA calls. "ahead" (the keeper): returns once the copier pins in the
        background, so that a pause coming meanwhile waits for none of it."""
        self._wait_for_release(hurry=pin != "ahead")
        self._wait_for_start()
        if pin != "as copied":  # at the safe point the move's checksum loads it
            self._load_checksum_kernel(logical)
        started = time.perf_counter()

        def here(why: str) -> Reserved:
            newly = int(_C.reserve_host_staging(wanted, logical))
            pinned = int(_C.host_staging_pinned_bytes())
            return Reserved(pinned, newly, time.perf_counter() - started, f"in this process ({why})")

        if not copier_enabled():
            return here(DISABLE_NOTE)
        # A copier awake on the GPU has its context there already: the room it needs is taken.
        crowded = None if self._copier_awake_on(uuid) else copier_room_problem(uuid)
        if crowded is not None:
            if pin != "ahead":  # this pause's copies run here too: its result says why
                self.copier_fallback = crowded
            return here(crowded)
        phases: list[str] = []

        def phase(name: str, since: float) -> float:
            now = time.perf_counter()
            phases.append(f"{name} {now - since:.2f} s")
            return now

        # At the safe point the job's cores are idle: a file (and a touching thread) per core, up to 16.
        _C.reserve_host_staging(wanted, logical, pin_here=False, job_stopped=pin == "as copied")
        mark = phase("files", started)
        try:
            copier, started_now = self._live_copier()
            if started_now:
                mark = phase("copier start", mark)
            # It touches the staging in the background; at the safe point it may write it instead.
            copier.attach(_C.host_staging_layout(), written=pin == "as copied" and written_staging_enabled())
            mark = phase("attach", mark)
            if pin != "before returning":
                copier.wake(uuid, wait=False, pause_ms=PIN_PAUSE_MS if pin == "ahead" else 0)
                where, took = f"{BY_COPIER} {copier.pid}", time.perf_counter() - started
                return Reserved(0, 0, took, where, ", ".join(phases), staging=int(_C.host_staging_pool_bytes()))
            reply = copier.wake(uuid, wait=True, pause_ms=PIN_PAUSE_MS, bytes_to_pin=wanted)
            phase("touching and pinning", mark)
            if reply.get("pinner_before"):
                log.debug("copier: its background pinning before this one: %s", reply["pinner_before"])
            return Reserved(
                int(reply.get("pinned", 0)),
                int(reply.get("newly_pinned", 0)),
                time.perf_counter() - started,
                f"{BY_COPIER} {copier.pid}",
                ", ".join(phases),
            )
        except CopierError as exc:
            self._drop_copier(f"{exc}")
            return here(f"the copier failed: {exc}")

    def _live_copier(self) -> tuple[Copier, bool]:
        """The copier, and whether it was started now: a new one where there is none or it is gone (killed
        for the job's GPU memory, or died: its socket goes too). Raises CopierError when none starts."""
        if self._copier is not None and not self._copier.alive():
            self._copier.kill()
            self._copier = None
        if self._copier is not None:
            return self._copier, False
        self._copier = Copier.start()
        return self._copier, True

    def _load_checksum_kernel(self, logical: int) -> None:
        """The moves' checksum kernel loaded into the job's context while it trains, before a
        pause's safe point: the driver compiles it as it loads it (107 ms on an H200, fact
        `move-checksum-cost`), which would otherwise fall in the first move's downtime."""
        if logical in self._kernel_loaded or checksum.unavailable() is not None:
            return
        try:
            _C.load_checksum_kernel(logical)
            self._kernel_loaded.add(logical)
        except DriverError as exc:  # the move's checksum loads it, or says why it cannot
            log.debug("the checksum kernel was not loaded ahead: %s", exc)

    def stage_to_host(
        self, logical: int, live: LiveRanges | None = None, *, make_for: str | None = None
    ) -> tuple[HostCopy, StepTiming]:
        """The `copy` step of a pause. With `make_for` (the job's GPU UUID) the staging was not
        ready before the safe point and is made in this step, with the job stopped (stop first,
        then stream: docs/fast-path.md); the rest of the step then pins and copies."""

        def work() -> HostCopy:
            ranges = self.pool.live_ranges(logical) if live is None else live
            made = None
            if make_for is not None:
                with self._host_lock:
                    wanted = self.host_bytes_wanted(logical, stopped=True, live=ranges)
                    made = self._reserve_host(logical, wanted, make_for, pin="as copied")
                    made = replace(made, made_by_driver=self._driver_made_bytes())
            copier = self._copier
            began = time.perf_counter()
            copied = self._by_copier(
                lambda: _C.begin_stage_order(ranges), to_host=True, here=lambda: int(_C.stage_segments_to_host(ranges))
            )
            woke = copier.last_wake if copier is not None else None
            if made is not None and made.where.startswith(BY_COPIER) and woke is not None:
                # What the copier had pinned ahead (a kept staging) when this pause's wake stopped that.
                made = replace(
                    made,
                    found_pinned=int(woke.get("pinned_at_wake", 0)),
                    pinning_before=str(woke.get("pinner_before", "")),
                )
            return HostCopy(copied, made, time.perf_counter() - began, self.last_copy)

        return timed("copy", work)

    def wake_for_restore(self, uuid: str, coming: int = 0, fill_for: int | None = None) -> None:
        """Before the restore that ends a fast pause: the copier takes a context on the GPU the
        job resumes on and pins the staging while the restore runs; with `fill_for` (the job's
        logical device) it also makes and fills the segments' new memory meanwhile
        (resume_overlap.py). Where that context would leave too little room for the `coming` bytes
        of the job, the copier sleeps on and this process copies back: a restore without room loses
        the job (fact `restore-without-room-loses-process`)."""
        if fill_for is not None:
            self.overlap, self.overlap_fallback = None, ""
        if self._copier is None:
            return
        self._copy_back_here = copier_room_problem(uuid, coming) if coming else None
        if self._copy_back_here is not None:
            return
        try:
            self._copier.wake(uuid, wait=False)
            if fill_for is not None:
                keep = self._stays_kept(uuid)
                self._filling = resume_overlap.start(self._copier, then_sleep=not keep, pin_rest_pause_ms=PIN_PAUSE_MS)
        except CopierError as exc:
            self._drop_copier(str(exc))
        except (RuntimeError, ValueError) as exc:  # the order could not be planned: copied back after the restore
            self.overlap_fallback = f"{type(exc).__name__}: {exc}"

    def _finish_fill(self, logical: int) -> int:
        """The copy back the copier made beside the restore, mapped; the live bytes mapped. On a
        failure the segments not mapped still wait in the staging, for the copy back after it."""
        filling, self._filling = self._filling, None
        copier = self._copier
        if filling is None or copier is None:
            return 0
        try:
            self.overlap = resume_overlap.finish(copier, filling, logical)
            return self.overlap.mapped_bytes
        except CopierRefused as exc:  # it still serves: the copy back after the restore asks it again
            self.overlap_fallback = str(exc)
        except CopierError as exc:
            self.overlap_fallback = str(exc)
            self._drop_copier(str(exc))
        except (DriverError, RuntimeError, ValueError) as exc:  # mapping failed half way
            self.overlap_fallback = f"mapping the copier's memory failed: {type(exc).__name__}: {exc}"
        return 0

    def call_off_fill(self) -> None:
        """After a restore that failed (the job stays paused): the copier's memory goes with its fds,
        and the copier lets go of the GPU, as a paused job holds nothing on any."""
        filling, self._filling = self._filling, None
        copier = self._copier
        if copier is None:
            return
        try:
            if filling is not None:
                try:
                    close_all(copier.filled(filling.order).fds)
                except CopierRefused:
                    pass
            copier.asleep(timeout=10.0)  # the sleep owed after the fill, or one now
        except CopierError as exc:
            self._drop_copier(str(exc))

    def restore_from_host(self, logical: int, uuid: str, step: str = "copy_back") -> tuple[int, StepTiming]:
        def work() -> int:
            filled = self._finish_fill(logical)
            if filled and self.host_waiting() == 0:
                return filled
            return filled + rest()

        def rest() -> int:
            crowded, self._copy_back_here = self._copy_back_here, None
            if crowded is not None:
                self.copier_fallback = crowded
                return int(_C.restore_segments_from_host(logical))
            if self._copier is not None and self._copier.awake_on != uuid:
                self.wake_for_restore(uuid)
            return self._by_copier(
                lambda: _C.begin_restore_order(logical),
                to_host=False,
                here=lambda: int(_C.restore_segments_from_host(logical)),
                then_sleep=not self._stays_kept(uuid),
            )

        return timed(step, work)

    def copier_asleep(self) -> StepTiming:
        """After the checkpoint of a fast pause: the copier must hold nothing on any GPU. If it
        does not say so in time it is killed, which frees its context all the same."""

        def work() -> None:
            if self._copier is None:
                return
            try:
                self._copier.asleep(timeout=10.0)
            except CopierError as exc:
                self._drop_copier(str(exc))

        return timed("copier_sleep", work)[1]

    def _by_copier(
        self, begin: Callable[[], _C.HostOrder], *, to_host: bool, here: Callable[[], int], then_sleep: bool = True
    ) -> int:
        """One order run by the copier; in this process instead when there is none or it fails
        (the staging's bytes are this process's memfds, so nothing is lost with it)."""
        copier = self._copier
        self.last_copy = None
        if copier is None or (to_host and copier.awake_on is None):  # not woken for this pause (no room for it)
            return here()
        began = time.perf_counter()
        try:
            order = begin()
        except (ValueError, RuntimeError) as exc:  # e.g. the pool outgrew the staging: the stage here grows it
            self._drop_copier(f"{type(exc).__name__}: {exc}")
            return here()
        begin_s = time.perf_counter() - began
        try:
            # A staging a young job's keeper is still touching: what it has not reached is written, as a staging
            # made at the safe point is (docs/fast-path.md, "Written at the safe point").
            write_untouched = to_host and written_staging_enabled()
            reply = copier.copy(
                to_host, order, then_sleep=then_sleep, pin_rest_pause_ms=PIN_PAUSE_MS, write_untouched=write_untouched
            )
            self.last_copy = CopierCopy(
                int(reply.get("pinned_in_copy", 0)),
                float(reply.get("pin_s", 0.0)),
                float(reply.get("touch_wait_s", 0.0)),
                float(reply.get("copy_s", 0.0)),
                int(reply.get("written", 0)),
                int(reply.get("write_buffer", 0)),
            )
            log.debug(
                "copier %s %.2f GiB: order %.0f ms here, then in the copier: import %.0f ms, "
                "pinning %.2f GiB it had not reached %.0f ms, copies %.0f ms (%.0f ms with the exchange; "
                "%.2f GiB written, not pinned)",
                "to host" if to_host else "back",
                order.bytes / (1 << 30),
                begin_s * 1e3,
                reply.get("import_s", 0.0) * 1e3,
                reply.get("pinned_in_copy", 0) / (1 << 30),
                reply.get("pin_s", 0.0) * 1e3,
                reply.get("copy_s", 0.0) * 1e3,
                (time.perf_counter() - began - begin_s) * 1e3,
                reply.get("written", 0) / (1 << 30),
            )
        except CopierError as exc:
            _C.abort_host_order()
            self._drop_copier(str(exc))
            return here()
        except BaseException:
            _C.abort_host_order()
            raise
        return int(_C.finish_host_order())

    def _drop_copier(self, why: str, *, copies_here: bool = True) -> None:
        """Kills the copier. `copies_here`: a move's copies run in this process instead, which its
        result says; else (the keeper asking how far it pinned) the next need starts another."""
        if copies_here:
            self.copier_fallback = why
        if self._copier is not None:
            log.warning(
                "the copier process is stopped (%s)%s", why, "; this process copies instead" if copies_here else ""
            )
            self._copier.kill()
            self._copier = None

    def done_with_host(self) -> None:
        """After a pause ended (resumed, rolled back or called off): the staging stays for the
        next pause when the pinned host memory budget lets this job keep it, else goes back; one
        kept in part keeps that part (its driver-made host memory, still claimed), for the keeper
        to keep ready again without making it anew, and gives back what the pause made. Memfds the
        pause made at its safe point go too where the keeper can make driver memory instead: kept,
        every resume would pin them again (fact `resume-paced-by-pinning`)."""
        with self._host_lock:
            uuid = (self._copier.awake_on if self._copier is not None else None) or ""
            if self._try_keep(uuid):
                if not self._memfds_to_remake():
                    return
            elif not self.kept_in_part:
                self.release_host_later()
                return
            part = self._driver_made_bytes()
            if part == 0 or pinned_budget.claim(part, uuid) is not None:
                self.release_host_later()
                return
            self.release_host_later(keep_driver_made=True)

    def _stays_kept(self, uuid: str) -> bool:
        """Whether the staging stays as it is after the resume under way (done_with_host): a copier that
        stays awake for it pins what its copy back did not use; else it sleeps after its copies."""
        return self._try_keep(uuid) and not self._memfds_to_remake()

    def _driver_made_bytes(self) -> int:
        layout = _C.host_staging_layout()
        return sum(size for (_fd, size), made in zip(layout.extents, layout.driver_made, strict=True) if made)

    def _memfds_to_remake(self) -> int:
        """Bytes of memfds in the staging (made at a pause's safe point) that the keeper would make anew as
        host memory of the driver's, which a resume maps instead of pinning; 0: none, or it cannot."""
        memfds = int(_C.host_staging_pool_bytes()) - self._driver_made_bytes()
        return memfds if memfds > 0 and self._may_make_driver_memory(memfds) else 0

    def _try_keep(self, uuid: str) -> bool:
        """Whether the staging may stay between pauses (claimed in the pinned host memory budget)."""
        held = int(_C.host_staging_pool_bytes())
        self.keeping = held > 0 and pinned_budget.claim(held, uuid) is None
        return self.keeping

    def release_host_later(self, *, keep_driver_made: bool = False) -> None:
        """Gives the staging's host memory back in a background thread (unmapping tens of GiB
        takes a second the resumed job need not wait for); the copier unmaps it too and stays,
        asleep, for the next pause, which maps and touches the staging again before its safe
        point. `keep_driver_made`: the driver-made host memory stays, and its claim in the pinned
        budget. Not a daemon: the interpreter waits for it at exit, as a daemon thread ended
        inside the native call would abort the process."""
        self._wait_for_release()
        if keep_driver_made:
            self.keeping = False  # the copier lets go of it: the keeper keeps it ready again
        else:
            self._stop_keeping()
        copier = self._copier
        thread = threading.Thread(
            target=self._release_host, args=(copier, keep_driver_made), name="flexium-host-staging-release"
        )
        self._releasing = thread
        thread.start()

    def release_host_now(self) -> None:
        """Before a driver-path checkpoint: pinned staging would slow it, and it needs none."""
        with self._host_lock:
            self._wait_for_release()
            self._stop_keeping()
            with release_hurried():  # the checkpoint waits for it
                self._release_host(self._copier)

    def copier_sleep_now(self) -> StepTiming:
        """Before a migration: the copier, awake with the staging pinned, holds a context on the
        GPU the job leaves, which must be left with nothing of the job's. The staging stays."""

        def work() -> None:
            with self._host_lock:
                if self._copier is None or self._copier.awake_on is None:
                    return
                try:
                    self._copier.sleep()
                except CopierError as exc:
                    self._drop_copier(str(exc))

        return timed("copier_sleep", work)[1]

    def keep_ready(self, logical: int, uuid: str, keep_going: Callable[[], bool] = lambda: True) -> str | None:
        """Between pauses: the staging holds what a pause of `logical` needs and the copier keeps
        it pinned on the job's GPU `uuid`, so that a pause only copies. Returns what it did, or
        why it could not (the pinned host memory budget); None when nothing was needed. What the
        staging lacks is host memory the driver makes in the copier, a piece at a time without the
        staging's lock, while `keep_going()` (no operation is under way), else memfds. A staging
        larger than what the budget has left keeps that much of it, when that is at least a
        KEPT_PART_AT_LEAST-th: a pause copies it at once and streams the rest."""
        with self._host_lock:
            if self.host_waiting() > 0:
                return None
            self._wait_for_release(hurry=False)  # what a resume gives back must be gone before the staging is counted
            wanted = self.host_bytes_wanted(logical)
            held = int(_C.host_staging_pool_bytes())
            awake = self._copier_awake_on(uuid)
            if awake and held >= wanted:
                return None
            crowded = None if awake else copier_room_problem(uuid)
            if crowded is not None:
                if held > 0 and not self.keeping:  # a part kept through a resume, which no copier can keep now
                    self.release_host_later()
                return f"nothing is kept pinned for a pause for now: {crowded}"
            keep, in_part = self._claim_kept(wanted, held, uuid)
            if keep == 0:
                if held > 0 and not self.keeping:
                    self.release_host_later()
                return f"the staging for a pause is prepared when one is asked for: {in_part}"
            making = self._copier_to_make(keep - held, uuid)
        if making is not None and not self._make_driver_memory(making, keep - held, keep_going):
            with self._host_lock:
                if not self.keeping:
                    self._claim_what_is_held(uuid)
            return (
                "the copier process failed making host memory for a pause: what it made is held, and the keeper "
                "makes the rest with another at its next look"
            )
        with self._host_lock:
            if self.host_waiting() > 0 or not keep_going():
                return None
            try:
                reserved = self._reserve_host(logical, keep, uuid, pin="ahead")
            except BaseException:
                self._stop_keeping()
                raise
            if not reserved.where.startswith(BY_COPIER):  # pinned here, which must not hold it between pauses
                self.release_host_later()
                return (
                    "the staging for a pause is prepared when one is asked for: the copier process failed "
                    f"({reserved.where})"
                )
            self.keeping, self.kept_in_part = True, in_part
            held = int(_C.host_staging_pool_bytes())
            part = (
                f", {gib_or_mib(held)} of the {gib_or_mib(wanted)} it needs, as {in_part}: a pause copies that part "
                "at once and streams the rest"
                if in_part
                else ""
            )
            return (
                f"pins {held / (1 << 30):.2f} GiB of host staging ahead {reserved.where} for a pause{part} "
                f"(made in {reserved.seconds:.2f} s: {reserved.phases}); a pause that comes meanwhile streams what is "
                "not pinned yet"
            )

    def _claim_what_is_held(self, uuid: str) -> None:
        """The pinned budget's claim is what the staging holds now (none for none), where the keeper
        claimed more than it then made, or a resume kept only part of what was claimed."""
        held = int(_C.host_staging_pool_bytes())
        if held == 0:
            pinned_budget.release()
        elif pinned_budget.claim(held, uuid) is not None:
            self.release_host_later()

    def _claim_kept(self, wanted: int, held: int, uuid: str) -> tuple[int, str]:
        """The bytes of staging to keep for a pause that needs `wanted` (`held` kept now), claimed in the
        pinned host memory budget, and why they are fewer than `wanted` ("" when they are not); (0, why)
        when nothing is kept (a staging is never cut: one larger than the budget's share goes back)."""
        whole = -(-max(wanted, held) // STAGING_STEP) * STAGING_STEP  # what the staging will hold, rounded as made
        refusal = pinned_budget.claim(whole, uuid)
        if refusal is None:
            return whole, ""
        at_least = max(-(-wanted // KEPT_PART_AT_LEAST), held)
        share, why = pinned_budget.claim_up_to(whole, uuid, at_least=at_least, step=STAGING_STEP)
        return (share, why) if share > 0 else (0, refusal)

    def _copier_to_make(self, missing: int, uuid: str) -> Copier | None:
        """The copier, awake on `uuid` with the staging attached, when it should make the `missing` bytes
        as host memory of the driver's; None when it should not (switched off, refused before, the
        copier off or failing: memfds then)."""
        if missing <= 0 or not self._may_make_driver_memory(missing):
            return None
        try:
            # A staging going back must be gone before the copier is attached again.
            self._wait_for_release(hurry=False)
            self._wait_for_start()
            copier, _started_now = self._live_copier()
            copier.attach(_C.host_staging_layout())
            if copier.awake_on != uuid:  # its context, taken before the next request is read
                copier.wake(uuid, wait=False, pause_ms=PIN_PAUSE_MS)
        except CopierError as exc:
            self._drop_copier(f"it could not start making host memory: {exc}", copies_here=False)
            return None
        return copier

    def _may_make_driver_memory(self, nbytes: int) -> bool:
        """Whether the copier may make `nbytes` of host memory of the driver's (else a kept staging is
        memfds): not switched off, not refused before, and files to spare for a piece each."""
        if not copier_enabled() or not driver_memory_enabled() or self.driver_memory_refused:
            return False
        # An fd per piece, held by this process as long as the staging: never at the cost of the files a move
        # needs (one per segment, blocker()).
        pieces = -(-nbytes // DRIVER_MADE_PIECE)
        if open_file_headroom() < pieces + len(_C.vmm_segments()) + FD_RESERVE:
            log.debug("the staging kept for pauses is memfds: too few files left for %d pieces of host memory", pieces)
            return False
        return True

    def _make_driver_memory(self, copier: Copier, missing: int, keep_going: Callable[[], bool]) -> bool:
        """Adds `missing` bytes of host memory made by the driver in `copier` to the staging, a piece per
        exchange, the staging's lock held only while each is added: a pause that comes meanwhile waits
        for one piece at most, and streams what is not made yet. False when the copier failed (it is
        stopped): the keeper's next look makes the rest with another, rather than memfds now."""
        made = 0
        while made < missing and keep_going():
            try:
                pieces = copier.make_host(min(DRIVER_MADE_PIECE, missing - made), DRIVER_MADE_PIECE)
            except CopierRefused as exc:
                self.driver_memory_refused = str(exc)
                log.info("the staging kept for pauses is memfds the copier pins: %s", exc)
                return True
            except CopierError as exc:
                with self._host_lock:
                    if self._copier is copier:
                        self._drop_copier(f"it failed making host memory: {exc}", copies_here=False)
                return False
            with self._host_lock:
                if self.host_waiting() > 0 or not keep_going() or self._copier is not copier:
                    close_all([fd for fd, _size in pieces])
                    return True
                try:
                    _C.adopt_host_memory(pieces)  # the fds are the staging's now, closed by it on failure too
                except (RuntimeError, ValueError) as exc:
                    log.debug("host memory the copier made was not added to the staging: %s", exc)
                    return True
            made += sum(size for _fd, size in pieces)
            time.sleep(PIN_PAUSE_MS / 1000)  # a pause waiting for the lock takes it now
        return True

    def kept_pinning(self, uuid: str) -> PinnedAhead | None:
        """How far the copier has pinned the staging it keeps on the GPU `uuid`; None when none is
        kept there, or the copier could not say (it is then stopped: the keeper starts another)."""
        with self._host_lock:
            copier = self._copier
            if copier is None or not self.kept_on(uuid):
                return None
            try:
                reply = copier.pinning()
            except CopierError as exc:
                self._drop_copier(f"it failed pinning the staging ahead: {exc}", copies_here=False)
                return None
            if reply is None:  # a resume's copy back is under way: asked again later
                return None
            return PinnedAhead(
                int(reply.get("pinned", 0)),
                int(_C.host_staging_pool_bytes()),
                bool(reply.get("pinning")),
                str(reply.get("pinner", "")),
            )

    def give_back_kept(self) -> None:
        """The staging kept between pauses goes back (nothing of a pause is under way)."""
        with self._host_lock:  # kept, or kept in part and let go of by the copier after a resume
            if (self.keeping or self.kept_in_part) and self.host_waiting() == 0:
                self.release_host_later()

    def kept_on(self, uuid: str) -> bool:
        """Whether a staging is kept pinned by a live copier on the GPU `uuid` now."""
        return self.keeping and self._copier_awake_on(uuid)

    def _copier_awake_on(self, uuid: str) -> bool:
        copier = self._copier
        return copier is not None and copier.alive() and copier.awake_on == uuid

    def _stop_keeping(self) -> None:
        pinned_budget.release()
        self.keeping, self.kept_in_part = False, ""

    def _release_host(self, copier: Copier | None, keep_driver_made: bool = False) -> None:
        started = time.perf_counter()
        held = int(_C.host_staging_pool_bytes())
        if copier is not None:
            try:
                copier.detach()
            except CopierError as exc:
                log.warning("the copier process failed to let the staging go (%s); it is stopped", exc)
                copier.kill()
                if self._copier is copier:
                    self._copier = None
        detached = time.perf_counter()
        release_host_staging(keep_driver_made)
        log.debug(
            "gave %.2f GiB of host staging back in %.2f s (the copier's letting go %.2f s, this process's %.2f s)",
            held / (1 << 30),
            time.perf_counter() - started,
            detached - started,
            time.perf_counter() - detached,
        )

    def _wait_for_release(self, *, hurry: bool = True) -> None:
        """`hurry` (a move or the job's stop waits): the release drops what is left at once meanwhile; the
        keeper, which waits between moves, lets it spare the training job (_C.set_host_release_hurried)."""
        if self._releasing is None:
            return
        with release_hurried() if hurry else nullcontext():
            self._releasing.join()
        self._releasing = None

    def host_waiting(self) -> int:
        return int(_C.host_staged_segments())

    def waiting_bytes(self) -> int:
        """Bytes of the pool's segments that wait in host staging (after a fast pause)."""
        if self.host_waiting() == 0:
            return 0
        return sum(int(s.size) for s in _C.vmm_segments() if not s.mapped)


@contextmanager
def release_hurried() -> Iterator[None]:
    """While someone waits for a staging going back, the release drops what is left at once
    (_C.set_host_release_hurried); between moves it spares the training job."""
    _C.set_host_release_hurried(True)
    try:
        yield
    finally:
        _C.set_host_release_hurried(False)
