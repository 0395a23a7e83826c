"""A pause's host staging: how much of it a pause takes, when the copier process may take a context
beside the job, and the records of what its preparation and copies did (path.py follows them).
docs/fast-path.md says why."""

from __future__ import annotations

import logging
from dataclasses import dataclass

from flexium import _C
from flexium.config import switch_from_env

log = logging.getLogger("flexium")
# Host staging a pause prepares beyond the pool's live bytes (one chunk of csrc's staging).
HOST_STAGING_SLACK = 256 << 20
POOL_GROWTH_ROOM = 8  # the staging may exceed the pool by 1/8
# Between the copier's chunks while it pins ahead of a pause: the job's CUDA calls get through.
PIN_PAUSE_MS = 2
# The copier's context on the job's GPU (fact `staging-pinned-by-copier`: 518 MiB), and what must stay
# free beside it: a context made on a GPU without room fails or stalls the driver.
COPIER_CONTEXT_BYTES = 518 << 20
COPIER_ROOM_MARGIN = 512 << 20
DISABLE_NOTE = "the copier process is off: FLEXIUM_HOST_COPIER=0"
# A staging kept between pauses is host memory the driver makes in the copier, which stays pinned through a
# pause with no context, so that a resume copies back without pinning (fact `driver-made-host-memory`); false:
# memfds the copier pins, and pins again at each resume.
DRIVER_MEMORY_ENV = "FLEXIUM_DRIVER_HOST_MEMORY"
DRIVER_MADE_PIECE = 1 << 30  # one allocation and fd each; the copier's turn is held for one at a time
# A staging larger than what the pinned host memory budget has left keeps that much of it between pauses,
# if it is at least this share of what a pause needs: the pause copies the kept part at once and streams
# the rest (docs/fast-path.md, "Part of it kept").
KEPT_PART_AT_LEAST = 4  # a quarter
STAGING_STEP = 2 << 20  # the staging's extents are whole huge pages (csrc/vmm_host_staging.cpp)


def driver_memory_enabled() -> bool:
    return switch_from_env(DRIVER_MEMORY_ENV, True, "driver-made host memory switch")


BY_COPIER = "by the copier process"  # where the staging was pinned, as FastPath.reserve_host says it


@dataclass(frozen=True)
class Reserved:
    """What reserve_host did: the staging's bytes pinned for the pause, those of them it pinned
    now (the rest stayed pinned from before), the seconds it took and where it pinned them."""

    pinned: int
    newly_pinned: int
    seconds: float
    where: str
    phases: str = ""  # where the seconds went, e.g. "touching 1.50 s, pinning 3.21 s"
    # Made at the safe point: the bytes the copier had pinned ahead when it stopped that pinning for
    # the copies (a staging kept for pauses, still being pinned), and how that pinning had gone.
    found_pinned: int = 0
    pinning_before: str = ""
    staging: int = 0  # the staging's bytes then, the rest of which the pause pins as its copies near it
    made_by_driver: int = 0  # of them, host memory the keeper had made with the driver before the pause


@dataclass(frozen=True)
class PinnedAhead:
    """How far the copier has pinned the staging kept for pauses: `pinned` of its `staging` bytes,
    whether its pinner still runs, and how the last one ended (the copier's words)."""

    pinned: int
    staging: int
    pinning: bool
    pinner: str

    @property
    def complete(self) -> bool:
        return self.pinned >= self.staging


@dataclass(frozen=True)
class CopierCopy:
    """What the copier's order did: the bytes it pinned as its copies reached them and the seconds
    of that pinning, of which waiting for its touching threads to reach them, the seconds from its
    first copy to its last one's end (pinning included), and the bytes it wrote into a staging made
    to be written rather than touched (``written_staging_enabled``) through two pinned buffers per
    writing thread, each of `write_buffer` bytes."""

    pinned: int
    pin_s: float
    touch_wait_s: float
    copy_s: float
    written: int = 0
    write_buffer: int = 0


@dataclass(frozen=True)
class HostCopy:
    """A pause's copy step: the live bytes copied, the staging made in the step (None: it was
    ready before the safe point), the seconds of the copies (pinning what was not pinned
    included), and what the copier said of them (None: they ran in this process)."""

    copied: int
    made: Reserved | None
    copy_s: float
    by_copier: CopierCopy | None


def copier_room_problem(uuid: str, coming: int = 0) -> str | None:
    """Why the copier should not take a context on the GPU `uuid` now (None: it has room, or
    NVML cannot tell). `coming`: bytes the job is about to take there (a resume's), which the
    copier's context must leave room for."""
    from flexium.engine import nvml

    try:
        gpu = nvml.gpu_by_uuid(uuid)
    except Exception:  # NVML unreadable: the copier tries, and fails over to this process
        return None
    needed = COPIER_CONTEXT_BYTES + COPIER_ROOM_MARGIN + coming
    if gpu is None or gpu.memory_free >= needed:
        return None
    beside = f"beside the {coming >> 20} MiB the job comes back with" if coming else "beside the job"
    return (
        f"the GPU has {gpu.memory_free >> 20} MiB free, less than the {needed >> 20} MiB the copier's context "
        f"needs {beside}"
    )


def release_host_staging(keep_driver_made: bool = False) -> None:
    try:
        _C.release_host_staging(keep_driver_made=keep_driver_made)
    except Exception as exc:  # the next pause reuses what is left; nothing is lost
        log.warning("could not give the host staging back: %s: %s", type(exc).__name__, exc)
