"""A job of several ranks through the real `flexium` command and a real server: `flexium ps`
shows the job and each rank, pause and resume of one rank act on the whole job, migrate moves
one rank or swaps them, and every refusal exits non-zero with the server's reason. The ranks
answer their commands over HTTP as the training processes would."""

from __future__ import annotations

import json
import signal
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
import requests

from support.e2e import FakeRank, Server, ps_row, wait_until
from support.server import process_body

pytestmark = pytest.mark.timeout(120)


@pytest.fixture
def ranks(server: Server) -> Iterator[list[FakeRank]]:
    started = [FakeRank(server, rank).start() for rank in (0, 1)]
    yield started
    for rank in started:
        rank.close()
    for rank in started:
        assert not rank.errors, rank.errors


def _operation_ids(ranks: list[FakeRank], kind: str) -> set[int]:
    return {c["job"]["operation_id"] for rank in ranks for c in rank.received if c["kind"] == kind}


def _rank_lines(stdout: str) -> dict[str, str]:
    """The per-rank lines of an outcome, by rank."""
    lines = {}
    for line in stdout.splitlines():
        words = line.split()
        if len(words) > 2 and words[0].isdigit() and words[1].startswith("run-e2e-7f3a-rank-"):
            lines[words[0]] = line
    return lines


def test_ps_shows_the_job_and_each_rank(server: Server, ranks: list[FakeRank]) -> None:
    done = server.cli("ps")
    assert done.returncode == 0, done.stderr
    assert done.stdout.split()[:4] == ["PROCESS", "NAME", "JOB", "RANK"]
    for rank in (0, 1):
        row = ps_row(done.stdout, f"run-e2e-7f3a-rank-{rank}")
        assert (row["JOB"], row["RANK"]) == ("run-e2e-7f3a", f"{rank}/2"), row
    assert "pause or resume one of them acts on all" in " ".join(server.cli("ps", "--help").stdout.split())


def test_pause_and_resume_of_one_rank_act_on_the_whole_job(server: Server, ranks: list[FakeRank]) -> None:
    done = server.cli("pause", ranks[1].process_id)
    assert done.returncode == 0, done.stdout + done.stderr
    first = done.stdout.splitlines()[0]
    assert first.startswith("pause job run-e2e-7f3a (2 ranks): succeeded in ") and "(job operation " in first
    lines = _rank_lines(done.stdout)
    assert set(lines) == {"0", "1"}
    for rank, line in lines.items():
        assert line.split()[2:4] == ["succeeded", "PAUSED"], line
        assert f"{250 + 10 * int(rank)} ms" in line, line
    assert len(_operation_ids(ranks, "pause")) == 1 and all(r.state == "PAUSED" for r in ranks)

    done = server.cli("resume", ranks[0].process_id, "--json")
    assert done.returncode == 0, done.stderr
    operation = json.loads(done.stdout)
    assert operation["kind"] == "resume" and operation["state"] == "succeeded" and operation["moves"] == {}
    assert [(c["job"]["rank"], c["state"]) for c in operation["commands"]] == [(0, "succeeded"), (1, "succeeded")]
    assert all(r.state == "RUNNING" for r in ranks)


def test_migrate_one_rank_or_swap_both(server: Server, ranks: list[FakeRank]) -> None:
    done = server.cli("migrate", ranks[1].process_id, "cuda:3")
    assert done.returncode == 0, done.stdout + done.stderr
    assert done.stdout.startswith("migrate job run-e2e-7f3a (2 ranks): rank 1 to cuda:3: succeeded")
    lines = _rank_lines(done.stdout)
    assert "cuda:3 (GPU 3)" in lines["1"] and "fast" in lines["1"]
    assert "cuda:0 (GPU 0)" in lines["0"]
    assert (ranks[0].gpu, ranks[1].gpu) == ("GPU-e2e-0", "GPU-e2e-3")

    done = server.cli("migrate", ranks[0].process_id, "--ranks", "0=cuda:3,1=cuda:0")
    assert done.returncode == 0, done.stdout + done.stderr
    assert "rank 0 to cuda:3, rank 1 to cuda:0: succeeded" in done.stdout.splitlines()[0]
    assert (ranks[0].gpu, ranks[1].gpu) == ("GPU-e2e-3", "GPU-e2e-0")
    swap = [[c for c in rank.received if c["kind"] == "migrate"][-1] for rank in ranks]
    assert {c["job"]["operation_id"] for c in swap} == {swap[0]["job"]["operation_id"]}
    assert swap[0]["job"]["moves"] == {"0": "GPU-e2e-3", "1": "GPU-e2e-0"}


