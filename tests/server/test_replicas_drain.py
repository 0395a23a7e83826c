"""A drain's passes on two replicas at once (two servers' connections to one PostgreSQL database):
the jobs whose migrates failed are each paused once, whichever replica's pass gets the host first,
and the other's pass sends nothing."""

from __future__ import annotations

import threading
from collections.abc import Iterator

import pytest

from flexium import wire
from flexium.server.db import Database
from flexium.server.policies.drain import DrainOutcome, run_drains, start_drain
from flexium.server.settings import normalize_database_url
from support.queue import HOST, admin, gpus_report
from support.server import GIB
from support.storage import NOW, STALE, add_process, make_workspace, next_for, report

pytestmark = [pytest.mark.timeout(120), pytest.mark.parametrize("database_kind", ["postgresql"], indirect=True)]

JOBS = 6
ROUNDS = 3


def _one_pass(replica: Database, barrier: threading.Barrier, outcomes: list[DrainOutcome]) -> None:
    barrier.wait()  # both replicas' passes start together
    outcomes.append(replica.run(run_drains, write=True, now=NOW + 1, stale_after=STALE))


@pytest.fixture
def other_replica(database_url_at_head: str) -> Iterator[Database]:
    """The other replica's own connections to the database the ``db`` fixture opened."""
    database = Database(normalize_database_url(database_url_at_head), threads=4)
    yield database
    database.dispose()


def test_two_replicas_passes_pause_each_job_whose_migrate_failed_once(db: Database, other_replica: Database) -> None:
    paused: dict[str, int] = {}
    for round_ in range(ROUNDS):
        ws, _ = make_workspace(db, name=f"team-{round_}")
        jobs = [f"job-{n}" for n in range(JOBS)]
        for process_id in jobs:
            add_process(
                db, ws, process_id, memory=10 * GIB, gpu_index=0, devices=[], visible_gpus=["GPU-0000", "GPU-0001"]
            )
        gpus_report(db, ws, NOW, JOBS * 10 * GIB, 0)
        _drain, started = db.run(
            start_drain,
            write=True,
            workspace_id=ws,
            actor=admin(ws),
            request=wire.DrainRequest(host=HOST, gpu=0),
            now=NOW,
            stale_after=STALE,
        )
        assert sorted(c.process_id for _ws, c in started.commands) == jobs
        for process_id in jobs:  # each job's own room check refuses its migrate
            report(db, ws, next_for(db, ws, process_id)[0].id, "failed", error="not enough room on GPU-0001")

        outcomes: list[DrainOutcome] = []
        barrier = threading.Barrier(2)

        passes = [
            threading.Thread(target=_one_pass, args=(replica, barrier, outcomes)) for replica in (db, other_replica)
        ]
        for thread in passes:
            thread.start()
        for thread in passes:
            thread.join(60)
        sent = [command for outcome in outcomes for _ws, command in outcome.commands]
        assert sorted(c.process_id for c in sent) == jobs and {c.kind for c in sent} == {"pause"}, sent
        for outcome in outcomes:
            for _ws, command in outcome.commands:
                paused[command.process_id] = paused.get(command.process_id, 0) + 1
    assert len(paused) == JOBS and set(paused.values()) == {ROUNDS}
