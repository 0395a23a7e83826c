"""Faults under two replicas behind nginx (support/replicas.py), counted the way the durability
tests count: a replica SIGKILLed while hundreds of commands go through nginx to simulated jobs
(support/server.py's SimJob: the real client's protocol, redeliveries answered without running
again); and PostgreSQL stopped and started again under them (a cluster of
the test's own, so the shared one stays up)."""

from __future__ import annotations

import signal
import threading
import time
from collections import Counter
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import requests

from support.e2e import Job, wait_until
from support.postgres_cluster import PostgresCluster
from support.replicas import Replicas, postgres_database
from support.server import SimJob, process_body

pytestmark = pytest.mark.timeout(420)

SIM_JOBS = 10
COMMANDS = 200  # over the whole run; the replica is killed a third of the way in
FINAL = {"succeeded", "failed", "expired", "cancelled"}
# The simulated jobs report their GPUs when they register only: a resume needs a report younger
# than --stale-after, so it outlasts the test.
OPTIONS = ("--stale-after", "300", "--remove-after", "600", "--sweep-interval", "0.5")


class Controller:
    """Sends each simulated job pause, resume, pause, ... through nginx, one at a time, and waits
    for each to end. A POST whose answer was lost (the replica died under it) may have created its
    command: the job's latest command says, and is adopted if it is new. Every id it created is
    in ``created[process_id]``, in order."""

    def __init__(self, api: str, token: str, jobs: list[SimJob], total: int) -> None:
        self.api = api
        self.session = requests.Session()
        self.session.headers["Authorization"] = f"Bearer {token}"
        self.session.mount("http://", requests.adapters.HTTPAdapter(pool_maxsize=len(jobs)))
        self.jobs = jobs
        self.total = total
        self.created: dict[str, list[int]] = {job.process_id: [] for job in jobs}
        self.count = 0
        self.lock = threading.Lock()
        self.errors: list[str] = []

    def run(self) -> None:
        threads = [threading.Thread(target=self._drive, args=(job,), daemon=True) for job in self.jobs]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join(150)

    def _take_turn(self) -> bool:
        with self.lock:
            if self.count >= self.total:
                return False
            self.count += 1
            return True

    def _drive(self, job: SimJob) -> None:
        kinds = ("pause", "resume")
        mine = self.created[job.process_id]
        while self._take_turn():
            command_id = self._create(job.process_id, kinds[len(mine) % 2], mine)
            if command_id is None:
                return
            mine.append(command_id)
            self._wait_final(command_id)

    def _create(self, process_id: str, kind: str, mine: list[int]) -> int | None:
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline:
            try:
                r = self.session.post(f"{self.api}/commands", json={"kind": kind, "process_id": process_id}, timeout=10)
                if r.status_code == 201:
                    return int(r.json()["id"])
                if r.status_code < 500 and r.status_code != 409:
                    self.errors.append(f"{process_id} {kind}: {r.status_code} {r.text}")
                    return None
            except requests.RequestException:
                pass
            latest = self._latest(process_id)
            if latest is not None and latest not in mine:
                return latest  # created, its answer lost
            time.sleep(0.1)
        self.errors.append(f"{process_id} {kind}: not created within 60 s")
        return None

    def _latest(self, process_id: str) -> int | None:
        try:
            r = self.session.get(f"{self.api}/commands", params={"process_id": process_id, "limit": 1}, timeout=10)
        except requests.RequestException:
            return None
        return int(r.json()[0]["id"]) if r.status_code == 200 and r.json() else None

    def _wait_final(self, command_id: int) -> None:
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline:
            try:
                r = self.session.get(f"{self.api}/commands/{command_id}", params={"wait": 5}, timeout=15)
                if r.status_code == 200 and r.json()["state"] in FINAL:
                    return
            except requests.RequestException:
                time.sleep(0.1)
        self.errors.append(f"command {command_id} did not end within 60 s")


def _sim_jobs(group: Replicas, count: int) -> list[SimJob]:
    token = group.servers[0].token or ""
    return [
        SimJob(group.api, token, f"sim-{i}", process_body(f"sim-{i}", host=f"node-{i}", n_gpus=1)).start()
        for i in range(count)
    ]


def _close(jobs: list[SimJob]) -> None:
    """All told to stop first, then waited for: each may be in a request of up to 10 s."""
    for job in jobs:
        job.stop.set()
        job.accepting.set()
    for job in jobs:
        job.close()


def _when(condition: Callable[[], bool], then: Callable[[], None]) -> threading.Thread:
    def watch() -> None:
        wait_until(condition, 120, "the moment of the fault", interval=0.02)
        then()

    thread = threading.Thread(target=watch, daemon=True)
    thread.start()
    return thread


