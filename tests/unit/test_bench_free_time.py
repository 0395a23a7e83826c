"""bench/migrate.py's time to a free GPU from its NVML readings: a pause frees every GPU, a
migration the GPU it left (the job parked on another), and the "Time to a free GPU" lines take
the median of each way per size; per size and staging way, the time to a free GPU and the resume
beside their floors, from the run's measured bandwidth and fixed cost. The readings here are made
up; the GPU run measures them."""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any

import pytest

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
        "and touched, 0.00 GiB found pinned, 68.00 GiB streamed; files 0.01 s, attach 0.30 s), then pinned 68.00 GiB "
        "in 6.10 s as the copies reached it (of which 5.20 s waiting for the touching), copies 6.40 s"
    )
    half_kept = (
        "the staging kept for pauses was still being pinned ahead: 9.50 of 25.50 GiB pinned when the pause was "
        "asked for; the rest is pinned as the copies reach it, or written where not touched yet, at the safe point"
    )
    before = "pinned 17.00 GiB of host staging by the copier process 7 in 0.02 s before the safe point ({} GiB of it "
    assert migrate.staging_of({"notes": [at_safe_point, "fast path: copied 64.00 GiB"]}) == "made"
    written = at_safe_point.replace("newly mapped and touched", "newly mapped and written")
    assert migrate.staging_of({"notes": [written, "fast path: copied 64.00 GiB"]}) == "written"
    assert migrate.staging_of({"notes": [half_kept, at_safe_point, "fast path: copied 24.00 GiB"]}) == "part"
    assert migrate.staging_of({"notes": [before.format("17.00") + "newly mapped and touched"]}) == "made"
    assert migrate.staging_of({"notes": [before.format("0.25") + "newly mapped and touched"]}) == "kept"
    assert migrate.staging_of({"notes": ["fast path: copied 16.00 GiB"]}) == "kept"


# A run's measurements, made up: the floors must follow them, whatever they are.
BANDWIDTH = {"d2h_gbps": 40.0, "h2d_gbps": 25.0, "peer_gbps": None}
FIXED = {"checkpoint": 0.6, "restore": 0.45}


def pool_job(size_gb: float, ops: list[tuple[str, str, list[str], float | None]]) -> migrate.JobRun:
    """A pool job's events: (op, path, notes, seconds) each, pauses read free from NVML at t0 + 1.5."""
    run = migrate.JobRun("pool job", [])
    run.events.append({"event": "ready", "state_bytes": int(size_gb * GIB)})
    for k, (op, path, notes, seconds) in enumerate(ops):
        t0 = 10.0 * (k + 1)
        result = {"path": path, "notes": notes, "seconds": seconds, "steps": []}
        run.events.append({"event": "op", "op": op, "ok": True, "t0": t0, "requested_path": path, "result": result})
        if op == "pause":
            run.gpu_use += [(t0 + 0.1, {A: int(size_gb * GIB)}), (t0 + 1.5, {A: 0})]
    run.events.append({"event": "done", "ops": [], "median_step": 0.1})
    return run


MADE = "made the host staging by the copier process 7 at the safe point in 0.31 s (...)"
PART = "the staging kept for pauses was still being pinned ahead: 1.00 of 17.00 GiB pinned when ..."
BESIDE = "filled 16.00 GiB of new memory in 0.70 s (...), 0.45 s of it beside the restore"


def test_a_resume_row_takes_the_staging_of_the_pause_it_ends() -> None:
    run = pool_job(
        16.0,
        [
            ("pause", "fast", [PART, MADE], None),
            ("resume", "fast", [BESIDE], 0.85),
            ("pause", "fast", ["fast path: copied 16.00 GiB"], None),
            ("resume", "fast", [], 0.9),
            ("pause", "driver", [], None),
            ("resume", "driver", [], 2.9),
        ],
    )
    rows = migrate.rows_of(16.0, run)
    assert [(r["op"], r["staging"]) for r in rows] == [
        ("pause", "part"),
        ("resume", "part"),
        ("pause", "kept"),
        ("resume", "kept"),
        ("pause", None),
        ("resume", None),
    ]


