"""The few things the engine asks of PyTorch, each harmless where torch or CUDA is missing."""

from __future__ import annotations

from typing import Any


def _torch_cuda() -> Any | None:
    try:
        import torch
    except ImportError:
        return None
    cuda: Any = torch.cuda  # torch leaves is_initialized() unannotated
    return torch if cuda.is_available() and cuda.is_initialized() else None


def _devices_with_context(torch: Any) -> list[int]:
    # Touching a device without a context would create one (about 500 MiB), so only these.
    return [d for d in range(torch.cuda.device_count()) if torch._C._cuda_hasPrimaryContext(d)]


def synchronize() -> None:
    torch = _torch_cuda()
    if torch is None:
        return
    for device in _devices_with_context(torch):
        torch.cuda.synchronize(device)


def release_cached_memory() -> None:
    """Unused cached blocks would otherwise be copied by the checkpoint for nothing."""
    torch = _torch_cuda()
    if torch is not None:
        torch.cuda.empty_cache()


def reserved_bytes() -> int:
    torch = _torch_cuda()
    if torch is None:
        return 0
    return sum(int(torch.cuda.memory_reserved(d)) for d in _devices_with_context(torch))
