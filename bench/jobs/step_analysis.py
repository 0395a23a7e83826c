"""Each operation's downtime on the training loop's own clock (train_job.py's "done" event; what
bench/migrate.py's rows are made of), from the step start and end times and the operations' records."""

from __future__ import annotations

import statistics
from typing import Any

AFTER_STEPS = 20  # steps after a move whose extra time counts as the move's (after_extra)


def _step_of(record: dict[str, Any], starts: list[float], ends: list[float]) -> int | None:
    """The step an engine operation ran in: the one whose [start, end] holds the middle of its
    execution. The op's own clock (result seconds) dates its execution; t1 (when the control
    thread woke) can come after the training thread has already ended that step."""
    if record.get("ran_in_step") is not None:
        return int(record["ran_in_step"])
    result = record.get("result") or {}
    seconds = result.get("seconds")
    if not seconds or seconds <= 0 or seconds > record["t1"] - record["t0"] + 1e-3:
        seconds = record["t1"] - record["t0"]
    middle = record["t1"] - seconds / 2
    for k in range(len(ends)):
        if starts[k] <= middle <= ends[k]:
            return k
    return None


def _work_started(record: dict[str, Any]) -> float | None:
    """When the operation's work began (at the safe point, or on the caller's thread after the
    bounded wait): t1 minus the op's own seconds, which the engine counts from there."""
    seconds = (record.get("result") or {}).get("seconds")
    if not seconds or seconds <= 0 or seconds > record["t1"] - record["t0"] + 1e-3:
        return None
    return max(record["t0"], record["t1"] - seconds)


def preparation(record: dict[str, Any], ends: list[float]) -> dict[str, Any]:
    """A pause prepares before its safe point (the fast path touches and pins its host staging
    between the request and the safe point) while training goes on: the seconds from the request
    (t0) to the start of its work, and the steps that ended in between (a step's length:
    end(j) - end(j-1), as for the median normal step)."""
    started = _work_started(record)
    if started is None:
        return {"prep": None, "prep_steps": None, "prep_max_step": None, "prep_median_step": None}
    lengths = [ends[j] - ends[j - 1] for j in range(1, len(ends)) if record["t0"] < ends[j] <= started]
    return {
        "prep": started - record["t0"],
        "prep_steps": len(lengths),
        "prep_max_step": max(lengths) if lengths else None,
        "prep_median_step": statistics.median(lengths) if lengths else None,
    }


def after_extra(k: int, ends: list[float], median: float, until: float, steps: int = AFTER_STEPS) -> float:
    """What the steps after a move (up to `steps`, all ending before `until`: the next operation)
    took beyond a normal step, summed: a fast move's copies become the job's own at those steps,
    its cost outside the downtime."""
    return sum(
        max(0.0, ends[j] - ends[j - 1] - median) for j in range(k + 1, min(len(ends), k + 1 + steps)) if ends[j] < until
    )


def analyse(records: list[dict[str, Any]], starts: list[float], ends: list[float], warmup: int) -> dict[str, Any]:
    """Downtime of each operation on the training loop's own clock. Each figure holds exactly one
    normal step of compute, so `extra` (downtime minus the median normal step) is what the move
    cost the job:

      migrate, handmove  end(k) - end(k-1), k the step it ran in (inside its optimizer.step, or
                         at its start for handmove)
      pause              t1 - end(k-1): from the last finished step until the job is paused
      resume             end(k+1) - t0: from the resume call until the job has finished one
                         whole step after it (k, in which it had paused, and k+1)
    Where an operation ran outside any step (no safe point came): first step end after t1 minus
    the last step end before t0. A pause also gets preparation(): prep (request -> start of its
    work), prep_steps and the longest and median step that ended meanwhile (prep_max_step,
    prep_median_step).
    """
    busy: set[int] = set()
    placed = []
    for record in records:
        k = _step_of(record, starts, ends) if record.get("ok") else None
        placed.append(k)
        if k is not None:
            busy.update((k, k + 1, k + 2))
    durations = [(j, ends[j] - ends[j - 1]) for j in range(max(1, warmup + 1), len(ends))]
    normal = [d for j, d in durations if j not in busy] or [d for _, d in durations]
    median = statistics.median(normal) if normal else 0.0

    analysed = []
    for record, k in zip(records, placed, strict=True):
        entry: dict[str, Any] = {
            "op": record["op"],
            "t0": record["t0"],
            "ok": record.get("ok", False),
            "ran_in_step": k,
            "downtime": None,
            "extra": None,
            "next_step_extra": None,
            "method": None,
        }
        if not entry["ok"]:
            analysed.append(entry)
            continue
        op = record["op"]
        if op == "pause":
            entry.update(preparation(record, ends))
        downtime: float | None = None
        if k is not None and k >= 1:
            if op in ("migrate", "handmove") and k < len(ends):
                downtime, entry["method"] = ends[k] - ends[k - 1], "end(k) - end(k-1)"
            elif op == "pause":
                downtime, entry["method"] = record["t1"] - ends[k - 1], "t1 - end(k-1)"
            elif op == "resume" and k + 1 < len(ends):
                downtime, entry["method"] = ends[k + 1] - record["t0"], "end(k+1) - t0"
            if op == "migrate":
                later = [r["t0"] for r in records if r["t0"] > record["t1"]]
                entry["after_extra"] = after_extra(k, ends, median, min(later, default=float("inf")))
            if k + 1 < len(ends) and op != "pause":
                entry["next_step_extra"] = (
                    ends[k + 1] - ends[k] - median
                    if op != "resume"
                    else (ends[k + 2] - ends[k + 1] - median if k + 2 < len(ends) else None)
                )
        if downtime is None:
            before = [e for e in ends if e < record["t0"]]
            after = [e for e in ends if e > record["t1"]]
            if before and after:
                downtime, entry["method"] = after[0] - before[-1], "first end after t1 - last end before t0"
        if downtime is not None:
            entry["downtime"] = downtime
            entry["extra"] = downtime - median
        analysed.append(entry)
    return {"median_step": median, "normal_steps": len(normal), "ops": analysed}
