"""The GPUs the server shows follow a move or a pause at once: a host's GPU report is stored at
most every --device-write-interval (here 60 s, longer than the test), except the one a job sends
right after its command ended. A training process on the fake driver (two H200s, its own NVML)
attached to a real server, moved by the command line."""

from __future__ import annotations

import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from support.e2e import Job, Server, wait_until

pytestmark = pytest.mark.timeout(180)

JOB_MIB = 2048
# The job beats right after its final report, so well within this; the bound rules out the report
# waiting for the 60 s write interval (counted from the move's report, a few seconds before the pause),
# and leaves the rest to a machine shared with other work (CI's loaded two cores once took over 3 s,
# and once over 10 s, for the pause's).
SHOWN_WITHIN_S = 20.0
WRITE_INTERVAL_S = 60


@pytest.fixture(scope="module")
def server(module_tmp: Path) -> Iterator[Server]:
    options = ("--stale-after", str(2 * WRITE_INTERVAL_S), "--device-write-interval", str(WRITE_INTERVAL_S))
    with Server(module_tmp, options=options).serving() as srv:
        yield srv


def memory_by_gpu(server: Server) -> dict[str, int]:
    (host,) = server.get("/devices").json()["hosts"]
    return {d["uuid"]: d["memory_used"] for d in host["devices"]}


def shown(server: Server, expected: dict[str, int], what: str) -> None:
    """The server shows `expected` (bytes used by GPU UUID) within SHOWN_WITHIN_S of now."""
    seen: list[dict[str, int]] = []

    def as_expected() -> bool:
        seen[:] = [memory_by_gpu(server)]
        return seen[0] == expected

    try:
        wait_until(as_expected, SHOWN_WITHIN_S, what)
    except AssertionError as exc:
        raise AssertionError(f"{exc}: the server shows {seen[0]}, expected {expected}") from None


def test_the_gpus_shown_follow_a_move_and_a_pause_at_once(server: Server) -> None:
    job = Job(server, fake=True, memory_mib=JOB_MIB)
    try:
        registered = job.wait_registered()
        gpu0, gpu1 = registered["visible_gpus"][:2]
        held = JOB_MIB << 20
        shown(server, {gpu0: held, gpu1: 0}, "the GPUs of the registration")
        time.sleep(1.0)  # a few heartbeats, none of them stored: the interval is 60 s

        done = server.cli("migrate", job.process_id, "cuda:1")
        assert done.returncode == 0, done.stdout + done.stderr
        shown(server, {gpu0: 0, gpu1: held}, "the job's memory on the GPU it moved to")

        done = server.cli("pause", job.process_id)
        assert done.returncode == 0, done.stdout + done.stderr
        shown(server, {gpu0: 0, gpu1: 0}, "no memory of the paused job on any GPU")

        done = server.cli("resume", job.process_id, "cuda:0")
        assert done.returncode == 0, done.stdout + done.stderr
        shown(server, {gpu0: held, gpu1: 0}, "the job's memory on the GPU it resumed on")
    finally:
        job.stop()
