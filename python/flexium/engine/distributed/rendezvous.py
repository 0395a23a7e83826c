"""How the ranks of one job meet for a whole-job operation: through the job's own c10d store
(the TCPStore torchrun starts), under keys of the operation's id, each wait bounded.

Each stage is a gather: every rank posts its word (``ok`` or why not) and waits until every
rank has posted, or until any rank aborts the operation, or until the stage's deadline. A
rank that gives up aborts for all, so no rank waits longer than its own deadline for another
that will never come. Whether a stage was met or given up is decided once, for every rank, by
the first rank to decide it (the store's compare-and-set): a rank that posts just as another
gives up must not take the stage for met while the other rolls back.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

OK = "ok"
POLL_SECONDS = 0.001
MET, GIVEN_UP = "met", "given up"  # a stage's verdict


class JobAborted(RuntimeError):
    """The operation was given up (by this rank or another); nothing more happens in it."""


@dataclass(frozen=True)
class Gathered:
    words: dict[int, str]  # rank -> what it posted

    @property
    def all_ok(self) -> bool:
        return all(word == OK for word in self.words.values())

    def failures(self) -> dict[int, str]:
        return {rank: word for rank, word in sorted(self.words.items()) if word != OK}

    def describe_failures(self) -> str:
        return "; ".join(f"rank {rank}: {word}" for rank, word in self.failures().items())


class Rendezvous:
    def __init__(
        self,
        store: Any,
        operation_id: int,
        *,
        rank: int,
        world_size: int,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.store = store
        self.prefix = f"flexium/op/{operation_id}/"
        self.rank = rank
        self.world_size = world_size
        self.clock = clock

    def _key(self, stage: str, rank: int) -> str:
        return f"{self.prefix}{stage}/{rank}"

    def post(self, stage: str, word: str = OK) -> None:
        self.store.set(self._key(stage, self.rank), word)

    def posted(self, stage: str) -> bool:
        """Whether every rank has posted at `stage` (one round trip, never waits)."""
        return bool(self.store.check([self._key(stage, rank) for rank in range(self.world_size)]))

    def missing(self, stage: str) -> list[int]:
        return [rank for rank in range(self.world_size) if not self.store.check([self._key(stage, rank)])]

    def words(self, stage: str) -> Gathered:
        return Gathered({rank: _text(self.store.get(self._key(stage, rank))) for rank in range(self.world_size)})

    def abort(self, reason: str) -> None:
        """Gives the operation up for every rank; the first reason given is the one kept."""
        key = self.prefix + "abort"
        if not self.store.check([key]):
            self.store.set(key, f"rank {self.rank}: {reason}")

    def aborted(self) -> str | None:
        key = self.prefix + "abort"
        if self.store.check([key]):
            return _text(self.store.get(key))
        return None

    def gather(self, stage: str, word: str, *, deadline_s: float, what: str, abortable: bool = True) -> Gathered:
        """Posts `word` at `stage` and returns every rank's word once all have posted. Raises
        JobAborted when a rank gave up (unless not `abortable`: a meeting every rank comes to
        whatever happened before), or (giving up for all) when `deadline_s` passed first; `what`
        says what the ranks were waiting for, in the reason."""
        self.post(stage, word)
        until = self.clock() + deadline_s
        while True:
            if self.posted(stage):
                if not abortable or self._decide(stage, MET) == MET:
                    return self.words(stage)
                raise JobAborted(self.aborted() or f"the ranks gave up at {stage}")
            reason = self.aborted() if abortable else None
            if reason is not None:
                raise JobAborted(reason)
            if self.clock() >= until:
                if abortable and self._decide(stage, GIVEN_UP) == MET:
                    return self.words(stage)  # every rank posted meanwhile, and one took the stage for met
                late = ", ".join(str(rank) for rank in self.missing(stage))
                reason = f"rank(s) {late} did not {what} within {deadline_s:g} s"
                self.abort(reason)
                raise JobAborted(f"rank {self.rank}: {reason}")
            time.sleep(POLL_SECONDS)

    def _decide(self, stage: str, verdict: str) -> str:
        """The stage's one verdict for every rank: `verdict`, unless a rank decided it first."""
        return _text(self.store.compare_set(f"{self.prefix}{stage}/verdict", "", verdict))


def _text(value: Any) -> str:
    return value.decode(errors="replace") if isinstance(value, (bytes, bytearray)) else str(value)


def job_store() -> Any:
    """The default process group's store (torchrun's TCPStore, wrapped in torch's prefix)."""
    from torch.distributed import distributed_c10d as c10d

    return c10d._get_default_store()
