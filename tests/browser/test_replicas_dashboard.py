"""The dashboard in Chromium through the guide's nginx in front of two replicas on one PostgreSQL
database (tests/support/replicas.py), while the command line talks to each replica directly: the
browser's session and its live events follow commands whichever replica they were sent to."""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import pytest

from support.dashboard_page import Dashboard
from support.replicas import Replicas, postgres_database
from support.server import SimJob, process_body

pytestmark = pytest.mark.timeout(180)


@dataclass(frozen=True)
class Front:
    """What the dashboard's page object reads of a server: where it is and the token to log in."""

    url: str
    token: str | None


@pytest.fixture(scope="module")
def replicas(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Replicas]:
    with postgres_database() as database:
        group = Replicas(tmp_path_factory.mktemp("replicas"), database, 2).start()
        try:
            yield group
        finally:
            group.stop()


def test_the_dashboard_through_nginx_follows_commands_sent_to_either_replica(browser: Any, replicas: Replicas) -> None:
    near, far = replicas.servers
    job = SimJob(replicas.api, near.token or "", "gpu-replica01", process_body("gpu-replica01", host="node-r")).start()
    try:
        page = Dashboard(browser, Front(replicas.front.url, near.token))
        page.open()
        page.wait_cell(job.process_id, "Status", "RUNNING")
        for server, verb, status in ((far, "pause", "PAUSED"), (near, "resume", "RUNNING"), (far, "pause", "PAUSED")):
            done = server.cli(verb, job.process_id)
            assert done.returncode == 0, done.stdout + done.stderr
            page.wait_cell(job.process_id, "Status", status)
        page.assert_console_clean()
    finally:
        job.close()
