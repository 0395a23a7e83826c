"""train_job.py's training state: an MLP with AdamW beside a ballast of random data, seeded, and the
move a user writes by hand (--plan STEP:handmove:cuda:N)."""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

GIB = 1 << 30
PLAIN_WIDTH = 2048  # with --ballast-gb


def model_width(gb: float) -> int:
    """An MLP width whose state (params, grads, two AdamW moments: 16 bytes a parameter, 8 w^2
    parameters) is a quarter of the job's GiB, at most 1 GiB."""
    target = min(0.25 * gb, 1.0) * GIB
    width = int(math.sqrt(target / 128) / 128 + 0.5) * 128
    return max(256, width)


@dataclass
class Training:
    model: torch.nn.Sequential
    optimizer: torch.optim.Optimizer
    ballast: list[torch.Tensor]
    generator: torch.Generator  # the ballast's, then the batches'
    width: int
    device: str

    @property
    def ballast_bytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in self.ballast)

    def checksum(self) -> float:
        return float(sum(t[::4097].double().sum().item() for t in self.ballast))

    def held_bytes(self) -> tuple[int, int]:
        """PyTorch's reserved and allocated bytes on the device (off CUDA: what the tensors hold)."""
        if torch.device(self.device).type == "cuda":
            return int(torch.cuda.memory_reserved(self.device)), int(torch.cuda.memory_allocated(self.device))
        held = 4 * sum(p.numel() * p.element_size() for p in self.model.parameters()) + self.ballast_bytes
        return held, held


def build(
    device: str, *, gb: float | None, ballast_gb: float, width: int | None, chunk_mb: float, seed: int
) -> Training:
    """The state of a job of ``gb`` GiB in all (the ballast makes up what the model does not), or
    of a ``ballast_gb`` GiB ballast beside the model; the ballast in tensors of ``chunk_mb`` MiB
    (0: one tensor)."""
    torch.manual_seed(seed)
    width = width or (model_width(gb) if gb is not None else PLAIN_WIDTH)
    model = torch.nn.Sequential(
        torch.nn.Linear(width, 4 * width), torch.nn.GELU(), torch.nn.Linear(4 * width, width)
    ).to(device)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    model_state = 4 * sum(p.numel() * p.element_size() for p in model.parameters())
    ballast_bytes = max(0, int(gb * GIB) - model_state) if gb is not None else int(ballast_gb * GIB)
    chunk = int(chunk_mb * (1 << 20)) or ballast_bytes
    generator = torch.Generator(device=device)
    generator.manual_seed(seed + 1)
    ballast = []
    left = ballast_bytes
    while left >= 4:
        size = min(chunk, left)
        tensor = torch.empty(size // 4, dtype=torch.float32, device=device)
        tensor.normal_(generator=generator)
        ballast.append(tensor)
        left -= size
    return Training(model, optimizer, ballast, generator, width, device)


def hand_move(training: Training, target: str) -> int:
    """What a user writes to move a training job by hand: model, AdamW state and ballast
    .to(target), synchronize, the old tensors dropped, empty_cache(). The bytes it moved."""
    model, optimizer = training.model, training.optimizer
    moved = sum(p.numel() * p.element_size() for p in model.parameters())
    moved += sum(p.grad.numel() * p.grad.element_size() for p in model.parameters() if p.grad is not None)
    model.to(target)  # parameters and their gradients, in place (same Parameter objects)
    for state in optimizer.state.values():
        for key, value in list(state.items()):
            if torch.is_tensor(value) and value.is_cuda:
                state[key] = value.to(target)
                moved += value.numel() * value.element_size()
    ballast = [t.to(target) for t in training.ballast]
    moved += sum(t.numel() * t.element_size() for t in ballast)
    if torch.cuda.is_available():
        for device in range(torch.cuda.device_count()):  # the copies run on the source's stream
            torch.cuda.synchronize(device)
    training.ballast = ballast  # the old tensors go
    # The batches go on where they were: a generator's state is its seed and offset, on any GPU.
    generator = torch.Generator(device=target)
    generator.set_state(training.generator.get_state())
    training.generator = generator
    training.device = target
    if torch.device(target).type == "cuda":
        torch.cuda.empty_cache()
        torch.cuda.set_device(torch.device(target))
    return moved
