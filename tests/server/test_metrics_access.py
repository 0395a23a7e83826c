"""Who may read /metrics, and what each reader sees (issue 41 item 3): a viewer's or an admin's
token reads the server's totals and its own workspace's GPUs and jobs, never another
workspace's; a job token, or no token, is refused unless the server serves its totals in public;
and a scrape is answered from what was read at most --metrics-refresh ago, however many come."""

from __future__ import annotations

import asyncio
import time

import httpx
from fastapi.testclient import TestClient
from prometheus_client.parser import text_string_to_metric_families
from sqlalchemy import event

from flexium.server import storage
from flexium.server.app import bootstrap, create_app
from flexium.server.settings import Settings
from support.server import Api, make_settings


def _token(api: Api, role: str) -> str:
    r = api.post("/tokens", {"role": role, "name": f"a {role}"})
    assert r.status_code == 201, r.text
    return str(r.json()["token"])


def _other_workspace(api: Api) -> Api:
    """Workspace team-b with a job registered on its own host."""
    _row, token = api.db.run(storage.create_workspace, write=True, name="team-b", now=time.time())
    other = Api(api.client, token, workspace="team-b")
    other.register("secret-job", host="team-b-node")
    return other


def _series(text: str) -> dict[str, list[dict[str, str]]]:
    found: dict[str, list[dict[str, str]]] = {}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            found.setdefault(sample.name, []).append(sample.labels)
    return found


def test_a_viewer_reads_its_own_workspace_and_the_totals_alone(api: Api) -> None:
    api.register("gpu-1")
    _other_workspace(api)
    viewer = _token(api, "viewer")

    r = api.client.get("/metrics", headers=api.headers(viewer))
    assert r.status_code == 200
    series = _series(r.text)
    assert {labels["workspace"] for labels in series["flexium_job_state"]} == {"default"}
    assert {labels["workspace"] for labels in series["flexium_gpu_memory_total_bytes"]} == {"default"}
    assert "secret-job" not in r.text and "team-b" not in r.text
    # the totals count every workspace's processes: two RUNNING, one of them team-b's
    assert 'flexium_processes{state="RUNNING"} 2.0' in r.text


def test_without_a_token_or_with_a_job_token_metrics_are_refused(api: Api) -> None:
    api.register("gpu-1")
    r = api.client.get("/metrics")
    assert r.status_code == 401
    assert "viewer or admin token" in r.json()["message"] and "--public-metrics" in r.json()["message"]
    assert r.headers["WWW-Authenticate"].startswith("Bearer")
    r = api.client.get("/metrics", headers=api.headers("flx_not-a-token"))
    assert r.status_code == 401 and r.json()["error"] == "unauthorized"
    r = api.client.get("/metrics", headers=api.headers(_token(api, "job")))
    assert r.status_code == 403 and "viewer or admin" in r.json()["message"]


def _serve(settings: Settings) -> tuple[TestClient, Api]:
    app = create_app(settings)
    token = bootstrap(app.state.ctx.db)
    assert token
    client = TestClient(app)
    api = Api(client, token)
    api.db = app.state.ctx.db
    return client, api


def test_public_metrics_are_the_totals_alone(database_url_at_head: str) -> None:
    client, api = _serve(make_settings(database_url_at_head, public_metrics=True))
    with client:
        api.register("gpu-1")
        r = client.get("/metrics")
        assert r.status_code == 200
        assert 'flexium_processes{state="RUNNING"} 1.0' in r.text
        assert "flexium_job_state" not in r.text and "flexium_gpu_memory_total_bytes" not in r.text
        assert "gpu-1" not in r.text and "node1" not in r.text
        # a viewer's token still reads its workspace's series
        assert "flexium_job_state{" in client.get("/metrics", headers=api.headers(_token(api, "viewer"))).text


def test_scrapes_are_answered_from_memory_between_two_reads(database_url_at_head: str) -> None:
    """At most one read of the database per --metrics-refresh, however many scrapes arrive, and
    those arriving together share it; another workspace's scrape reads its own."""
    client, api = _serve(make_settings(database_url_at_head, metrics_refresh_s=60.0))
    with client:
        api.register("gpu-1")
        statements: list[str] = []

        def count(_conn: object, _cursor: object, statement: str, *_rest: object) -> None:
            if "FROM devices" in statement:  # a workspace's series read (not its token's lookup)
                statements.append(statement)

        event.listen(api.db.engine, "before_cursor_execute", count)
        try:

            async def flood() -> list[str]:
                transport = httpx.ASGITransport(app=client.app)
                async with httpx.AsyncClient(transport=transport, base_url="http://server") as scraper:
                    answers = await asyncio.gather(*(scraper.get("/metrics", headers=api.headers()) for _ in range(40)))
                return [a.text for a in answers]

            pages = client.portal.call(flood)
            flood_reads = len(statements)
            assert len(set(pages)) == 1 and "gpu-1" in pages[0]
            api.register("gpu-2")  # within the 60 s: the next scrapes still answer what was read
            statements.clear()
            for _ in range(20):
                page = client.get("/metrics", headers=api.headers()).text
                assert "gpu-1" in page and "gpu-2" not in page
            assert statements == []
            other = _other_workspace(api)
            statements.clear()
            page = client.get("/metrics", headers=api.headers(_token(other, "viewer"))).text
            assert "secret-job" in page and "gpu-1" not in page
            assert 0 < flood_reads == len(statements)  # the 40 scrapes together read as much as this one
        finally:
            event.remove(api.db.engine, "before_cursor_execute", count)
