"""What one CUDA call made by another thread does while the process is paused (checkpointed):
the measurement behind docs/facts.md fact 22.

    python bench/paused_calls_probe.py [--kinds pin_new,launch,...]

Each kind runs in a fresh process (some kill it): flexium.init(), a little GPU work, one pinned
block used for a non_blocking copy and freed (so torch's host allocator caches it), a pause on
the path flexium picks, then a second thread makes the call while the main thread waits 5 s;
then a resume. One table row per kind: what the call did while paused and after the resume, and
whether the process lived. Needs a GPU.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any, Callable

sys.path.insert(0, str(Path(__file__).resolve().parent))  # tables.py beside this file

from tables import print_table  # noqa: E402

WAIT_WHILE_PAUSED_S = 5.0


def _calls() -> dict[str, Callable[[], Any]]:
    import torch

    return {
        "pin_new": lambda: torch.empty(64 << 20, dtype=torch.uint8, pin_memory=True).numel(),
        "pin_cached": lambda: torch.empty(1 << 20, pin_memory=True).numel(),
        "tensor_pin_memory": lambda: torch.zeros(3, 64, 64).pin_memory().numel(),
        "event_query": lambda: torch.cuda.Event().query(),
        "launch": lambda: torch.ones(1, device="cuda").sum().item(),
        "mem_get_info": lambda: torch.cuda.mem_get_info(),
        "current_stream": lambda: str(torch.cuda.current_stream()),
    }


KINDS = ("pin_new", "pin_cached", "tensor_pin_memory", "event_query", "launch", "mem_get_info", "current_stream")


def one_kind(kind: str) -> None:
    """In the child: pause, make the call from another thread, resume; prints one JSON line."""
    import torch

    import flexium
    from flexium.api import runtime

    flexium.init()
    current = runtime.current()
    engine = None if current is None else current.engine
    assert engine is not None, "flexium did not start its engine (no GPU?)"
    x = torch.randn(1 << 20, device="cuda")
    cached = torch.empty(1 << 20, pin_memory=True)
    x.copy_(cached, non_blocking=True)
    del cached
    torch.cuda.synchronize()
    call = _calls()[kind]
    seen: dict[str, Any] = {"kind": kind, "pause_path": engine.pause().path}
    print(json.dumps(seen), flush=True)  # what is known if the call kills the process
    outcome: dict[str, Any] = {}

    def make_call() -> None:
        started = time.monotonic()
        try:
            outcome["value"] = repr(call())[:60]
        except Exception as exc:  # the outcome being measured
            outcome["error"] = f"{type(exc).__name__}: {str(exc).splitlines()[0][:80]}"
        outcome["ms"] = round((time.monotonic() - started) * 1e3, 1)

    thread = threading.Thread(target=make_call, daemon=True)
    thread.start()
    thread.join(WAIT_WHILE_PAUSED_S)
    seen["while_paused"] = dict(outcome) if outcome else "blocked"
    engine.resume()
    thread.join(30)
    seen["after_resume"] = dict(outcome) if outcome else "still blocked"
    seen["job_computes"] = float((x * 0 + 1).sum().item()) == x.numel()
    print(json.dumps(seen), flush=True)
    flexium.shutdown()


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--kinds", default=",".join(KINDS))
    parser.add_argument("--child", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        one_kind(args.child)
        return 0
    rows = []
    for kind in args.kinds.split(","):
        done = subprocess.run([sys.executable, __file__, "--child", kind], capture_output=True, text=True, timeout=120)
        lines = [line for line in done.stdout.splitlines() if line.startswith("{")]
        seen = json.loads(lines[-1]) if lines else {}
        died = f"died: exit {done.returncode}" if done.returncode else "lived"
        rows.append(
            [
                kind,
                seen.get("pause_path", "?"),
                json.dumps(seen.get("while_paused", "(the process died)")),
                json.dumps(seen.get("after_resume", "-")),
                died,
            ]
        )
    print_table(["call from another thread", "pause path", "while paused", "after the resume", "process"], rows)
    return 0


if __name__ == "__main__":
    sys.exit(main())
