"""Whose GPU report a host's GPU shows (issue 41 item 6): a token's report never makes a GPU look
sicker than another token's fresh report of it, so one token cannot refuse a host's GPUs as
targets to the jobs that report them well; a token may say its own GPU went bad, and another's
report is taken once the healthier one is old."""

from __future__ import annotations

from flexium import wire
from flexium.server import storage
from flexium.server.db import Database
from flexium.server.storage.devices import upsert_devices
from support.server import Api, gpu, process_body

NOW = 1_800_000_000.0
FRESH = 30.0


def _report(db: Database, ws: int, reporter: int, health: str, now: float, used: int = 0) -> None:
    devices = [wire.GpuReport.model_validate(gpu(0, health=health, used=used))]
    db.run(
        upsert_devices, write=True, workspace_id=ws, host="node1", devices=devices, now=now, reporter=reporter,
        fresh_for=FRESH,
    )  # fmt: skip


def _shown(db: Database, ws: int, now: float) -> tuple[str, int]:
    listed = db.run(storage.list_devices, write=False, workspace_id=ws, now=now, stale_after=FRESH)
    device = listed.hosts[0].devices[0]
    return device.health, device.memory_used


def test_another_tokens_fresh_healthier_report_stands(db: Database) -> None:
    ws = db.run(storage.create_workspace, write=True, name="team", now=NOW)[0].id
    _report(db, ws, reporter=1, health="ok", now=NOW)
    _report(db, ws, reporter=2, health="xid 79", now=NOW + 1, used=5)
    assert _shown(db, ws, NOW + 1) == ("ok", 0)  # token 1's report, untouched
    _report(db, ws, reporter=2, health="ok", now=NOW + 2, used=7)
    assert _shown(db, ws, NOW + 2) == ("ok", 7)  # as healthy: taken
    _report(db, ws, reporter=2, health="xid 79", now=NOW + 3)
    assert _shown(db, ws, NOW + 3) == ("xid 79", 0)  # its own report: it may say its GPU went bad
    _report(db, ws, reporter=1, health="ok", now=NOW + 4)
    _report(db, ws, reporter=2, health="unknown", now=NOW + 5)
    assert _shown(db, ws, NOW + 5)[0] == "ok"
    _report(db, ws, reporter=2, health="xid 79", now=NOW + 4 + FRESH + 1)
    assert _shown(db, ws, NOW + 4 + FRESH + 1)[0] == "xid 79"  # token 1's report grew old


def test_a_job_token_cannot_make_another_jobs_gpus_look_sick(api: Api) -> None:
    tokens = [api.post("/tokens", {"name": n, "role": "job"}).json()["token"] for n in ("well", "liar")]
    well = process_body("well", devices=[gpu(0), gpu(1)])
    assert api.post("/processes", well, headers=api.headers(tokens[0])).status_code == 201
    liar = process_body("liar", devices=[gpu(0, health="xid 79"), gpu(1, health="xid 79")])
    assert api.post("/processes", liar, headers=api.headers(tokens[1])).status_code == 201
    health = [d["health"] for d in api.get("/devices").json()["hosts"][0]["devices"]]
    assert health == ["ok", "ok"]
