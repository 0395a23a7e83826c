"""train_job.py --hold-memory KIND:STEP: 4 MiB that the driver's checkpoint cannot carry, held from
before training until step STEP. flexium refuses to checkpoint a process holding any of it."""

from __future__ import annotations

import ctypes
import sys
from pathlib import Path
from typing import Any

import torch

from job_events import emit

PROBES = Path(__file__).resolve().parents[1] / "probes"  # the measurements behind the facts below


def send_cuda_tensor(queue: Any, done: Any, floats: int) -> None:
    """A spawned process that sends a CUDA tensor through torch.multiprocessing and keeps it (the
    sender must outlive the receiver's use) until `done` is set."""
    tensor = torch.zeros(floats, device="cuda")
    queue.put(tensor)
    done.wait(600)


class HeldMemory:
    """4 MiB written by a kernel: "host-cumem", cuMem memory on the host mapped for the GPU and the CPU (as NCCL makes
    it; fact `cumem-host-memory-unrestorable`, the allocation bench/probes/host_memory_restore.py measured), "managed",
    cuMemAllocManaged (as bitsandbytes' paged optimizers make it; fact `managed-memory-refused`), or "cuda-ipc", a CUDA
    tensor another process sent through torch.multiprocessing (fact `ipc-import-unrestorable`)."""

    FLOATS = 1 << 20

    def __init__(self, kind: str) -> None:
        sys.path.insert(0, str(PROBES))
        from cuda_driver import Driver
        from host_memory_restore import DeviceView, mapped_host_memory

        self.kind = kind
        if kind == "host-cumem":
            self.pointer, _host, self.keep = mapped_host_memory("cumem-host", self.FLOATS * 4)
        elif kind == "cuda-ipc":
            import torch.multiprocessing as mp

            context = mp.get_context("spawn")
            queue, self.done = context.Queue(), context.Event()
            self.sender = context.Process(target=send_cuda_tensor, args=(queue, self.done, self.FLOATS))
            self.sender.start()
            self.received = queue.get(timeout=120)
            self.pointer = self.received.data_ptr()
        else:
            address = ctypes.c_uint64()
            allocate = Driver().lib.cuMemAllocManaged
            allocate.argtypes = [ctypes.POINTER(ctypes.c_uint64), ctypes.c_size_t, ctypes.c_uint]
            assert allocate(ctypes.byref(address), self.FLOATS * 4, 1) == 0  # CU_MEM_ATTACH_GLOBAL
            self.pointer = address.value
        if kind == "cuda-ipc":
            self.view = self.received
        else:
            self.view = torch.as_tensor(DeviceView(self.pointer, self.FLOATS), device="cuda")
        self.view.fill_(1.0)
        torch.cuda.synchronize()
        emit("memory_held", kind=kind, address=self.pointer)

    def free(self) -> bool:
        """Frees it; whether it still held what the kernel wrote."""
        from cuda_driver import Driver
        from host_memory_restore import free_cumem_host

        intact = self.view.sum().item() == self.FLOATS
        del self.view
        torch.cuda.synchronize()
        if self.kind == "host-cumem":
            free_cumem_host(self.pointer, self.keep)
        elif self.kind == "cuda-ipc":
            del self.received  # the last reference: torch closes the import
            self.done.set()
            self.sender.join(60)
        else:
            Driver().call("cuMemFree", self.pointer)
        return intact
