"""bench/migrate.py's time to a free GPU from its NVML readings: a pause frees every GPU, a
migration the GPU it left (the job parked on another), and the "Time to a free GPU" lines take
the median of each way per size. The readings here are made up; the GPU run measures them."""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "bench"))

import migrate  # noqa: E402

GIB = 1 << 30
A, B = "GPU-a", "GPU-b"

# A job on A, moved to B at t=10: A empties at 10.8 while B fills; the copier on A until 11.0.
MOVE = [
    (9.9, {A: 16 * GIB, B: 0}),
    (10.2, {A: 16 * GIB, B: 8 * GIB}),
    (10.8, {A: 518 << 20, B: 16 * GIB}),
    (11.0, {A: 0, B: 16 * GIB}),
]


def migration(t0: float) -> tuple[dict[str, Any], dict[str, Any]]:
    return {"op": "migrate", "t0": t0}, {"source": {"uuid": A}}


def test_a_migration_frees_the_gpu_it_left_while_the_job_holds_memory_on_another() -> None:
    op, result = migration(10.0)
    assert migrate.freed(op, result, MOVE) == 1.0
    assert migrate.time_to_free(MOVE, 10.0) is None  # on every GPU it never is


def test_a_pause_frees_every_gpu() -> None:
    paused = [(4.9, {A: 16 * GIB, B: 0}), (5.4, {A: 2 * GIB, B: 0}), (5.9, {A: 0, B: 0})]
    assert migrate.freed({"op": "pause", "t0": 5.0}, {}, paused) == 5.9 - 5.0


def test_no_reading_of_held_memory_after_the_request_is_no_measurement() -> None:
    op, result = migration(11.0)  # the GPU was already empty when asked
    assert migrate.freed(op, result, MOVE) is None
    assert migrate.freed({"op": "resume", "t0": 10.0}, {}, MOVE) is None


def test_the_free_lines_give_each_way_its_median() -> None:
    def row(op: str, free: float, staging: Any = None, path: str = "fast") -> dict[str, Any]:
        return {"size_gb": 16.0, "op": op, "path": path, "free": free, "staging": staging}

    rows = [
        row("pause", 0.95, "kept"),
        row("pause", 0.97, "kept"),
        row("pause", 3.5, "made"),
        row("migrate", 0.8),
        row("migrate", 9.0, path="driver"),  # the driver path is not a way to free a GPU fast
        row("resume", 0.5),
    ]
    by_way = {c["freeing"]: c for c in migrate.free_goals(rows) if c["size_gb"] == 16.0}
    assert by_way["kept"]["median"] == 0.96 and by_way["kept"]["met"] is True
    assert by_way["made"]["runs"] == [3.5] and by_way["made"]["met"] is False
    assert by_way["parked"]["runs"] == [0.8] and by_way["parked"]["met"] is True


def test_a_pause_says_whether_it_found_its_staging_kept_or_made_it() -> None:
    """A staging made at the safe point, or mostly mapped before it, is "made"; one found kept
    (grown a little, or nothing said of it) is "kept". The notes are the engine's (fast_pause.py)."""
    at_safe_point = (
        "made the host staging by the copier process 7 at the safe point in 0.31 s (68.00 GiB of it newly mapped "
        "and touched, 0.00 GiB newly pinned; files 0.01 s, attach 0.30 s), then pinned 68.00 GiB in 6.10 s as the "
        "copies reached it (of which 5.20 s waiting for the touching), copies 6.40 s"
    )
    before = "pinned 17.00 GiB of host staging by the copier process 7 in 0.02 s before the safe point ({} GiB of it "
    assert migrate.staging_of({"notes": [at_safe_point, "fast path: copied 64.00 GiB"]}) == "made"
    assert migrate.staging_of({"notes": [before.format("17.00") + "newly mapped and touched"]}) == "made"
    assert migrate.staging_of({"notes": [before.format("0.25") + "newly mapped and touched"]}) == "kept"
    assert migrate.staging_of({"notes": ["fast path: copied 16.00 GiB"]}) == "kept"
