"""The server SIGKILLed with a drain under way and a placement waiting, then restarted on the same
database (real server, real jobs and flexium run on the simulated driver): the drain goes on to
its end with each job moved once, and the placement, whose room appeared while the server was
down, is placed and its job started once; nothing is lost and nothing is done twice."""

from __future__ import annotations

import re
import signal
import time
from pathlib import Path
from typing import Any

import pytest

from support.e2e import Job, Server, wait_until
from support.fake_driver import write_host_file
from support.flexium_run import FULL, Run

pytestmark = pytest.mark.timeout(300)

DRAIN_HOST, PLACE_HOST = "restart-drain", "restart-place"


def _drained(server: Server) -> dict[str, Any] | None:
    drains: list[dict[str, Any]] = server.get("/drains", params={"host": DRAIN_HOST, "all": "true"}).json()
    return next((d for d in drains if d["state"] == "drained"), None)


def _commands(server: Server, job: Job, kind: str) -> list[dict[str, Any]]:
    commands = server.get("/commands", params={"process_id": job.process_id}).json()
    return [c for c in commands if c["kind"] == kind]


def test_a_drain_and_a_placement_survive_the_servers_sigkill(tmp_path: Path) -> None:
    server = Server(tmp_path)
    server.create_workspace()
    server.start()
    drain_file, place_file = tmp_path / "drain-host", tmp_path / "place-host"
    write_host_file(drain_file, {})
    write_host_file(place_file, {0: FULL, 1: FULL})
    simulated = {"FLEXIUM_SIMULATED_HOST": DRAIN_HOST, "FAKE_CUDA_GPUS": "4", "FAKE_CUDA_HOST_FILE": str(drain_file)}
    jobs: list[Job] = []
    run: Run | None = None
    try:
        jobs = [Job(server, fake=True, extra_env=simulated) for _ in range(2)]
        for job in jobs:
            assert job.wait_registered()["gpu_index"] == 0
        run = Run(server, tmp_path, place_file, "--host", PLACE_HOST)
        run.output.wait_for(r"^flexium run: placement \d+ waits \(number 1 to start on \S+\)", 60)
        drain = server.post("/drains", {"host": DRAIN_HOST, "gpu": 0, "reason": "before a restart"})
        assert drain.status_code == 201, drain.text
        server.stop(signal.SIGKILL)
        write_host_file(place_file, {1: FULL})  # room appears while the server is down
        time.sleep(1.0)  # flexium run finds the server gone, and asks again
        server.start()

        # The drain ends, each job moved off GPU 0 once, and trains on.
        done = wait_until(lambda: _drained(server), 60, "the drain to end after the restart")
        assert [m["action"] for m in done["moves"]] == ["migrate", "migrate"], done
        for job in jobs:
            [migrate] = _commands(server, job, "migrate")
            assert migrate["state"] == "succeeded", migrate
            process = server.process(job.process_id)
            assert process is not None and process["state"] == "RUNNING" and process["gpu_index"] != 0
            before = job.steps()
            wait_until(lambda job=job, before=before: job.steps() > before, 15, "training to go on after the move")

        # The placement is placed where the room appeared, and its job starts once.
        process_id, device = run.started()
        assert device == "cuda:0"
        [placement] = server.get("/placements", params={"all": "true"}).json()
        wait_until(lambda: server.process(process_id), 20, "the placed job to register")
        placement = server.get(f"/placements/{placement['id']}").json()
        assert placement["state"] == "started" and placement["process_id"] == process_id, placement
        time.sleep(2.0)  # a sweep later: still one drain's moves, one placement, one job
        assert all(len(_commands(server, job, "migrate")) == 1 for job in jobs)
        assert len([line for line in run.output.lines if re.match(r"^job ", line)]) == 1
        assert run.end() == 0, run.output.text[-3000:]
    finally:
        if run is not None:
            run.kill()
        for job in jobs:
            job.stop()
        server.stop(signal.SIGKILL)
