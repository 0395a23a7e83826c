"""What real training jobs use, each deterministic, for train_job.py's feature flags: a DataLoader
with worker processes and pinned memory (--dataloader), a second CUDA stream feeding the forward
(--side-stream) and a CUDA graph captured before training (--cuda-graph). --amp and
--checkpointing are train_job.py's own lines."""

from __future__ import annotations

import os
import time
from typing import Any

import torch
import torch.utils.data

# The DataLoader's dataset: this many batches, read cyclically.
DATASET_BATCHES = 8
# The CUDA graph's static computation: GRAPH_ROWS x min(GRAPH_WIDTH, --width).
GRAPH_ROWS = 64
GRAPH_WIDTH = 256


# ---- the DataLoader's side: runs in worker processes, which must never touch CUDA -------------


class IndexedRows(torch.utils.data.Dataset):
    """Row i is a fixed function of i (its own seeded CPU generator): any worker, any order,
    the same batch."""

    def __init__(self, length: int, width: int, batch: int, batch_delay: float = 0.0) -> None:
        self.length = length
        self.width = width
        self.batch = batch
        self.batch_delay = batch_delay

    def __len__(self) -> int:
        return self.length

    def __getitem__(self, index: int) -> torch.Tensor:
        if self.batch_delay and index % self.batch == 0:
            time.sleep(self.batch_delay)  # a slow input pipeline: batches still arrive while paused
        generator = torch.Generator()
        generator.manual_seed(10_000 + index)
        return torch.randn(self.width, generator=generator)


def _worker_init(_worker_id: int) -> None:
    # Spawned fresh, with CUDA not initialized: hiding every GPU keeps the worker off CUDA for good.
    os.environ["CUDA_VISIBLE_DEVICES"] = ""
    torch.set_num_threads(1)


class Batches:
    """Batches from a DataLoader (2 spawned workers, pinned memory), cyclically, copied to the
    device with non_blocking=True."""

    def __init__(self, width: int, batch: int, device: str, batch_delay: float = 0.0) -> None:
        self.device = device
        self.loader = torch.utils.data.DataLoader(
            IndexedRows(DATASET_BATCHES * batch, width, batch, batch_delay),
            batch_size=batch,
            shuffle=False,
            drop_last=True,
            num_workers=2,
            pin_memory=True,
            persistent_workers=True,
            multiprocessing_context="spawn",
            worker_init_fn=_worker_init,
            prefetch_factor=2,
        )
        self._iterator: Any = iter(self.loader)

    def next(self) -> torch.Tensor:
        try:
            batch = next(self._iterator)
        except StopIteration:
            self._iterator = iter(self.loader)
            batch = next(self._iterator)
        return batch.to(self.device, non_blocking=True)

    def close(self) -> None:
        shutdown = getattr(self._iterator, "_shutdown_workers", None)
        if shutdown is not None:
            shutdown()
        self._iterator = None


# ---- the other features --------------------------------------------------------------------


class SideStream:
    """f = tanh(x @ proj) on a second stream from x made on the main stream; the main stream
    waits for it and the forward uses x + 0.1 f, so a lost or early f changes the loss."""

    def __init__(self, width: int, device: str) -> None:
        generator = torch.Generator(device=device)
        generator.manual_seed(2)
        self.proj = torch.randn(width, width, device=device, generator=generator) / width**0.5
        self.stream = torch.cuda.Stream(device=device)

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        main = torch.cuda.current_stream()
        self.stream.wait_stream(main)
        with torch.cuda.stream(self.stream):
            f = torch.tanh(x @ self.proj)
        x.record_stream(self.stream)  # x was made on main and is read on the side stream
        main.wait_stream(self.stream)
        f.record_stream(main)  # f was made on the side stream and is read on main
        return x + 0.1 * f


class Graph:
    """A CUDA graph of a small fixed module, captured before training (warm-up on a side stream
    first, as PyTorch's docs require) and replayed each step on step-dependent input."""

    def __init__(self, width: int, device: str) -> None:
        cols = min(GRAPH_WIDTH, width)
        self.cols = cols
        self.module = torch.nn.Sequential(torch.nn.Linear(cols, cols), torch.nn.Tanh(), torch.nn.Linear(cols, 1)).to(
            device
        )
        self.static_in = torch.zeros(GRAPH_ROWS, cols, device=device)
        warmup = torch.cuda.Stream(device=device)
        warmup.wait_stream(torch.cuda.current_stream())
        with torch.no_grad(), torch.cuda.stream(warmup):
            for _ in range(3):
                self.module(self.static_in)
        torch.cuda.current_stream().wait_stream(warmup)
        torch.cuda.synchronize()
        self.graph = torch.cuda.CUDAGraph()
        with torch.no_grad(), torch.cuda.graph(self.graph):
            self.static_out = self.module(self.static_in)
        torch.cuda.synchronize()

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        self.static_in.copy_(x[:GRAPH_ROWS, : self.cols])
        self.graph.replay()
        return self.static_out.sum()
