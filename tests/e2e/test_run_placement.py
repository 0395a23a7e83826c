"""``flexium run`` through the real server, on the simulated driver: a job started on the GPU of its
host with room (the other one filled by a neighbour, another program's memory), seeing every GPU
of its host, with a job token minted for it and revoked when it ends, its exit status flexium
run's; with both GPUs full it waits, saying so, and starts once the neighbour leaves; Ctrl-C while
it waits cancels its placement, and while the job runs reaches the job; a server that stops
answering while the job runs keeps flexium run only seconds after its job, and the token it could
not revoke is named."""

from __future__ import annotations

import os
import signal
import time
from pathlib import Path
from typing import Any

import pytest

from support.e2e import Server, wait_until
from support.fake_driver import write_host_file
from support.flexium_run import FULL, Run

pytestmark = pytest.mark.timeout(240)


def _placements(server: Server) -> list[dict[str, Any]]:
    answer: list[dict[str, Any]] = server.get("/placements", params={"all": "true"}).json()
    return answer


def test_a_job_starts_on_the_gpu_with_room(server: Server, tmp_path: Path) -> None:
    host_file = tmp_path / "neighbours"
    write_host_file(host_file, {0: FULL})
    run = Run(server, tmp_path, host_file, "--priority", "high")
    try:
        process_id, device = run.started()
        assert device == "cuda:1"
        process = wait_until(lambda: server.process(process_id), 20, "the job to register")
        assert process["gpu_index"] == 1 and len(process["visible_gpus"]) == 2  # it sees every GPU
        assert process["priority"] == 90
        placement = _placements(server)[0]
        assert placement["state"] == "started" and placement["process_id"] == process_id
        # Its room stays held, less what the job's reports show, until that is all of it or the hold's time ends.
        assert placement["placed_index"] == 1 and placement["reservation"] is not None
        tokens = {t["name"]: t for t in server.get("/tokens").json()}
        minted = tokens[f"flexium run, placement {placement['id']}"]
        assert minted["role"] == "job" and not minted["revoked"]
        assert run.end(3) == 3, run.output.text[-3000:]  # the job's exit status is flexium run's
        tokens = {t["name"]: t for t in server.get("/tokens").json()}
        assert tokens[f"flexium run, placement {placement['id']}"]["revoked"]
    finally:
        run.kill()


def test_with_both_gpus_full_it_waits_then_starts_when_the_neighbour_leaves(server: Server, tmp_path: Path) -> None:
    host_file = tmp_path / "neighbours"
    write_host_file(host_file, {0: FULL, 1: FULL})
    run = Run(server, tmp_path, host_file)
    try:
        run.output.wait_for(r"^flexium run: placement (\d+) waits \(number 1 to start on \S+\): waits for 4.5 GiB", 60)
        waiting = [p for p in _placements(server) if p["state"] == "waiting"]
        assert len(waiting) == 1 and "GPU 0: 1.0 GiB free; GPU 1: 1.0 GiB free" in waiting[0]["note"]
        write_host_file(host_file, {1: FULL})
        _, device = run.started()
        assert device == "cuda:0"
        assert run.end() == 0
    finally:
        run.kill()


def test_ctrl_c_while_it_waits_cancels_and_while_the_job_runs_reaches_the_job(server: Server, tmp_path: Path) -> None:
    host_file = tmp_path / "neighbours"
    write_host_file(host_file, {0: FULL, 1: FULL})
    waiting = Run(server, tmp_path, host_file)
    try:
        waiting.output.wait_for(r"^flexium run: placement (\d+) waits", 60)
        waiting.proc.send_signal(signal.SIGINT)
        assert waiting.proc.wait(30) == 130
        assert _placements(server)[0]["state"] == "cancelled"
    finally:
        waiting.kill()
    # SIGTERM (kill, timeout, a scheduler stopping it) while it waits cancels too, at once.
    stopped = Run(server, tmp_path, host_file)
    try:
        placement = int(stopped.output.wait_for(r"^flexium run: placement (\d+) waits", 60).group(1))
        stopped.proc.send_signal(signal.SIGTERM)
        assert stopped.proc.wait(30) == 130
        assert {p["id"]: p["state"] for p in _placements(server)}[placement] == "cancelled"
    finally:
        stopped.kill()
    write_host_file(host_file, {})
    running = Run(server, tmp_path, host_file)
    try:
        running.started()
        running.proc.send_signal(signal.SIGINT)
        assert running.proc.wait(30) == 130  # the job ended by the SIGINT passed on to it
    finally:
        running.kill()


def test_a_server_that_stops_answering_keeps_flexium_run_only_seconds_after_its_job(
    server: Server, tmp_path: Path
) -> None:
    host_file = tmp_path / "neighbours"
    write_host_file(host_file, {})
    run = Run(server, tmp_path, host_file)
    assert server.child.proc is not None
    try:
        process_id, _ = run.started()
        wait_until(lambda: server.process(process_id), 20, "the job to register")
        placement = next(p for p in _placements(server) if p["process_id"] == process_id)
        minted = next(
            t for t in server.get("/tokens").json() if t["name"] == f"flexium run, placement {placement['id']}"
        )
        os.kill(server.child.proc.pid, signal.SIGSTOP)
        try:
            ended = time.monotonic()
            assert run.end(3) == 3, run.output.text[-3000:]
            took = time.monotonic() - ended
        finally:
            os.kill(server.child.proc.pid, signal.SIGCONT)
        # The job's own exit (an unregister it cannot send, ~2 s), then a few seconds to tidy up;
        # asked with the default retries it took 30 to 60 s.
        assert took < 20, (took, run.output.text[-3000:])
        said = run.output.text
        assert f"could not revoke the job token minted for the job, token {minted['id']}" in said, said[-3000:]
        assert f"flexium token revoke e2e {minted['id']}" in said
    finally:
        run.kill()


def test_started_while_the_server_is_down_it_starts_once_the_server_is_back(server: Server, tmp_path: Path) -> None:
    """A job script run while the server restarts: nothing reached the server, so flexium run asks
    again, saying so once, and the job starts when the server answers; one placement is made."""
    host_file = tmp_path / "neighbours"
    write_host_file(host_file, {})
    before = len(_placements(server))
    server.stop(signal.SIGKILL)
    run = Run(server, tmp_path, host_file)
    try:
        run.output.wait_for(r"^flexium run: cannot reach the flexium server at .*; trying again for up to 60 s", 30)
        assert run.proc.poll() is None
    finally:
        server.start()
    try:
        run.started()
        assert run.end() == 0, run.output.text[-3000:]
        assert len(_placements(server)) == before + 1
        assert run.output.text.count("trying again") == 1
    finally:
        run.kill()
