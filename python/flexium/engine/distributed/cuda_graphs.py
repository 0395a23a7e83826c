"""CUDA graphs that may hold NCCL calls: a job with one alive cannot be paused or moved.

A collective captured into a CUDA graph is replayed with the buffers and channels NCCL had when
it was captured. A suspend gives those back (ncclCommSuspend frees them), and after the resume
NCCL has new ones, so the next replay would run on memory that is gone: the job would crash or
hang. flexium cannot see which kernels a graph holds, so it counts every graph captured while
the job's NCCL process group existed (a graph captured before has no communicator to call), as
long as the graph is alive, and refuses whole-job operations meanwhile (job_operation.py).

The count comes from a wrapper around `torch.cuda.CUDAGraph.capture_begin`, which
`torch.cuda.graph`, `make_graphed_callables` and torch.compile's CUDA graphs all go through.
"""

from __future__ import annotations

import functools
import sys
import threading
import weakref
from collections.abc import Callable
from typing import Any

_MARK = "__wrapped_by_flexium__"

_lock = threading.Lock()
_alive: weakref.WeakSet[Any] = weakref.WeakSet()
_unreferenced = 0  # graphs that cannot be referenced weakly: counted as alive for good


def install(graph_class: Any = None, nccl_live: Callable[[], bool] | None = None) -> None:
    """Wraps `graph_class.capture_begin` (torch.cuda.CUDAGraph unless given) once. `nccl_live`
    (default: an NCCL process group exists) decides whether a capture may hold NCCL calls."""
    cls: Any = graph_class if graph_class is not None else _torch_graph_class()
    if cls is None or hasattr(cls.capture_begin, _MARK):
        return
    cls.capture_begin = _counting(cls.capture_begin, nccl_live or nccl_group_exists)


def uninstall(graph_class: Any = None) -> None:
    cls: Any = graph_class if graph_class is not None else _torch_graph_class()
    original = getattr(cls.capture_begin, _MARK, None) if cls is not None else None
    if cls is not None and original is not None:
        cls.capture_begin = original


def problem() -> str | None:
    """Why the job cannot be paused or moved for its CUDA graphs, with what to do; None: it can."""
    with _lock:
        alive = len(_alive) + _unreferenced
    if alive == 0:
        return None
    graphs = "a CUDA graph" if alive == 1 else f"{alive} CUDA graphs"
    return (
        f"this rank holds {graphs} captured while its NCCL process group existed: a graph holding NCCL calls "
        "would replay into NCCL buffers that a pause gives back, so the job cannot be paused or moved while "
        "one is alive; capture graphs without collectives (torch.compile: a mode other than 'reduce-overhead' "
        "for the distributed model), or let the graphs go (del, and torch._dynamo.reset() for torch.compile's)"
    )


def nccl_group_exists() -> bool:
    torch = sys.modules.get("torch")
    dist = getattr(torch, "distributed", None) if torch is not None else None
    if dist is None or not dist.is_available() or not dist.is_initialized():
        return False
    try:
        return "nccl" in str(dist.get_backend())
    except (RuntimeError, ValueError):
        return False


def _counting(capture_begin: Callable[..., Any], nccl_live: Callable[[], bool]) -> Callable[..., Any]:
    @functools.wraps(capture_begin)
    def counted(self: Any, *args: Any, **kwargs: Any) -> Any:
        result = capture_begin(self, *args, **kwargs)
        if nccl_live():
            _remember(self)
        return result

    setattr(counted, _MARK, capture_begin)
    return counted


def _remember(graph: Any) -> None:
    global _unreferenced
    with _lock:
        try:
            _alive.add(graph)
        except TypeError:
            _unreferenced += 1


def _torch_graph_class() -> Any:
    torch = sys.modules.get("torch")
    cuda = getattr(torch, "cuda", None) if torch is not None else None
    cls = getattr(cuda, "CUDAGraph", None) if cuda is not None else None
    return cls if isinstance(cls, type) else None
