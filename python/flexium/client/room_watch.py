"""A paused job waiting in the server's queue watches the GPUs it may resume on itself: device
reports ride heartbeats every few seconds, so the server would see a neighbour's exit late. The
server says what to watch in its answers (``wire.RoomWatch``); the reporter thread reads the host's
GPUs every ``protocol.ROOM_WATCH_INTERVAL_S`` while the job is paused (through the NVML reader
process: a checkpointed process must not call NVML itself, fact `locked-process-blocks-cuda`) and
sends a heartbeat at once when one of them has the room free, once each time it appears."""

from __future__ import annotations

from collections.abc import Sequence

from flexium import wire
from flexium.engine import nvml


class RoomWatch:
    """What the server last said to watch, and whether the room it waits for was already told."""

    def __init__(self) -> None:
        self.watching: wire.RoomWatch | None = None
        self._told = False  # the room is there and the server knows: told again only once it went

    def follow(self, watch: wire.RoomWatch | None) -> None:
        """The server's word in an answer: what to watch now (None: nothing)."""
        if watch != self.watching:
            self.watching = watch
            self._told = False

    def tell_again(self) -> None:
        """The server did not hear it: the room, while it stays, is told at the next reading."""
        self._told = False

    def room_appeared(self, gpus: Sequence[nvml.HostGpu]) -> bool:
        """Whether ``gpus`` (a reading of the host's) show the room on a GPU it watches that was not
        there at the last reading (or not told yet)."""
        watch = self.watching
        if watch is None:
            return False
        there = any(gpu.uuid in watch.gpus and gpu.memory_free >= watch.need_bytes for gpu in gpus)
        appeared = there and not self._told
        self._told = there
        return appeared
