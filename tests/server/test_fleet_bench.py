"""bench/fleet.py on a tiny fleet (2 hosts x 2 GPUs, a few jobs, seconds) against a real server:
the policy run's figures are what its jobs lived through (a high-priority job given room by
pausing a low one, which the queue resumes when the room comes back), the static baseline's are
those of its simulation, and the printed table shows those figures, not others."""

from __future__ import annotations

import asyncio
import sys
from pathlib import Path
from typing import Any

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "bench"))

import fleet  # noqa: E402
from arrivals import GIB, Arrival, draw_arrivals, parse_mix, static_placement  # noqa: E402
from fleet_report import print_report, seconds, static_measured  # noqa: E402
from live_server import Server  # noqa: E402


def table_row(out: str, label: str) -> list[str]:
    """The cells of the table row named ``label``: flexium, static, their ratio."""
    for line in out.splitlines():
        if line.strip().startswith(label):
            return [cell.strip() for cell in line.strip()[len(label) :].split("  ") if cell.strip()]
    raise AssertionError(f"no row {label!r} in:\n{out}")


def test_a_high_priority_job_gets_room_made_and_the_job_paused_for_it_resumes_when_it_leaves(
    database_url: str, tmp_path: Any, capsys: pytest.CaptureFixture[str]
) -> None:
    args = fleet.options(
        [
            "--hosts=2",
            "--gpus-per-host=2",
            "--duration=4",
            "--warmup=0",
            "--drain=10",
            "--operation-s=0.2",
            "--heartbeat-interval=2",
            "--poll-wait=5",
        ]
    )
    low = [Arrival(i, 0.1 * i, i // 2, 100 * GIB, "low", 60.0) for i in range(4)]  # every GPU taken
    high = Arrival(4, 3.0, 0, 100 * GIB, "high", 2.0)  # needs a whole GPU of host 0 back
    normal = Arrival(5, 3.5, 1, 30 * GIB, "normal", 2.0)  # fits beside a low job of host 1
    arrivals = [*low, high, normal]
    server = Server(database_url, str(tmp_path))
    try:
        policy = asyncio.run(fleet.policy_run(server, arrivals, args))
    finally:
        server.stop()

    assert policy.errors == [] and policy.room_refused == []
    assert sorted(policy.started) == [0, 1, 2, 3, 4, 5]
    assert policy.started[4] - high.at < 10  # the two-core machine is shared: bounded, not timed
    assert policy.pauses == 1
    assert len(policy.paused_s) == 1 and policy.paused_s[0] > high.running_s  # back only once it left
    assert max(used for _, used in policy.memory_in_use) == 430 * GIB  # three low, the high and the normal
    assert policy.decision_s and all(0 <= d < 10 for d in policy.decision_s)
    assert policy.server_metrics["flexium_queue_decision_seconds_count"] > 0

    cutoff = args.duration + args.drain
    static = static_measured(arrivals, static_placement(arrivals, gpus_per_host=2, until=cutoff))
    assert sorted(static.started) == [0, 1, 2, 3]  # the high and the normal job wait for a whole GPU
    print_report("sqlite", arrivals, policy, static, args)
    out = capsys.readouterr().out
    assert table_row(out, "jobs paused to make room")[0] == "1"
    assert table_row(out, "wait to start, high, p50")[:2] == [
        seconds(policy.started[4] - high.at),
        seconds(cutoff - high.at),
    ]
    assert table_row(out, f"not started by {cutoff:g} s")[:2] == ["0", "2"]


def test_the_benchmark_runs_and_prints_its_table(capsys: pytest.CaptureFixture[str]) -> None:
    argv = [
        "--hosts=2",
        "--gpus-per-host=2",
        "--rate=1.5",
        "--duration=8",
        "--warmup=2",
        "--running-s=3",
        "--drain=4",
        "--heartbeat-interval=2",
        "--poll-wait=5",
        "--seed=7",
        "--backends=sqlite",
    ]
    assert fleet.main(argv) == 0
    out = capsys.readouterr().out
    args = fleet.options(argv)
    arrivals = draw_arrivals(
        seed=7,
        rate=1.5,
        window_s=8,
        hosts=2,
        sizes_gib=parse_mix(args.sizes),
        priorities=parse_mix(args.priorities),
        running_s=3,
    )
    in_window = sum(2 <= a.at <= 8 for a in arrivals)
    assert table_row(out, "jobs arriving in the window")[:2] == [str(in_window), str(in_window)]
    assert "0 errors" in out