def test_refusals_exit_non_zero_with_the_servers_reason(server: Server, ranks: list[FakeRank]) -> None:
    done = server.cli("migrate", ranks[0].process_id, "cuda:1")
    assert done.returncode == 1
    assert "rank 0 would share GPU GPU-e2e-1 with rank 1" in done.stderr
    done = server.cli("migrate", ranks[0].process_id, "--ranks", "0=cuda:0,1=cuda:1")
    assert done.returncode == 1 and "nothing to move in job 'run-e2e-7f3a'" in done.stderr
    done = server.cli("migrate", ranks[0].process_id, "--ranks", "3=cuda:2")
    assert done.returncode == 1 and "'3' is not a rank of job 'run-e2e-7f3a' (its ranks are 0..1)" in done.stderr
    done = server.cli("resume", ranks[0].process_id)
    assert done.returncode == 1 and "every rank must be PAUSED; rank 0 is RUNNING, rank 1 is RUNNING" in done.stderr
    done = server.cli("migrate", ranks[0].process_id, "cuda:2", "--ranks", "1=cuda:3")
    assert done.returncode == 2 and "not both" in done.stderr
    done = server.cli("migrate", ranks[0].process_id, "--ranks", "0cuda:1")
    assert done.returncode == 2 and "each entry is RANK=GPU" in done.stderr
    done = server.cli("migrate", ranks[0].process_id)
    assert done.returncode == 2 and "migrate needs a TARGET, or --ranks" in done.stderr
    assert not [c for rank in ranks for c in rank.received]


def test_a_rank_that_fails_fails_the_operation(server: Server, ranks: list[FakeRank]) -> None:
    ranks[1].fail_next = "ncclCommSuspend failed on rank 1; every rank rolled back"
    done = server.cli("pause", ranks[0].process_id)
    assert done.returncode == 1
    assert "pause job run-e2e-7f3a (2 ranks): failed" in done.stdout
    lines = _rank_lines(done.stdout)
    assert lines["0"].split()[2:4] == ["succeeded", "PAUSED"]
    assert lines["1"].split()[2:4] == ["failed", "RUNNING"] and "ncclCommSuspend failed" in lines["1"]
    assert "rank 1: ncclCommSuspend failed on rank 1" in done.stderr


def test_no_wait_and_a_rank_that_cannot_take_part(server: Server) -> None:
    why = "NCCL 2.27.3 has no ncclCommSuspend: install NCCL 2.28 or newer"
    ranks = [
        FakeRank(server, 0, key="run-e2e-nccl").start(),
        FakeRank(server, 1, key="run-e2e-nccl", job_operations=False, problems=[why]).start(),
    ]
    try:
        done = server.cli("pause", ranks[0].process_id)
        assert done.returncode == 1 and done.stderr.strip().endswith(why)
        assert "rank 1 (process 'run-e2e-nccl-rank-1') cannot take part" in done.stderr
        ranks[1].close()
        ranks[1] = FakeRank(server, 1, key="run-e2e-nccl").start()
        done = server.cli("pause", ranks[1].process_id, "--no-wait")
        assert done.returncode == 0, done.stderr
        assert done.stdout.startswith("pause job run-e2e-nccl (2 ranks): queued as job operation ")
        wait_until(lambda: all(r.state == "PAUSED" for r in ranks), 20, "both ranks to pause")
    finally:
        for rank in ranks:
            rank.close()


def test_a_pause_for_a_process_that_stopped_reporting_ends_its_wait_saying_so(tmp_path: Path) -> None:
    """A job killed before it took its pause: the command stays queued (taken if the job comes back),
    and flexium pause says the process stopped reporting and exits 1 once the server sees it stale,
    rather than waiting out its --timeout."""
    server = Server(tmp_path, options=("--stale-after", "6"))
    server.create_workspace()
    server.start()
    try:
        body = {**process_body("gone-1"), "seq": time.monotonic_ns()}
        r = requests.post(f"{server.api}/processes", json=body, headers=server.headers(), timeout=10)
        assert r.status_code in (200, 201), r.text
        started = time.monotonic()
        done = server.cli("pause", "gone-1", "--timeout", "120", timeout=150)
        took = time.monotonic() - started
        assert done.returncode == 1, done.stderr
        assert "process gone-1 stopped reporting (`flexium ps` shows it STALE): command" in done.stderr, done.stderr
        assert "stays queued and is taken if it comes back" in done.stderr
        assert took < 60, took
        (command,) = server.get("/commands", params={"process_id": "gone-1"}).json()
        assert command["state"] == "queued"
    finally:
        server.stop_checked(signal.SIGKILL)
