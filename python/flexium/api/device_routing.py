"""Route `.cuda()` without a device to the device flexium manages.

Training code written for one GPU calls `tensor.cuda()` / `module.cuda()`, which means "the
current CUDA device". flexium decides which device that is (GPU_DEVICE, the dashboard), so the
bare calls are pointed at `get_device()`; a call that names a device is left alone.

Torch is imported only inside install(): importing flexium must not need it.
"""

from __future__ import annotations

import functools
import threading
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from flexium._logging import get_logger

__all__ = ["install", "uninstall", "is_installed", "managed_device"]

_log = get_logger("device_routing")

# Install and uninstall swap class attributes; two threads doing it at once could save one
# thread's wrapper as "the original" and never restore torch's.
_lock = threading.Lock()
_LOCK_TIMEOUT_S = 10.0


@dataclass(frozen=True)
class _Saved:
    owner: type
    name: str
    had_own: bool  # False: inherited (Tensor.cuda lives on torch._C.TensorBase)
    original: Any  # what `owner.__dict__[name]` held, or the inherited function
    wrapper: Any


_saved: list[_Saved] = []
_get_device: Callable[[], str] | None = None


def managed_device() -> str | None:
    """The device bare `.cuda()` calls go to now, or None when routing is off."""
    provider = _get_device
    return provider() if provider is not None else None


def _is_cpu(device: str) -> bool:
    return device.strip().lower() == "cpu"


def _tensor_to_cpu(tensor: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
    # Tensor.cuda(device, non_blocking, memory_format) and Tensor.to(device, dtype, ...) differ
    # in positional order, so the pass-through arguments are named here.
    options = dict(kwargs)
    for name, value in zip(("non_blocking", "memory_format"), args, strict=False):  # args may name fewer
        options[name] = value
    return tensor.to("cpu", **options)


def _wrap_tensor_cuda(original: Callable[..., Any]) -> Callable[..., Any]:
    @functools.wraps(original)
    def cuda(self: Any, device: Any = None, *args: Any, **kwargs: Any) -> Any:
        if device is None:
            target = managed_device()
            if target:
                # GPU_DEVICE=cpu: the same script runs without a GPU, as the user asked.
                if _is_cpu(target):
                    return _tensor_to_cpu(self, args, kwargs)
                return original(self, target, *args, **kwargs)
        return original(self, device, *args, **kwargs)

    return cuda


def _wrap_module_cuda(original: Callable[..., Any]) -> Callable[..., Any]:
    @functools.wraps(original)
    def cuda(self: Any, device: Any = None, *args: Any, **kwargs: Any) -> Any:
        if device is None:
            target = managed_device()
            if target:
                if _is_cpu(target):
                    return self.cpu()
                return original(self, target, *args, **kwargs)
        return original(self, device, *args, **kwargs)

    return cuda


def _acquire() -> None:
    if not _lock.acquire(timeout=_LOCK_TIMEOUT_S):
        raise RuntimeError(
            f"device routing: another thread held the install lock for {_LOCK_TIMEOUT_S:.0f} s; "
            "call install()/uninstall() from one thread"
        )


def install(get_device: Callable[[], str]) -> None:
    """Patch `torch.Tensor.cuda` and `torch.nn.Module.cuda` so a bare `.cuda()` goes to
    `get_device()` (e.g. "cuda:1"). Installing again only replaces `get_device`."""
    if not callable(get_device):
        raise TypeError(f"install() needs a function returning a device string such as 'cuda:0', not {get_device!r}")
    import torch

    global _get_device
    _acquire()
    try:
        _get_device = get_device
        if _saved:
            return
        for owner, wrap in ((torch.Tensor, _wrap_tensor_cuda), (torch.nn.Module, _wrap_module_cuda)):
            had_own = "cuda" in owner.__dict__
            original = owner.__dict__["cuda"] if had_own else owner.cuda
            wrapper = wrap(owner.cuda)
            setattr(owner, "cuda", wrapper)  # noqa: B010 (mypy refuses `owner.cuda = ...`: assigning to a method)
            _saved.append(_Saved(owner=owner, name="cuda", had_own=had_own, original=original, wrapper=wrapper))
        _log.debug("routing bare .cuda() calls to the managed device")
    finally:
        _lock.release()


def uninstall() -> None:
    """Restore torch's own `.cuda` methods exactly as they were. Harmless when not installed."""
    global _get_device
    _acquire()
    try:
        _get_device = None
        while _saved:
            saved = _saved.pop()
            current = saved.owner.__dict__.get(saved.name)
            if current is not saved.wrapper:
                # Someone patched on top of ours; removing theirs would break them. Our wrapper,
                # still underneath, passes calls through unchanged now that _get_device is None.
                _log.warning(
                    "%s.%s was replaced after flexium patched it; leaving that replacement in place",
                    saved.owner.__qualname__,
                    saved.name,
                )
                continue
            if saved.had_own:
                setattr(saved.owner, saved.name, saved.original)
            else:
                delattr(saved.owner, saved.name)
    finally:
        _lock.release()


def is_installed() -> bool:
    return bool(_saved)
