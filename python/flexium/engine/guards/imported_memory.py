"""CUDA memory this process imported from another process (CUDA IPC), as torch.multiprocessing does
with a CUDA tensor another process sends it. The driver checkpoints such a process, but its restore
fails and every later restore too: the process never runs CUDA again (fact `ipc-import-unrestorable`).

An import changes nothing in /proc/self/maps, and the driver lists no imports, so the native scan
(csrc/uncheckpointable_memory.h) cannot find it. PyTorch keeps every storage it imported in
`torch.multiprocessing.reductions.shared_cache`, keyed by (IPC handle, offset), as a weak reference
(a storage it exported is keyed by the handle alone, a CPU one by its file): those still alive are
what the process holds now. Memory imported by other libraries (CuPy, cuIpcOpenMemHandle called
directly) is not seen (docs/guide/limits.md).
"""

from __future__ import annotations

import sys
from dataclasses import dataclass
from typing import Any


@dataclass(frozen=True)
class Imports:
    storages: int
    bytes: int
    first_address: int


def held_now() -> Imports | None:
    """The CUDA storages this process imported through PyTorch and still holds; None: none."""
    reductions = sys.modules.get("torch.multiprocessing.reductions")
    cache = getattr(reductions, "shared_cache", None)
    if cache is None:  # never imported: nothing was received through torch.multiprocessing
        return None
    with cache.lock:
        entries = list(dict.items(cache))
    storage_class: Any = sys.modules["torch"].UntypedStorage
    sizes: list[tuple[int, int]] = []
    for key, ref in entries:
        if not (isinstance(key, tuple) and len(key) == 2 and isinstance(key[0], bytes)) or ref.expired():
            continue
        storage = storage_class._new_with_weak_ptr(ref.cdata)
        if storage is not None and storage.device.type == "cuda":
            sizes.append((storage.data_ptr(), storage.nbytes()))
    if not sizes:
        return None
    return Imports(len(sizes), sum(size for _, size in sizes), min(address for address, _ in sizes))
