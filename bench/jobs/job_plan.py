"""The plan grammar of the benchmark's and the GPU tests' jobs (train_job.py, rank_job.py): which
operations a job runs on itself, and when, as the server's commands would have it run them.

    [+]STEP:OP[:ARG][@PATH]

STEP   the operation starts once the job has finished its step STEP (counted from 0); "+STEPS":
       STEPS steps after the operation before it returned (after a pause: after the last step it
       finished before pausing)
OP     pause, resume, migrate: the engine's operations, run by a control thread as the server's
       connection runs them (in a rank job: a whole-job operation, each rank its share);
       train_job.py's own: handmove (on the training thread at the start of step STEP: model,
       AdamW state and ballast .to(ARG), the move a user writes by hand), occupy, arm and vacate
       (another process takes GPU memory, tests/gpu's refusals), kept (waits until the job's keeper
       keeps its pause's staging pinned, at most ARG seconds, default 120: a pause after it finds
       what a job that has trained a while finds, made by the keeper, not at the pause)
ARG    train_job.py: a GPU, "cuda:N" in the job's own numbering at init (as a person tells the
       server) or a UUID, for migrate, resume (none: in place), handmove and arm; for occupy the
       GiB the other process leaves free on the job's GPU ("+G": what the last pause took off it
       plus G). rank_job.py: RANK=GPU,... (NVML's GPU indexes), where each rank goes (migrate) or
       resumes (resume)
@PATH  auto | fast | driver: the path of that migrate or pause (train_job.py; default: --path)

e.g. 10:migrate:cuda:1@fast, 20:pause, 20:resume:cuda:0, +0:resume, 10:handmove:cuda:1,
8:occupy:+0.2, 10:arm:cuda:1, 8:vacate, 30:kept; rank_job.py: 10:pause, 25:migrate:0=1,1=0.
"""

from __future__ import annotations

import threading
from dataclasses import dataclass

PATHS = ("auto", "fast", "driver")
ENGINE_OPS = ("pause", "resume", "migrate")
TRAIN_OPS = (*ENGINE_OPS, "handmove", "occupy", "arm", "vacate", "kept")
NEEDS_ARG = ("migrate", "handmove", "occupy", "arm")
TAKES_PATH = ("migrate", "pause")


@dataclass(frozen=True)
class PlanItem:
    step: int
    op: str
    arg: str | None = None
    path: str | None = None  # None: the job's --path
    relative: bool = False  # step counts from the end of the operation before

    def __str__(self) -> str:
        arg = "" if self.arg is None else f":{self.arg}"
        path = "" if self.path is None else f"@{self.path}"
        return f"{'+' if self.relative else ''}{self.step}:{self.op}{arg}{path}"


def parse_item(text: str, ops: tuple[str, ...] = TRAIN_OPS) -> PlanItem:
    """One plan item; ValueError saying what is wrong with it."""
    body, at, path = text.partition("@")
    parts = body.split(":", 2)
    step = parts[0].removeprefix("+")
    if len(parts) < 2 or not step.isdigit():
        raise ValueError(f"plan item {text!r}: [+]STEP:OP[:ARG][@PATH]")
    op, arg = parts[1], parts[2] if len(parts) > 2 else None
    if op not in ops:
        raise ValueError(f"plan item {text!r}: OP is one of {', '.join(ops)}")
    if op in NEEDS_ARG and not arg:
        raise ValueError(f"plan item {text!r}: {op} needs its ARG")
    if at and (path not in PATHS or op not in TAKES_PATH):
        raise ValueError(f"plan item {text!r}: @PATH is one of {', '.join(PATHS)}, for {' and '.join(TAKES_PATH)}")
    relative = parts[0].startswith("+")
    if relative and op == "handmove":
        raise ValueError(f"plan item {text!r}: a handmove needs its own step: STEP:handmove:cuda:N")
    return PlanItem(int(step), op, arg, path if at else None, relative)


def parse_plan(items: list[str], ops: tuple[str, ...] = TRAIN_OPS) -> list[PlanItem]:
    return [parse_item(text, ops) for text in items]


def parse_rank_plan(items: list[str]) -> list[PlanItem]:
    """A rank job's plan: the engine's operations, ARG a RANK=GPU map, no @PATH (a whole-job
    operation chooses its path itself)."""
    plan = parse_plan(items, ENGINE_OPS)
    for item in plan:
        if item.path is not None:
            raise ValueError(f"plan item {str(item)!r}: a rank job's operations take no @PATH")
        if item.arg is not None:
            rank_map(item)
    return plan


def rank_map(item: PlanItem) -> dict[int, int]:
    """ARG of a rank job's item: rank -> NVML GPU index ({} without ARG)."""
    if item.arg is None:
        return {}
    pairs = [pair.split("=") for pair in item.arg.split(",")]
    if not all(len(pair) == 2 and pair[0].isdigit() and pair[1].isdigit() for pair in pairs):
        raise ValueError(f"plan item {str(item)!r}: ARG is RANK=GPU,... (GPU: NVML's index)")
    return {int(rank): int(gpu) for rank, gpu in pairs}


class Progress:
    """The last step the training loop finished (-1 before the first), for the control thread."""

    def __init__(self) -> None:
        self._cond = threading.Condition()
        self.step = -1

    def advance(self, step: int) -> None:
        with self._cond:
            self.step = step
            self._cond.notify_all()

    def wait_for(self, step: int) -> None:
        with self._cond:
            self._cond.wait_for(lambda: self.step >= step)

    def wait_for_item(self, item: PlanItem, not_before: int = -1) -> int:
        """Waits until ``item`` may start, and not before step ``not_before`` has finished; the
        step it waited for (a relative item's counted from now)."""
        at_step = self.step + item.step if item.relative else item.step
        self.wait_for(max(at_step, not_before))
        return at_step
