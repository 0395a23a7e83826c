"""Who may take a GPU that a job earlier in the queue waits for, the queue's one rule of passing (for
paused jobs' waits and flexium run's placements alike).

Strict first come first served lets one big job hold up its host: a 100 GiB job waiting for a GPU
to empty would keep every later 5 GiB job of its priority waiting too, on GPUs with room for them.
So a job that fits a GPU now takes it ahead of an earlier job of its own priority that fits nowhere
yet (backfill), until that earlier job has waited the server's backfill patience
(``--backfill-patience``, 60 s by default; 0 makes the queue strictly first come first served within
a priority): from then on no job after it in the queue takes the GPUs it waits for, and the room
freed there collects for it, so it is not starved by a stream of small ones. A job never goes ahead
of one of higher priority that waits for a GPU (a higher priority is never delayed by a lower one)."""

from __future__ import annotations

from collections.abc import Iterable


class WaitedFor:
    """The GPUs that jobs which fit nowhere yet wait for, each with those jobs as the queue orders
    them (priority, queued at); ``patience``: the server's backfill patience, in seconds."""

    def __init__(self, *, patience: float) -> None:
        self.patience = patience
        self.by_gpu: dict[str, list[tuple[int, float]]] = {}

    def add(self, uuids: Iterable[str], *, priority: int, queued_at: float) -> None:
        for uuid in uuids:
            self.by_gpu.setdefault(uuid, []).append((priority, queued_at))

    def closed_to(self, uuid: str, *, priority: int, queued_at: float, now: float) -> bool:
        """Whether a job of ``priority`` queued at ``queued_at`` leaves the GPU to one before it."""
        return any(
            (-earlier, at) <= (-priority, queued_at) and (earlier > priority or now - at >= self.patience)
            for earlier, at in self.by_gpu.get(uuid, ())
        )

    def closed(self, *, priority: int, queued_at: float, now: float) -> set[str]:
        return {uuid for uuid in self.by_gpu if self.closed_to(uuid, priority=priority, queued_at=queued_at, now=now)}
