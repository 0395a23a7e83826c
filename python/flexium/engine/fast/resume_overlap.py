"""A fast resume's copy back made beside the driver's restore (docs/fast-path.md, "Resume: the copy
back beside the restore"; fact `copy-beside-restore`).

Before the restore the job plans the order (the segments waiting in the staging and their pieces: no
CUDA call, the process is still checkpointed) and sends it to the copier, awake on the GPU the job
resumes on. The copier makes the segments' new memory in its own context, pins and copies the staged
bytes into it while the driver restores the job, exports each allocation as an fd and lets go of its
own handle and mapping (the fds hold the memory). After the restore the job imports the fds, which
came with the copier's reply, and maps them at the segments' reserved addresses.

The memory is imported from another process: the job makes it its own at the next optimizer steps,
as after a migration (transactions/own_memory.py). Whatever fails, the segments not mapped still wait
in the staging and the copy back after the restore brings them, with a note saying why.
"""

from __future__ import annotations

import time
from dataclasses import dataclass

from flexium import _C
from flexium.engine.fast.host_copier import Copier
from flexium.units import gib


@dataclass(frozen=True)
class Filling:
    """A fill ordered from the copier: the order, and when it went (time.monotonic(), just before
    the restore)."""

    order: _C.FillOrder
    sent_at: float


@dataclass(frozen=True)
class Overlap:
    """What the copy back beside the restore did, in seconds on one clock (the copier's
    time.monotonic() is the job's)."""

    mapped_bytes: int  # the live bytes of the segments the job mapped
    fill_s: float  # the copier: memory made, bytes pinned and copied, fds exported
    pin_s: float  # of it, pinning what the copier had not pinned before
    beside_s: float  # of the fill, while the job restored
    restore_s: float  # from the order to the end of the restore
    waited_s: float  # the job, after its restore, for the copier's reply
    map_s: float  # the job importing and mapping the fds

    @property
    def overlapped(self) -> bool:
        return self.beside_s > 0

    def note(self) -> str:
        where = (
            f"{self.beside_s:.2f} s of it beside the job's restore ({self.restore_s:.2f} s)"
            if self.overlapped
            else f"none of it beside the job's restore ({self.restore_s:.2f} s)"
        )
        return (
            f"copied back beside the restore: the copier made and filled {gib(self.mapped_bytes, 2)} of new memory "
            f"in {self.fill_s:.2f} s (pinning {self.pin_s:.2f} s), {where}; the job waited {self.waited_s:.2f} s "
            f"after its restore and mapped it in {self.map_s:.2f} s"
        )


def start(copier: Copier, *, then_sleep: bool, pin_rest_pause_ms: int) -> Filling | None:
    """Orders the fill of every segment waiting in the staging (None: none waits)."""
    order = _C.plan_fill_order()
    if not order.segments:
        return None
    copier.fill(order, then_sleep=then_sleep, pin_rest_pause_ms=pin_rest_pause_ms)
    return Filling(order, time.monotonic())


def finish(copier: Copier, filling: Filling, logical: int) -> Overlap:
    """After the restore: the copier's reply read and its memory mapped for `logical`. Raises
    CopierError when the copier failed, DriverError or ValueError when mapping failed (the
    segments mapped before stay mapped; every fd is closed)."""
    restored_at = time.monotonic()
    filled = copier.filled(filling.order)
    replied_at = time.monotonic()
    mapped = int(_C.adopt_filled_segments(filling.order, filled.fds, logical))
    reply = filled.reply
    started, ended = float(reply["started"]), float(reply["ended"])
    return Overlap(
        mapped_bytes=mapped,
        fill_s=ended - started,
        pin_s=float(reply.get("pin_s", 0.0)),
        beside_s=max(0.0, min(ended, restored_at) - max(started, filling.sent_at)),
        restore_s=restored_at - filling.sent_at,
        waited_s=replied_at - restored_at,
        map_s=time.monotonic() - replied_at,
    )
