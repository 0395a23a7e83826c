"""Every policy that counts a host's room takes the host's lock first (``reservations.lock_hosts``):
two servers on one PostgreSQL database, one placing a job not started yet on a host, the other
running the resume-when-free queue's pass over it at that moment, act one after the other; the
second counts the room the first held, and the GPU's room is given once."""

from __future__ import annotations

import threading
from collections.abc import Iterator

import pytest

from flexium import protocol, wire
from flexium.server.db import Database
from flexium.server.policies.placement import place_job
from flexium.server.policies.resume_when_free import QueueOutcome, run_queue
from flexium.server.settings import BACKFILL_PATIENCE_S, normalize_database_url
from support.queue import HOST, admin, gpus_report, paused, queue, resumed, waits
from support.server import GIB, gpu
from support.storage import NOW, STALE, make_workspace

pytestmark = [pytest.mark.timeout(60), pytest.mark.parametrize("database_kind", ["postgresql"], indirect=True)]

BLOCKED_FOR_S = 1.0  # how long the second server's pass is watched waiting for the first's commit


@pytest.fixture
def second_server(database_url_at_head: str) -> Iterator[Database]:
    """The second server's own connections to the database the ``db`` fixture opened."""
    database = Database(normalize_database_url(database_url_at_head), threads=4)
    yield database
    database.dispose()


def test_a_queue_pass_waits_for_a_placement_on_its_host_and_counts_the_room_it_held(
    db: Database, second_server: Database
) -> None:
    ws, _ = make_workspace(db)
    gpus_report(db, ws, NOW, 139 * GIB)
    # Of a lower priority than the placement, whose room it would take otherwise (both fit the report).
    paused(db, ws, "paused-job", footprint=30 * GIB, priority=protocol.PRIORITIES["low"])
    assert queue(db, ws, "paused-job").wait.state == "waiting"
    gpus_report(db, ws, NOW + 1, 100 * GIB)  # 40 GiB free: room for one 30 GiB job
    room_for_one = [wire.GpuReport.model_validate(gpu(0, used=100 * GIB))]
    request = wire.PlacementRequest(host=HOST, devices=room_for_one, memory_bytes=30 * GIB)

    passed: list[QueueOutcome] = []
    second_pass = threading.Thread(
        target=lambda: passed.append(
            second_server.run(
                run_queue,
                write=True,
                now=NOW + 1,
                stale_after=STALE,
                backfill_patience=BACKFILL_PATIENCE_S,
                workspace_id=ws,
                host=HOST,
            )
        )
    )
    with db.session(write=True) as session:  # the first server places a job; not committed yet
        placed = place_job(
            session=session,
            workspace_id=ws,
            actor=admin(ws),
            request=request,
            now=NOW + 1,
            stale_after=STALE,
            reservation_ttl=protocol.RESERVATION_TTL_S,
            answering_since=NOW - 3600,
            backfill_patience=BACKFILL_PATIENCE_S,
        )
        assert placed.placement.state == "placed"
        second_pass.start()
        second_pass.join(BLOCKED_FOR_S)
        assert second_pass.is_alive(), "the queue's pass went on while a placement on its host was being decided"
    second_pass.join(30)
    [outcome] = passed
    assert resumed(outcome) == []  # 40 GiB free less the 30.5 GiB held for the placement: no room
    assert waits(db, ws)["paused-job"].state == "waiting"