def test_a_replica_killed_under_load_loses_no_command_and_runs_none_twice(tmp_path: Path) -> None:
    with postgres_database() as database:
        group = Replicas(tmp_path, database, 2, options=OPTIONS).start()
        survivor, victim = group.servers
        jobs = _sim_jobs(group, SIM_JOBS)
        try:
            controller = Controller(group.api, survivor.token or "", jobs, COMMANDS)
            killed: list[float] = []
            fault = _when(
                lambda: controller.count >= COMMANDS // 3,
                lambda: (victim.stop(signal.SIGKILL), killed.append(time.monotonic())),
            )
            started = time.monotonic()
            controller.run()
            fault.join(5)
            took = time.monotonic() - started
            assert controller.errors == [], controller.errors[:5]
            assert killed, "the replica was not killed"

            # Counted in the database, through the replica that lived: every command the
            # controller created is there, once, and ended; none other was created (a POST
            # sent again by nginx would be one).
            listed: dict[str, list[dict[str, Any]]] = {}
            for job in jobs:
                r = survivor.get("/commands", params={"process_id": job.process_id, "limit": 1000})
                listed[job.process_id] = sorted(r.json(), key=lambda c: c["id"])
            created = sum(len(ids) for ids in controller.created.values())
            assert created == COMMANDS
            for job in jobs:
                commands = listed[job.process_id]
                assert [c["id"] for c in commands] == controller.created[job.process_id], job.process_id
                assert Counter(c["state"] for c in commands) == {"succeeded": len(commands)}, commands
                # each carried out once by its job (a redelivery is answered, not run again)
                assert sorted(job.done) == [c["id"] for c in commands], (job.process_id, job.done)
                expected = "PAUSED" if len(commands) % 2 else "RUNNING"
                assert (survivor.process(job.process_id) or {}).get("state") == expected
            redelivered = sum(len(job.received) - len(job.done) for job in jobs)

            # The killed replica comes back on its port and serves again: a command created
            # through it reaches a job polling through nginx.
            victim.start()
            job = jobs[0]
            kind = "resume" if len(controller.created[job.process_id]) % 2 else "pause"
            r = victim.post("/commands", {"kind": kind, "process_id": job.process_id})
            assert r.status_code == 201, r.text
            ended = victim.get(f"/commands/{r.json()['id']}", params={"wait": 20}, timeout=30).json()
            assert ended["state"] == "succeeded", ended
        finally:
            _close(jobs)
            group.stop()
    print(
        f"\nFIGURES replica killed under load: {created} commands through nginx to {SIM_JOBS} jobs in "
        f"{took:.1f} s, one of 2 replicas SIGKILLed after {COMMANDS // 3}: all succeeded, each run once, "
        f"{redelivered} delivered again"
    )


def test_postgresql_restarted_under_load_replicas_say_so_and_everything_resumes(tmp_path: Path) -> None:
    cluster = PostgresCluster().start()
    group = Replicas(tmp_path, cluster.url, 2, options=OPTIONS)
    jobs: list[SimJob] = []
    trainer: Job | None = None
    try:
        group.start()
        first, second = group.servers
        jobs = _sim_jobs(group, 4)
        trainer = Job(first, fake=True, memory_mib=512, address=group.address)
        trainer.wait_registered()

        cluster.stop("fast")
        down_at = time.time()
        for server in group.servers:
            answer = wait_until(
                lambda s=server: (r := requests.get(s.url + "/healthz", timeout=30)).status_code == 503 and r.json(),
                30,
                f"replica {server.port} to report its database unavailable",
            )
            assert answer["status"] == "degraded" and "unavailable" in answer["database"], answer
        steps = trainer.steps()
        wait_until(lambda: trainer.steps() > steps + 5, 30, "training while PostgreSQL is down")

        cluster.start()
        back_at = time.time()
        for server in group.servers:
            wait_until(
                lambda s=server: requests.get(s.url + "/healthz", timeout=30).status_code == 200,
                30,
                f"replica {server.port} healthy again",
            )
        for process_id in [trainer.process_id, *(job.process_id for job in jobs)]:
            wait_until(
                lambda p=process_id: (first.process(p) or {}).get("last_seen", 0) > back_at,
                30,
                f"{process_id}'s heartbeats stored again",
            )
        # Commands flow again, from either replica to jobs polling through nginx.
        done = second.cli("pause", trainer.process_id)
        assert done.returncode == 0, done.stdout + done.stderr
        done = first.cli("resume", trainer.process_id)
        assert done.returncode == 0, done.stdout + done.stderr
        for job, server in zip(jobs, (first, second, first, second), strict=True):
            r = server.post("/commands", {"kind": "pause", "process_id": job.process_id})
            assert r.status_code == 201, r.text
            ended = server.get(f"/commands/{r.json()['id']}", params={"wait": 20}, timeout=30).json()
            assert ended["state"] == "succeeded", ended
        steps = trainer.steps()
        wait_until(lambda: trainer.steps() > steps, 20, "training after PostgreSQL is back")
    finally:
        if trainer is not None:
            trainer.stop()
        _close(jobs)
        group.stop()
        cluster.remove()
    print(f"\nFIGURES PostgreSQL restarted under 2 replicas: down {back_at - down_at:.1f} s, the job trained on")
