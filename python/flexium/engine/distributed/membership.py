"""This process's place in a torch.distributed job: which run, which rank, how many ranks.

Pausing or migrating one rank of a multi-process job on its own breaks the whole job: its other
ranks block in their next collective, and NCCL's buffers shared between ranks as CUDA IPC
cannot be restored (fact `nccl-buffers-not-restorable`). So the engine refuses it, and the job's ranks are
moved together instead (job_operation.py).

Reading this touches no CUDA and imports nothing: the engine asks before every migrate and
pause, and the client asks whenever it builds a report, possibly before the job has called
init_process_group (then the torchrun environment says what the job will be). The job's key is
agreed once through the process group's store (job_key).
"""

from __future__ import annotations

import os
import socket
import sys
import uuid
from dataclasses import dataclass
from typing import Any


@dataclass(frozen=True)
class DistributedJob:
    available: bool  # torch is imported and built with torch.distributed
    initialized: bool  # the default process group exists
    backend: str | None  # the default group's, e.g. "nccl", "gloo", "cpu:gloo,cuda:nccl"
    rank: int | None  # in the default group, else RANK of the environment
    world_size: int | None  # of the default group, else WORLD_SIZE of the environment
    local_rank: int | None  # LOCAL_RANK (torchrun)
    local_world_size: int | None  # LOCAL_WORLD_SIZE (torchrun): ranks on this node
    group_rank: int | None  # GROUP_RANK (torchrun): this node's rank

    @property
    def multi_process(self) -> bool:
        return (self.world_size or 1) > 1

    @property
    def multi_node(self) -> bool:
        return self.world_size is not None and self.world_size > (self.local_world_size or self.world_size)

    @property
    def uses_nccl(self) -> bool:
        return self.backend is not None and "nccl" in self.backend

    def describe_rank(self) -> str:
        """'rank 0 of 2 of a torch.distributed job (backend nccl)'."""
        rank = "?" if self.rank is None else str(self.rank)
        if self.initialized:
            how = f"backend {self.backend or 'unknown'}"
        else:
            how = "launched by torchrun, process group not initialized yet"
        if self.multi_node:
            how += f", node {'?' if self.group_rank is None else self.group_rank} of a multi-node job"
        return f"rank {rank} of {self.world_size} of a torch.distributed job ({how})"

    def refusal(self) -> str | None:
        """Why this process cannot be paused or migrated on its own, with what to do; None for
        a single-process job."""
        if not self.multi_process:
            return None
        return (
            f"this process is {self.describe_rank()}: pausing or migrating one rank alone would break the "
            "whole job (its other ranks block in their next collective); pause, resume or migrate the whole "
            "job instead, through the server (`flexium pause PROCESS` acts on every rank of its job)"
        )


def describe() -> DistributedJob:
    dist = _torch_distributed()
    initialized = False
    rank = _env_int("RANK")
    world_size = _env_int("WORLD_SIZE")
    backend: str | None = None
    if dist is not None and dist.is_initialized():
        try:
            backend, rank, world_size = str(dist.get_backend()), int(dist.get_rank()), int(dist.get_world_size())
            initialized = True
        except (RuntimeError, ValueError):  # destroyed meanwhile (the job is ending): the environment says
            pass
    return DistributedJob(
        available=dist is not None,
        initialized=initialized,
        backend=backend,
        rank=rank,
        world_size=world_size,
        local_rank=_env_int("LOCAL_RANK"),
        local_world_size=_env_int("LOCAL_WORLD_SIZE"),
        group_rank=_env_int("GROUP_RANK"),
    )


def job_key() -> str:
    """The same text in every rank of one run and in no other run. Once the process group exists its ranks agree on it
    through the group's store, whatever launched them (torchrun, whose ranks share a parent, or PyTorch Lightning and
    others, whose rank 0 is the user's process and starts the other ranks itself: fact
    `lightning-ranks-different-parents`); before, the launch environment says it (launch_key)."""
    agreed = _agreed_key()
    return agreed if agreed is not None else launch_key()


# The store of the process group whose ranks agreed on a key, and that key: asked for once per
# group (holding the store, a group made after this one cannot be taken for it).
_agreed: tuple[Any, str] | None = None
_AGREED_STORE_KEY = "flexium/job_key"


def _agreed_key() -> str | None:
    dist = _torch_distributed()
    if dist is None or not dist.is_initialized():
        return None
    try:
        from torch.distributed import distributed_c10d as c10d

        store = c10d._get_default_store()
    except (AttributeError, RuntimeError, ValueError):
        return None
    global _agreed
    if _agreed is None or _agreed[0] is not store:
        # The first rank to ask sets it; every rank reads what the first one set.
        proposal = f"{socket.gethostname()}:{uuid.uuid4().hex[:16]}"
        try:
            value = store.compare_set(_AGREED_STORE_KEY, "", proposal)
        except (RuntimeError, ValueError):  # the store is gone (the job is ending)
            return None
        _agreed = (store, value.decode() if isinstance(value, bytes) else str(value))
    return _agreed[1]


def launch_key() -> str:
    """The same text in every rank that one torchrun started, and in no other run: the host, the
    launcher (the torchrun agent, the ranks' parent), the rendezvous port and the run id and
    restart count torchrun sets (an elastic restart is a new run, with new processes)."""
    parts = (
        socket.gethostname(),
        str(os.getppid()),
        os.environ.get("MASTER_PORT", "-"),
        os.environ.get("TORCHELASTIC_RUN_ID", "-"),
        os.environ.get("TORCHELASTIC_RESTART_COUNT", "0"),
    )
    return ":".join(parts)


def _torch_distributed() -> Any | None:
    """torch.distributed when the job imported torch (a job that did not has no process group)."""
    torch = sys.modules.get("torch")
    if torch is None:
        return None
    dist = getattr(torch, "distributed", None)
    if dist is None or not dist.is_available():
        return None
    return dist


def _env_int(name: str) -> int | None:
    try:
        return int(os.environ[name])
    except (KeyError, ValueError):
        return None
