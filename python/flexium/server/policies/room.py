"""A host's GPUs as the policies count their room. The last GPU report's free memory, less what
resumes and moves under way will bring (and those that ended after that report, which it does not
show yet), less what is held for other jobs (reservations). A job going back to an empty GPU it
paused from needs its memory; beside other processes or on another GPU, the headroom its own room
check asks too (``protocol.ROOM_MARGIN_BYTES``), so that the queue does not send a resume the job
would refuse."""

from __future__ import annotations

from dataclasses import dataclass, field

from sqlalchemy import and_, or_, select
from sqlalchemy.orm import Session

from flexium import protocol
from flexium.server.models import Command, Device, Process
from flexium.server.storage.devices import host_devices
from flexium.server.storage.reservations import holds_on_host


@dataclass
class GpuRoom:
    device: Device
    free: int  # by the last report, less the memory on its way there
    held: dict[int | None, int] = field(default_factory=dict)  # wait id (None: a job not started) -> bytes


class HostRoom:
    def __init__(self, gpus: dict[str, GpuRoom]) -> None:
        self.gpus = gpus

    @classmethod
    def read(cls, *, session: Session, workspace_id: int, host: str, now: float) -> HostRoom:
        devices = host_devices(session=session, workspace_id=workspace_id, host=host)
        gpus = {uuid: GpuRoom(dev, max(0, dev.memory_total - dev.memory_used)) for uuid, dev in devices.items()}
        oldest = min((dev.updated_at for dev in devices.values()), default=now)
        for target, kind, state, finished_at, home, footprint, memory in session.execute(
            select(
                Command.target_uuid,
                Command.kind,
                Command.state,
                Command.finished_at,
                Process.gpu_uuid,
                Process.footprint_bytes,
                Process.memory_bytes,
            )
            .join(Process, Process.pk == Command.process_pk)
            .where(
                Command.workspace_id == workspace_id,
                Process.host == host,
                Command.kind.in_(("resume", "migrate")),
                or_(
                    Command.state.in_(protocol.ACTIVE_COMMAND_STATES),
                    and_(Command.state == "succeeded", Command.finished_at > oldest),
                ),
            )
        ):
            dest = target or (home if kind == "resume" else None)
            room = gpus.get(dest or "")
            if room is None or (state == "succeeded" and (finished_at or 0.0) <= room.device.updated_at):
                continue
            room.free = max(0, room.free - max(footprint, memory))
        for uuid, wait_id, held in holds_on_host(session=session, workspace_id=workspace_id, host=host, now=now):
            room = gpus.get(uuid)
            if room is not None:
                room.held[wait_id] = room.held.get(wait_id, 0) + held
        return cls(gpus)

    def free_for(self, uuid: str, wait_id: int | None) -> int:
        """What a resume of wait ``wait_id`` may count on: what is free less what is held for others.
        ``wait_id`` None (no wait yet, or a job not started): everything held is someone else's, the
        room held for jobs not started (keyed None) included."""
        room = self.gpus[uuid]
        others = (held for holder, held in room.held.items() if holder is None or holder != wait_id)
        return max(0, room.free - sum(others))

    def unheld(self, uuid: str) -> int:
        """What a move that no room is held for may count on."""
        room = self.gpus[uuid]
        return max(0, room.free - sum(room.held.values()))

    def holds_for(self, uuid: str, wait_id: int) -> bool:
        return wait_id in self.gpus[uuid].held

    def required(self, uuid: str, need: int, *, home: str | None) -> int:
        """``need`` with the headroom the job's room check adds on another GPU or beside others."""
        shared = self.gpus[uuid].device.memory_used > 0
        return need + protocol.ROOM_MARGIN_BYTES if uuid != home or shared else need

    def take(self, uuid: str, nbytes: int, wait_id: int | None) -> None:
        """A resume sent there: its memory is on its way, and what was held for it is used."""
        self.arriving(uuid, nbytes)
        self.gpus[uuid].held.pop(wait_id, None)

    def arriving(self, uuid: str, nbytes: int) -> None:
        """A move sent there: its memory is on its way."""
        room = self.gpus[uuid]
        room.free = max(0, room.free - nbytes)
