"""A rolling upgrade as docs/guide/server.md gives it, with real ``flexium server`` processes on one
PostgreSQL database: an old replica (this code) serves simulated jobs while two replicas of a newer
version (this code with an additive schema change on top: support/newer_schema.py) start at once.
They upgrade the schema once, one waiting for the other under the upgrade's PostgreSQL lock; the
old replica serves on throughout (jobs register and heartbeat through it, and take commands made
through every replica, each carried out once, and no request is a deadlock's victim beside the
upgrade); restarted, it refuses the newer schema and says what to do."""

from __future__ import annotations

import threading
import time
from collections import Counter
from pathlib import Path

import psycopg
import pytest
import requests

from flexium.server.db import MIGRATION_LOCK_KEY
from support.e2e import Server, wait_until
from support.newer_schema import DEFAULT_COLUMN, NULLABLE_COLUMN, PROBE_TABLE, command_prefix, write_revision
from support.replicas import START_S, postgres_database
from support.server import SimJob, process_body

pytestmark = pytest.mark.timeout(420)

SIM_JOBS = 4
FINAL = {"succeeded", "failed", "expired", "cancelled"}
OPTIONS = ("--stale-after", "300", "--remove-after", "600")


class Traffic:
    """Pause and resume for each job in turn, created through the replicas of ``senders`` in turn
    (the test adds replicas as they start), each waited for until it ends. Every id created is in
    ``created[process_id]``, in order; any refusal or failure is in ``errors``."""

    def __init__(self, token: str, jobs: list[SimJob], senders: list[Server]) -> None:
        self.session = requests.Session()
        self.session.headers["Authorization"] = f"Bearer {token}"
        self.session.mount("http://", requests.adapters.HTTPAdapter(pool_maxsize=len(jobs) * 4))
        self.jobs = jobs
        self.senders = senders
        self.created: dict[str, list[int]] = {job.process_id: [] for job in jobs}
        self.sent_by: Counter[int] = Counter()  # port of the replica a command was created through
        self.errors: list[str] = []
        self.stop = threading.Event()
        self._threads = [threading.Thread(target=self._drive, args=(job,), daemon=True) for job in jobs]

    def start(self) -> Traffic:
        for thread in self._threads:
            thread.start()
        return self

    def join(self) -> None:
        self.stop.set()
        for thread in self._threads:
            thread.join(60)

    def _drive(self, job: SimJob) -> None:
        mine = self.created[job.process_id]
        while not self.stop.is_set():
            sender = self.senders[len(mine) % len(self.senders)]
            kind = ("pause", "resume")[len(mine) % 2]
            try:
                r = self.session.post(f"{sender.api}/commands", json={"kind": kind, "process_id": job.process_id})
                if r.status_code != 201:
                    self.errors.append(f"{job.process_id} {kind} through {sender.port}: {r.status_code} {r.text}")
                    return
                command_id = int(r.json()["id"])
                mine.append(command_id)
                self.sent_by[sender.port] += 1
                ended = self.session.get(f"{sender.api}/commands/{command_id}", params={"wait": 20}, timeout=30)
                if ended.status_code != 200 or ended.json()["state"] not in FINAL:
                    self.errors.append(f"command {command_id}: {ended.status_code} {ended.text}")
                    return
            except requests.RequestException as exc:
                self.errors.append(f"{job.process_id} {kind} through {sender.port}: {exc}")
                return


def _waiting_for_the_upgrade_lock(conn: psycopg.Connection) -> int:
    row = conn.execute(
        "SELECT count(*) FROM pg_locks WHERE locktype = 'advisory' AND NOT granted AND classid = 0 AND objid = %s"
        " AND database = (SELECT oid FROM pg_database WHERE datname = current_database())",
        (MIGRATION_LOCK_KEY,),
    ).fetchone()
    assert row is not None
    return int(row[0])