def test_each_staging_way_gives_its_free_time_and_resume_beside_floors_from_the_runs_measurements() -> None:
    rows = migrate.rows_of(
        16.0,
        pool_job(
            16.0,
            [("pause", "fast", [MADE], None), ("resume", "fast", [BESIDE], 0.85)]
            + [("pause", "fast", [], None), ("resume", "fast", [], 0.95)],
        ),
    )
    migrate.add_ratios(rows, BANDWIDTH, FIXED)
    ways = {w["staging"]: w for w in migrate.staging_ways(rows)}
    assert set(ways) == {"made", "kept"}
    size = 16 * GIB
    pause_floor = size / (BANDWIDTH["d2h_gbps"] * 1e9) + FIXED["checkpoint"]
    for way in ways.values():
        assert way["free"] == 1.5 and way["free_floor"] == pause_floor
    # Copied back beside the restore: the larger of the copy and the restore; after it: their sum.
    assert ways["made"]["resume"] == 0.85
    assert ways["made"]["resume_floor"] == max(size / (BANDWIDTH["h2d_gbps"] * 1e9), FIXED["restore"])
    assert ways["kept"]["resume"] == 0.95
    assert ways["kept"]["resume_floor"] == size / (BANDWIDTH["h2d_gbps"] * 1e9) + FIXED["restore"]

    faster = dict(BANDWIDTH, d2h_gbps=80.0)  # another run's machine: other floors, nothing fixed in the code
    migrate.add_ratios(rows, faster, FIXED)
    assert migrate.staging_ways(rows)[0]["free_floor"] == size / 80e9 + FIXED["checkpoint"]


def test_the_jobs_of_another_budget_count_for_their_staging_not_for_the_downtime_goals() -> None:
    rows = migrate.rows_of(16.0, pool_job(16.0, [("pause", "fast", [], None), ("resume", "fast", [], 0.9)]))
    unkept = migrate.rows_of(16.0, pool_job(16.0, [("pause", "fast", [MADE], None), ("resume", "fast", [], 3.0)]))
    for row in rows + unkept:
        row["extra"] = 0.9 if row in rows else 5.0
    for row in unkept:
        row["budget"] = "0"
    pause_goal = next(g for g in migrate.goals(rows + unkept) if g["op"] == "pause" and g["size_gb"] == 16.0)
    assert pause_goal["runs"] == [0.9]
    migrate.add_ratios(rows + unkept, BANDWIDTH, FIXED)
    ways = {w["staging"]: w for w in migrate.staging_ways(rows + unkept)}
    assert ways["made"]["resume_runs"] == [3.0] and ways["kept"]["resume_runs"] == [0.9]


def test_the_rows_of_the_job_whose_keeper_made_its_staging_first_are_their_own_way() -> None:
    rows = migrate.rows_of(16.0, pool_job(16.0, [("pause", "fast", [], None), ("resume", "fast", [], 0.95)]))
    ahead = migrate.rows_of(16.0, pool_job(16.0, [("pause", "fast", [], None), ("resume", "fast", [], 0.55)]))
    for row in ahead:
        row.update(budget="90%", ahead="keeper")
    migrate.add_ratios(rows + ahead, BANDWIDTH, FIXED)
    ways = {w["staging"]: w for w in migrate.staging_ways(rows + ahead)}
    assert ways["kept"]["resume_runs"] == [0.95] and ways["ahead"]["resume_runs"] == [0.55]
    assert [migrate.staging_way(r) for r in ahead] == ["ahead", "ahead"]


def test_the_job_whose_keeper_makes_its_staging_first_waits_for_it_before_its_first_pause() -> None:
    plan = migrate.pool_plan(False, with_migrate=False, keeper_first=True)
    assert plan == ["30:kept", "+0:pause@fast", "+0:resume", "+100:pause@fast", "+0:resume"]
    assert migrate.pool_plan(False, with_migrate=False) == ["30:pause@fast", *plan[2:]]


def test_a_pause_that_found_the_budgets_share_kept_is_its_own_way() -> None:
    share = (
        "the staging kept for pauses holds 31.5 GiB, pinned, of the 68.9 GiB the pool needs (only that part is kept, "
        "as its 68.9 GiB exceed flexium's pinned host memory budget of 31.5 GiB (FLEXIUM_PINNED_HOST_MEMORY=25%, the "
        "default)): it is copied at once, and the rest mapped and written as the copies reach it, at the safe point"
    )
    assert migrate.staging_of({"notes": [share, MADE, "fast path: copied 64.00 GiB"]}) == "share"
    rows = migrate.rows_of(64.0, pool_job(64.0, [("pause", "fast", [share, MADE], None), ("resume", "fast", [], 1.9)]))
    for row in rows:
        row.update(budget="default", ahead="keeper")
    migrate.add_ratios(rows, BANDWIDTH, FIXED)
    ways = {w["staging"]: w for w in migrate.staging_ways(rows)}
    assert set(ways) == {"share"} and ways["share"]["resume_runs"] == [1.9]


def test_the_budgets_share_is_run_where_the_budget_cannot_hold_the_staging(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("FLEXIUM_PINNED_HOST_MEMORY", "32GiB")
    assert migrate.default_budget_holds(16.0) and not migrate.default_budget_holds(64.0)
