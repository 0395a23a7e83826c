"""Training progress the client sends with its heartbeats: the optimizer steps taken (counted
by PyTorch's global optimizer step hook, as the engine's safe points are) and the last loss
the job hands to ``flexium.auto.report``.

Recording is an attribute write on the training thread; the heartbeat thread reads the values
when it builds its next body. Training never waits for the server, and nothing here touches
CUDA (reading a tensor's value is the job's call: ``loss.item()`` synchronizes its GPU).
"""

from __future__ import annotations

import math
import sys
import threading
from typing import Any


class TrainingProgress:
    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._handle: Any | None = None  # torch's RemovableHandle
        self._users = 0
        self.counted_steps = 0
        self._stated_step: int | None = None
        self.loss: float | None = None

    def install(self) -> bool:
        """Count optimizer steps from now (until as many ``uninstall`` calls). Never imports
        torch itself (seconds, on the thread that calls flexium.init()): before the job imports
        it, counting starts at the first ``hook_if_ready`` after (each heartbeat calls it)."""
        with self._lock:
            self._users += 1
        return self.hook_if_ready()

    def hook_if_ready(self) -> bool:
        with self._lock:
            if self._handle is not None:
                return True
            if self._users == 0 or "torch.optim" not in sys.modules:
                return False
            try:
                from torch.optim.optimizer import register_optimizer_step_post_hook
            except ImportError:
                return False
            self._handle = register_optimizer_step_post_hook(self._on_step)
            return True

    def uninstall(self) -> None:
        with self._lock:
            self._users = max(0, self._users - 1)
            if self._users == 0 and self._handle is not None:
                self._handle.remove()
                self._handle = None

    def _on_step(self, *_: Any) -> None:
        self.counted_steps += 1  # one int under the GIL: no lock on the training thread's path

    def record(self, *, loss: float | None = None, step: int | None = None) -> None:
        """A loss that is not a finite number is not sent (the wire carries finite numbers only)."""
        if loss is not None:
            value = float(loss)
            self.loss = value if math.isfinite(value) else None
        if step is not None:
            if isinstance(step, bool) or int(step) < 0:
                raise ValueError(f"step must be a count of steps (an int >= 0), not {step!r}")
            self._stated_step = int(step)

    @property
    def steps(self) -> int | None:
        """The step the job last stated, else the optimizer steps counted; None when neither
        (no torch.optim steps, no ``report(step=...)``)."""
        if self._stated_step is not None:
            return self._stated_step
        if self._handle is None and self.counted_steps == 0:
            return None
        return self.counted_steps

    def reset(self) -> None:
        """Forget what was recorded (a new flexium session in the same process)."""
        self.counted_steps = 0
        self._stated_step = None
        self.loss = None


PROGRESS = TrainingProgress()
