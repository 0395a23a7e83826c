"""Migrate, pause and resume times of a real training job per size of its GPU state.

    python bench/migrate.py --sizes 2,16,64 [--json results.json]

Each size runs one fresh job (tests/gpu/train_job.py) holding that many GB beside a small
model: migrate cuda:0 -> cuda:1, pause, resume in place. Prints one table; every figure is
measured in this run.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

JOB = Path(__file__).resolve().parent.parent / "tests" / "gpu" / "train_job.py"
COLUMNS = ("size GB", "op", "path", "total s", "prepare s", "lock s", "checkpoint s", "restore s", "unlock s", "moved GB", "GB/s")


def run_size(size_gb: float) -> list[dict[str, Any]]:
    print(f"-- {size_gb:g} GB: starting a job, then migrate, pause, resume", file=sys.stderr, flush=True)
    proc = subprocess.run(
        [sys.executable, str(JOB), "--ballast-gb", str(size_gb), "--steps", "20", "--width", "1024",
         "--plan", "4:migrate:cuda:1", "--plan", "8:pause", "--plan", "8:resume", "--pause-seconds", "0.5"],
        capture_output=True, text=True, env={**os.environ, "PYTHONUNBUFFERED": "1"}, timeout=1200,
    )
    events = [json.loads(line) for line in proc.stdout.splitlines() if line.startswith("{")]
    ops = [e for e in events if e["event"] == "op"]
    if proc.returncode != 0 or not ops or not all(op["ok"] for op in ops):
        sys.stderr.write(proc.stderr[-4000:])
        raise SystemExit(f"the {size_gb:g} GB job failed: {[op.get('error') for op in ops if not op['ok']]}")
    return [{"size_gb": size_gb, "op": op["op"], "result": op["result"]} for op in ops]


def row(entry: dict[str, Any]) -> tuple[str, ...]:
    result = entry["result"]

    def step(name: str) -> str:
        seconds = sum(s["seconds"] for s in result["steps"] if s["step"] == name and not s["rollback"])
        return f"{seconds:.3f}" if any(s["step"] == name for s in result["steps"]) else "-"

    moved = result["bytes_moved"] / 1e9
    rate = moved / result["seconds"] if result["seconds"] else 0.0
    return (f"{entry['size_gb']:g}", entry["op"], result["path"], f"{result['seconds']:.3f}", step("prepare"),
            step("lock"), step("checkpoint"), step("restore"), step("unlock"), f"{moved:.2f}", f"{rate:.2f}")


def print_table(rows: list[tuple[str, ...]]) -> None:
    widths = [max(len(c), *(len(r[i]) for r in rows)) for i, c in enumerate(COLUMNS)]
    line = "  ".join(c.rjust(w) for c, w in zip(COLUMNS, widths))
    print(line)
    print("-" * len(line))
    for r in rows:
        print("  ".join(v.rjust(w) for v, w in zip(r, widths)))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--sizes", default="2,16,64")
    parser.add_argument("--json", type=Path)
    args = parser.parse_args()
    entries = [e for size in args.sizes.split(",") for e in run_size(float(size))]
    print_table([row(e) for e in entries])
    if args.json:
        args.json.write_text(json.dumps(entries, indent=1))


if __name__ == "__main__":
    main()