def test_a_rolling_upgrade_under_jobs_traffic(tmp_path: Path) -> None:
    revision = write_revision(tmp_path / "newer-revision")
    with postgres_database() as database:
        old = Server(tmp_path / "old", options=OPTIONS, database=database)
        token = old.create_workspace()
        old.start(START_S)
        newer = [Server(tmp_path / f"newer-{i}", options=OPTIONS, database=database) for i in range(2)]
        for server in newer:
            server.token, server.job_token = old.token, old.job_token
            server.child.prefix = list(command_prefix(tmp_path / "newer-revision"))
        body = {i: process_body(f"sim-{i}", host=f"node-{i}", n_gpus=1) for i in range(SIM_JOBS + 2)}
        jobs = [SimJob(old.api, old.job_token or "", f"sim-{i}", body[i]).start() for i in range(SIM_JOBS)]
        later: list[SimJob] = []  # registered after the upgrade: through the old replica, a newer one
        traffic = Traffic(token, jobs, [old]).start()
        try:
            wait_until(lambda: all(len(ids) >= 2 for ids in traffic.created.values()), 60, "commands before")

            # Two newer replicas start at once while the test holds the upgrade's lock: both
            # wait for it; let go, one upgrades and the other finds nothing left to do.
            with psycopg.connect(database.replace("postgresql+psycopg://", "postgresql://"), autocommit=True) as conn:
                conn.execute("SELECT pg_advisory_lock(%s)", (MIGRATION_LOCK_KEY,))
                failures: list[BaseException] = []

                def start(server: Server) -> None:
                    try:
                        server.start(START_S)
                    except BaseException as exc:  # said by the test's thread
                        failures.append(exc)

                starting = [threading.Thread(target=start, args=(server,)) for server in newer]
                for thread in starting:
                    thread.start()
                wait_until(lambda: _waiting_for_the_upgrade_lock(conn) == 2, START_S, "both newer replicas to wait")
                sent = sum(traffic.sent_by.values())
                wait_until(lambda: sum(traffic.sent_by.values()) >= sent + SIM_JOBS, 60, "the old replica to serve on")
                conn.execute("SELECT pg_advisory_unlock(%s)", (MIGRATION_LOCK_KEY,))
                for thread in starting:
                    thread.join()
                assert failures == [], failures
                upgraded_at = time.time()
                assert conn.execute("SELECT version_num FROM alembic_version").fetchall() == [(revision,)]
                assert conn.execute(f"SELECT count(*) FROM {PROBE_TABLE}").fetchone() == (1,)
                for server in newer:
                    assert any("schema ready" in line for line in server.child.lines), server.child.lines

                # The old replica served while the upgrade waited, and serves after it: commands
                # made through every replica reach the jobs polling it; a job registers through
                # it, into the table with the new columns, and takes one made through a newer
                # replica; one on a newer replica takes one made through the old.
                traffic.senders.extend(newer)
                for through, polled, i in ((newer[1], old, SIM_JOBS), (old, newer[0], SIM_JOBS + 1)):
                    later.append(SimJob(polled.api, old.job_token or "", f"sim-{i}", body[i]).start())
                    r = through.post("/commands", {"kind": "pause", "process_id": f"sim-{i}"})
                    assert r.status_code == 201, r.text
                    ended = through.get(f"/commands/{r.json()['id']}", params={"wait": 20}, timeout=30).json()
                    assert ended["state"] == "succeeded", ended
                wait_until(
                    lambda: all(traffic.sent_by[s.port] >= SIM_JOBS for s in [old, *newer]),
                    120,
                    "commands through every replica after the upgrade",
                )
                column, table = NULLABLE_COLUMN[1], NULLABLE_COLUMN[0]
                assert conn.execute(f"SELECT count(*) FROM {table} WHERE {column} IS NOT NULL").fetchone() == (0,)
                column, table = DEFAULT_COLUMN[1], DEFAULT_COLUMN[0]
                assert conn.execute(f"SELECT count(*), min({column}) FROM {table}").fetchone() == (SIM_JOBS + 2, 0)
            traffic.join()
            assert traffic.errors == [], traffic.errors[:5]

            # Nothing lost: every command created is there, once, succeeded, carried out once by
            # its job; every job's heartbeats reached the old replica after the upgrade.
            for job in jobs:
                listed = old.get("/commands", params={"process_id": job.process_id, "limit": 1000}).json()
                ids = sorted(c["id"] for c in listed)
                assert ids == traffic.created[job.process_id], job.process_id
                assert Counter(c["state"] for c in listed) == {"succeeded": len(ids)}, listed
                assert sorted(job.done) == ids, (job.process_id, job.done)
                wait_until(
                    lambda j=job: (old.process(j.process_id) or {}).get("last_seen", 0) > upgraded_at,
                    10,
                    f"{job.process_id}'s heartbeat after the upgrade",
                )
            assert sum(job.errors for job in [*jobs, *later]) == 0
        finally:
            traffic.join()
            for job in [*jobs, *later]:
                job.close()
            for server in newer:
                server.stop()

        # The old replica restarted now refuses the newer schema, saying what to do.
        old.stop()
        with pytest.raises(AssertionError, match="server exited") as refused:
            old.start(START_S)
        assert f"the database schema is at revision {revision}, which this flexium does not know" in str(refused.value)
        assert "upgrade flexium" in str(refused.value)

        # No request was a deadlock's victim beside the upgrade (a 503 to a job or a person).
        with psycopg.connect(database.replace("postgresql+psycopg://", "postgresql://"), autocommit=True) as conn:
            row = conn.execute("SELECT deadlocks FROM pg_stat_database WHERE datname = current_database()").fetchone()
            assert row == (0,), f"{row[0] if row else '?'} deadlocks in the database during the upgrade"
