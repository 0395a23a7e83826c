"""The HTTP API through FastAPI's TestClient (in-process ASGI), on SQLite and PostgreSQL."""

from __future__ import annotations

import json
import threading
import time
from typing import Any

import pytest

from flexium import protocol, wire
from support.server import GIB, Api, gpu, process_body, table_snapshot


def _error(r: Any, status: int, code: str | None = None) -> dict[str, Any]:
    assert r.status_code == status, r.text
    body = r.json()
    assert isinstance(body.get("message"), str) and body["message"], body
    if code:
        assert body["error"] == code, body
    return body


# --- system ---------------------------------------------------------------------------------


def test_healthz_metrics_openapi(api: Api) -> None:
    r = api.client.get("/healthz")
    assert r.status_code == 200 and r.json()["status"] == "ok"
    api.register()
    assert api.command("pause").status_code == 201
    text = api.client.get("/metrics", headers=api.headers()).text
    for series in (
        'flexium_processes{state="RUNNING"} 1.0',
        'flexium_processes{state="STALE"} 0.0',
        'flexium_commands{state="queued"} 1.0',
        "flexium_migration_duration_seconds_bucket",
        "flexium_schema_migration_duration_seconds_count 1.0",
        "flexium_command_delivery_seconds",
        'flexium_commands_created_total{kind="pause"} 1.0',
    ):
        assert series in text, series
    for line in text.splitlines():
        if line and not line.startswith("#"):
            assert line.startswith("flexium_"), line
    spec = api.client.get("/openapi.json").json()
    paths = spec["paths"]
    assert "/api/w/{workspace}/commands" in paths and "/api/w/{workspace}/processes/{process_id}/commands/next" in paths
    # the served OpenAPI is the reference of the bodies: the models of flexium.wire
    schemas = spec["components"]["schemas"]
    assert {
        "RegisterRequest",
        "HeartbeatRequest",
        "CommandRequest",
        "CommandReport",
        "ProcessInfo",
        "CommandInfo",
        "DevicesResponse",
        "TargetInfo",
    } <= set(schemas)
    assert "target_uuid" in schemas["CommandInfo"]["properties"]
    assert not {"target_index", "target_device"} & set(schemas["CommandInfo"]["properties"])


def test_unknown_endpoint_is_json_404(api: Api) -> None:
    _error(api.client.get("/api/nothing"), 404, "not_found")
    _error(api.client.put(api.base + "/processes", headers=api.headers()), 405, "bad_request")


# --- auth -----------------------------------------------------------------------------------

PROTECTED = [
    ("GET", ""),
    ("GET", "/processes"),
    ("GET", "/processes/gpu-1"),
    ("POST", "/processes"),
    ("POST", "/processes/gpu-1/heartbeat"),
    ("GET", "/processes/gpu-1/commands/next?wait=0"),
    ("DELETE", "/processes/gpu-1"),
    ("GET", "/processes/gpu-1/targets"),
    ("GET", "/commands"),
    ("POST", "/commands"),
    ("GET", "/commands/1"),
    ("POST", "/commands/1/report"),
    ("GET", "/devices"),
    ("GET", "/tokens"),
    ("POST", "/tokens"),
    ("DELETE", "/tokens/1"),
    ("GET", "/audit"),
    ("GET", "/events"),
]


@pytest.mark.parametrize("method,path", PROTECTED)
def test_every_endpoint_needs_a_token(api: Api, method: str, path: str) -> None:
    api.register()
    cmd = api.command("pause").json()
    assert cmd["id"] == 1
    before = table_snapshot(api.db)
    body = {"kind": "pause", "process_id": "gpu-1"} if method == "POST" else None
    for headers, challenge in (
        ({}, 'Bearer realm="flexium"'),
        ({"Authorization": "Bearer flx_wrong"}, 'Bearer realm="flexium", error="invalid_token"'),
        ({"Authorization": "Basic abc"}, 'Bearer realm="flexium", error="invalid_request"'),
        ({"Authorization": "Bearer " + "x" * 5000}, 'Bearer realm="flexium", error="invalid_token"'),
        ({"Authorization": "Bearer"}, 'Bearer realm="flexium", error="invalid_request"'),
    ):
        r = api.client.request(method, api.base + path, headers=headers, json=body)
        err = _error(r, 401, "unauthorized")
        assert "gpu-1" not in r.text and "node1" not in r.text, err
        # RFC 6750: the scheme to use, and what was wrong with a token that was sent
        said = r.headers["WWW-Authenticate"]
        assert said == challenge or said.startswith(challenge + ", error_description="), (headers, said)
    assert table_snapshot(api.db) == before


@pytest.mark.parametrize("method,path", PROTECTED)
def test_other_workspace_token_gets_404_and_nothing_leaks(api: Api, method: str, path: str) -> None:
    api.register()
    api.command("pause")
    other = api.post("/tokens", {"name": "x", "role": "admin"}).json()["token"]  # sanity: same workspace works
    assert api.get("/processes", headers=api.headers(other)).status_code == 200
    token_b = _create_workspace(api, "team-b")
    before = table_snapshot(api.db)
    body = {"kind": "pause", "process_id": "gpu-1"} if method == "POST" else None
    r = api.client.request(method, api.base + path, headers=api.headers(token_b), json=body)
    _error(r, 404, "not_found")
    assert "gpu-1" not in r.text and "node1" not in r.text
    assert table_snapshot(api.db) == before
    # and in its own workspace it sees nothing of the first one
    b = Api(api.client, token_b, "team-b")
    assert b.get("/processes").json() == [] and b.get("/commands").json() == []
    assert b.get("/devices").json() == {"hosts": []}
    _error(b.get("/processes/gpu-1"), 404, "not_found")
    _error(b.get("/commands/1"), 404, "not_found")
    _error(b.post("/commands/1/report", {"state": "running"}), 404, "not_found")


def _create_workspace(api: Api, name: str) -> str:
    from flexium.server import storage

    _row, token = api.db.run(storage.create_workspace, write=True, name=name, now=time.time())
    return token


def test_unknown_workspace_is_404_not_401(api: Api) -> None:
    _error(api.client.get("/api/w/nope/processes", headers=api.headers()), 404, "not_found")


def test_revoked_token_refused_at_once(api: Api) -> None:
    created = api.post("/tokens", {"name": "laptop", "role": "viewer"})
    assert created.status_code == 201
    new = created.json()
    assert new["token"].startswith("flx_") and new["name"] == "laptop" and new["role"] == "viewer"
    assert api.get("/processes", headers=api.headers(new["token"])).status_code == 200
    listed = api.get("/tokens").json()
    assert all("token" not in t for t in listed) and len(listed) == 2
    assert api.delete(f"/tokens/{new['id']}").json()["revoked"] is True
    _error(api.get("/processes", headers=api.headers(new["token"])), 401, "unauthorized")
    _error(api.delete("/tokens/999"), 404, "not_found")


def test_a_process_whose_token_is_revoked_says_so(api: Api) -> None:
    """It trains on but can no longer report: the revocation names it, and so does every listing."""
    job = api.post("/tokens", {"name": "rack 3", "role": "job"}).json()
    other = api.post("/tokens", {"name": "rack 4", "role": "job"}).json()
    for process_id, token in (("gpu-r3a", job), ("gpu-r3b", job), ("gpu-r4a", other)):
        body = process_body(process_id)
        assert api.post("/processes", body, headers=api.headers(token["token"])).status_code == 201
    assert not any(p["token_revoked"] for p in api.get("/processes").json())

    before = api.ctx.bus.last_id
    revoked = api.delete(f"/tokens/{job['id']}").json()
    assert revoked["processes"] == ["gpu-r3a", "gpu-r3b"]
    # Dashboards hear it at once, not when the processes next go stale.
    told = [
        (data["process"]["process_id"], data["process"]["token_revoked"])
        for kind, data in api.events(before)
        if kind == protocol.EVENT_PROCESS
    ]
    assert told == [("gpu-r3a", True), ("gpu-r3b", True)]
    shown = {p["process_id"]: p["token_revoked"] for p in api.get("/processes").json()}
    assert shown == {"gpu-r3a": True, "gpu-r3b": True, "gpu-r4a": False}
    assert api.get("/processes/gpu-r3a").json()["token_revoked"] is True
    assert api.get("/processes/gpu-r4a").json()["token_revoked"] is False
    [page] = api.pages("/")
    assert page.count("its token was revoked") == 2


def test_cookie_auth_needs_csrf_header_for_writes(api: Api) -> None:
    client = api.client
    r = client.post(
        "/login",
        content=f"token={api.token}",
        headers={"Content-Type": "application/x-www-form-urlencoded"},
        follow_redirects=False,
    )
    assert r.status_code == 303 and protocol.SESSION_COOKIE in r.headers["set-cookie"]
    assert api.token not in r.headers["set-cookie"]  # the cookie holds a session's id, never the token
    try:
        assert client.get(api.base + "/processes").status_code == 200
        body = process_body()
        _error(client.post(api.base + "/processes", json=body), 403, "forbidden")
        assert client.post(api.base + "/processes", json=body, headers={protocol.CSRF_HEADER: "1"}).status_code == 201
        page = client.get("/")
        assert page.status_code == 200 and "gpu-1" in page.text
    finally:
        client.cookies.clear()
    assert client.get("/", follow_redirects=False).status_code == 303
    r = client.post("/login", content="token=flx_bad", headers={"Content-Type": "application/x-www-form-urlencoded"})
    assert r.status_code == 401 and "invalid" in r.text


# --- processes ------------------------------------------------------------------------------


def test_register_heartbeat_unregister(api: Api) -> None:
    r = api.post("/processes", process_body())
    assert r.status_code == 201
    reg = r.json()
    assert reg["process"]["state"] == "RUNNING" and reg["heartbeat_interval_s"] > 0
    assert reg["poll_timeout_s"] > 0 and reg["stale_after_s"] > reg["heartbeat_interval_s"]
    assert api.post("/processes", process_body()).status_code == 200  # re-register
    hb = api.post("/processes/gpu-1/heartbeat", {"memory_bytes": 11 * GIB, "state": "RUNNING"}).json()
    assert hb["ok"] and hb["pending_command"] is None
    assert api.get("/processes/gpu-1").json()["memory_bytes"] == 11 * GIB
    assert (
        api.get(
            "/",
        ).status_code
        == 200
    )
    assert api.get("").json()["processes"] == 1
    assert api.delete("/processes/gpu-1").status_code == 204
    _error(api.post("/processes/gpu-1/heartbeat", {}), 404, "not_found")  # -> the client registers again
    _error(api.delete("/processes/gpu-1"), 404, "not_found")


def test_list_filters(api: Api) -> None:
    api.register("a")
    api.register("b", host="node2", state="PAUSED", gpu_index=1)
    assert [p["process_id"] for p in api.get("/processes?state=PAUSED").json()] == ["b"]
    assert [p["process_id"] for p in api.get("/processes?host=node2").json()] == ["b"]
    assert [p["process_id"] for p in api.get("/processes?gpu=GPU-0000").json()] == ["a"]
    _error(api.get("/processes?state=BOGUS"), 422, "invalid_request")
    hosts = api.get("/devices").json()["hosts"]
    assert [h["host"] for h in hosts] == ["node1", "node2"] and len(hosts[0]["devices"]) == 4
    assert api.get("/devices?host=node2").json()["hosts"][0]["host"] == "node2"


# --- commands -------------------------------------------------------------------------------


def test_command_lifecycle_over_http(api: Api) -> None:
    api.register()
    r = api.command("migrate", target="GPU-0002")
    assert r.status_code == 201
    cmd = r.json()
    hb = api.post("/processes/gpu-1/heartbeat", {}).json()
    assert hb["pending_command"] == cmd["id"]
    got = api.get("/processes/gpu-1/commands/next?wait=0")
    assert got.status_code == 200 and got.json()["id"] == cmd["id"] and got.json()["state"] == "delivered"
    assert api.post(f"/commands/{cmd['id']}/report", {"state": "running"}).json()["state"] == "running"
    assert api.get("/processes/gpu-1").json()["state"] == "MIGRATING"
    assert api.get("/processes/gpu-1/commands/next?wait=0").status_code == 204
    result = {
        "kind": "migrate",
        "path": "driver",
        "ok": True,
        "seconds": 1.1,
        "steps": [{"step": "checkpoint", "seconds": 0.5, "ok": True}],
    }
    done = api.post(f"/commands/{cmd['id']}/report", {"state": "succeeded", "result": result}).json()
    # Stored and served as the typed result: what the process sent, every other field at its default.
    assert done["state"] == "succeeded" and done["result"] == wire.OperationReport.model_validate(result).model_dump()
    assert done["result"]["path"] == "driver" and done["result"]["seconds"] == 1.1 and done["result"]["error"] is None
    assert done["result"]["steps"] == [
        {"step": "checkpoint", "seconds": 0.5, "ok": True, "rollback": False, "error": None}
    ]
    proc = api.get("/processes/gpu-1").json()
    assert proc["state"] == "RUNNING" and proc["gpu_uuid"] == "GPU-0002" and proc["active_command"] is None
    assert api.get(f"/commands/{cmd['id']}").json()["state"] == "succeeded"
    assert [c["id"] for c in api.get("/commands?process_id=gpu-1").json()] == [cmd["id"]]
    row, listed = api.pages("/ui/processes?id=gpu-1", "/ui/commands")
    assert '<span class="outcome-path muted">driver path</span>' in row  # which path the move took
    assert '<span class="cmd-path muted">driver path</span>' in listed
    assert "migrate → GPU 2" in listed  # the index shown is derived from the UUID the command holds
    metrics = api.client.get("/metrics", headers=api.headers()).text
    assert 'flexium_commands_finished_total{kind="migrate",outcome="succeeded"} 1.0' in metrics
    assert 'flexium_migration_duration_seconds_count{kind="migrate",outcome="succeeded"} 1.0' in metrics


@pytest.mark.parametrize(
    "body,status,code",
    [
        ({"kind": "migrate", "process_id": "nope", "target": 1}, 404, "not_found"),
        ({"kind": "migrate", "process_id": "gpu-1", "target": "GPU-0000"}, 422, "target_refused"),
        ({"kind": "migrate", "process_id": "gpu-1", "target": 2}, 422, "target_refused"),  # A100
        ({"kind": "migrate", "process_id": "gpu-1", "target": 99}, 422, "target_refused"),
        ({"kind": "migrate", "process_id": "gpu-1", "target": "GPU-other-host"}, 422, "target_refused"),
        ({"kind": "migrate", "process_id": "gpu-1"}, 422, "invalid_request"),
        ({"kind": "resume", "process_id": "gpu-1"}, 409, "invalid_state"),
        ({"kind": "pause", "process_id": "paused"}, 409, "invalid_state"),
        ({"kind": "migrate", "process_id": "paused", "target": 3}, 409, "invalid_state"),
        ({"kind": "migrate", "process_id": "old", "target": 3}, 422, "capability"),
        ({"kind": "pause", "process_id": "ancient"}, 422, "capability"),
        ({"kind": "teleport", "process_id": "gpu-1"}, 422, "invalid_request"),
        ({"kind": "pause", "process_id": "gpu-1", "target": True}, 422, "invalid_request"),
        ({"kind": "pause", "process_id": "gpu-1", "target": [1]}, 422, "invalid_request"),
    ],
)
def test_command_refusals(api: Api, body: dict[str, Any], status: int, code: str) -> None:
    devices = [gpu(0, used=10 * GIB), gpu(1, used=139 * GIB), gpu(2, name="NVIDIA A100"), gpu(3)]
    api.register("gpu-1", devices=devices)
    api.register("paused", state="PAUSED", devices=devices)
    api.register("old", migration=False, devices=devices)
    api.register("ancient", migration=False, pause_resume=False, devices=devices)
    api.register("far", host="node9", devices=[{**gpu(0), "uuid": "GPU-other-host"}])
    before = table_snapshot(api.db)
    _error(api.post("/commands", body), status, code)
    assert table_snapshot(api.db) == before


def test_targets_judged_by_the_rules_commands_obey(api: Api) -> None:
    devices = [
        gpu(0, used=10 * GIB),
        gpu(1, used=139 * GIB),
        gpu(2, name="NVIDIA A100"),
        gpu(3),
        gpu(4, health="xid 79"),
    ]
    api.register("gpu-1", devices=devices)
    r = api.get("/processes/gpu-1/targets")
    assert r.status_code == 200, r.text
    judged = {t["device"]["uuid"]: t["refusal"] for t in r.json()}
    assert list(judged) == [d["uuid"] for d in devices]
    assert judged["GPU-0000"] == "the job is already on it" and judged["GPU-0003"] is None
    assert "free" in judged["GPU-0001"] and "NVIDIA A100" in judged["GPU-0002"]
    assert judged["GPU-0004"] == "health: xid 79"
    # the API refuses exactly what it judged, but room by a report older than the command: the job
    # judges that (the one that is sent last: it takes the command)
    fits = {uuid for uuid, refusal in judged.items() if refusal is None or "the job needs 10.0 GiB" in refusal}
    assert fits == {"GPU-0001", "GPU-0003"}
    for uuid, refusal in sorted(judged.items(), key=lambda item: item[0] in fits):
        answer = api.command("migrate", target=uuid)
        if uuid in fits:
            assert answer.status_code == 201, answer.text
            break
        assert answer.status_code == 422 and refusal in answer.json()["message"], answer.text
    resume = {t["device"]["uuid"]: t["refusal"] for t in api.get("/processes/gpu-1/targets?kind=resume").json()}
    assert resume["GPU-0000"] is None
    _error(api.get("/processes/gpu-1/targets?kind=pause"), 422, "invalid_request")
    _error(api.get("/processes/nope/targets"), 404, "not_found")


def test_failed_process_refuses_commands_and_shows_red(api: Api) -> None:
    api.register("gpu-1")
    r = api.post("/processes/gpu-1/heartbeat", {"state": "FAILED", "memory_bytes": 0})
    assert r.status_code == 200, r.text
    proc = api.get("/processes/gpu-1").json()
    assert proc["state"] == "FAILED"
    assert [p["process_id"] for p in api.get("/processes?state=FAILED").json()] == ["gpu-1"]
    for kind, target in (("migrate", 1), ("pause", None), ("resume", None)):
        body = _error(api.command(kind, target=target), 409, "invalid_state")
        assert "an earlier rollback failed; restart the job" in body["message"]
    [row] = api.pages("/ui/processes?id=gpu-1")
    assert 'class="badge badge-failed"' in row and "restart the job" in row
    assert not any(f'data-action="{kind}"' in row for kind in ("migrate", "pause", "resume"))


def test_a_job_without_the_fast_path_shows_why(api: Api) -> None:
    caps = {
        protocol.CAP_PAUSE_RESUME: True,
        protocol.CAP_MIGRATION: True,
        protocol.CAP_FAST_PATH: False,
        protocol.CAP_FAST_PATH_PROBLEM: "CUDA memory was allocated before flexium.init() <early>",
    }
    api.register("gpu-1", capabilities=caps)
    api.register("gpu-2", capabilities={**caps, protocol.CAP_FAST_PATH: True, protocol.CAP_FAST_PATH_PROBLEM: None})
    slow, fast = api.pages("/ui/processes?id=gpu-1", "/ui/processes?id=gpu-2")
    assert (
        '<small class="muted driver-only" title="CUDA memory was allocated before flexium.init() &lt;early&gt;">'
        "driver path only</small>"
    ) in slow
    assert "driver path only" not in fast


def test_buttons_a_job_cannot_use_say_why(api: Api) -> None:
    problems = [
        "torch 2.13.0+cpu is a CPU-only build: training runs, migration and pause are off",
        "no NVIDIA driver <libcuda>",
    ]
    api.register(
        "gpu-1", capabilities={protocol.CAP_PAUSE_RESUME: False, protocol.CAP_MIGRATION: False, "problems": problems}
    )
    api.register("gpu-2", capabilities={protocol.CAP_PAUSE_RESUME: True, protocol.CAP_MIGRATION: False})
    cpu, old_driver = api.pages("/ui/processes?id=gpu-1", "/ui/processes?id=gpu-2")
    why = (
        "torch 2.13.0+cpu is a CPU-only build: training runs, migration and pause are off; "
        "no NVIDIA driver &lt;libcuda&gt;"
    )
    assert cpu.count(f'disabled title="{why}"') == 2  # Migrate and Pause
    assert 'disabled title="This job&#39;s driver cannot migrate (needs driver 580+)"' in old_driver
    assert 'data-action="pause"' in old_driver and old_driver.count("disabled") == 1


def test_a_heartbeat_older_than_the_final_report_changes_nothing(api: Api) -> None:
    api.register("gpu-1", seq=10)
    cmd = api.command("pause").json()
    assert api.get("/processes/gpu-1/commands/next?wait=0").status_code == 200
    assert api.post(f"/commands/{cmd['id']}/report", {"state": "running"}).status_code == 200
    final = {"state": "succeeded", "process": {"state": "PAUSED", "memory_bytes": 0, "seq": 30}}
    assert api.post(f"/commands/{cmd['id']}/report", final).status_code == 200
    # built during the pause (seq 20), delivered after the report: the process stays PAUSED
    for _ in range(2):  # the second goes through the in-memory shortcut's check too
        r = api.post("/processes/gpu-1/heartbeat", {"state": "PAUSING", "memory_bytes": 10 * GIB, "seq": 20})
        assert r.status_code == 200, r.text
        proc = api.get("/processes/gpu-1").json()
        assert proc["state"] == "PAUSED" and proc["memory_bytes"] == 0, proc
    assert api.post("/processes/gpu-1/heartbeat", {"state": "PAUSED", "seq": 40}).status_code == 200
    assert api.get("/processes/gpu-1").json()["state"] == "PAUSED"
    # newer ones apply; one without seq (an older client) applies as it comes
    assert api.post("/processes/gpu-1/heartbeat", {"state": "RUNNING", "seq": 50}).status_code == 200
    assert api.get("/processes/gpu-1").json()["state"] == "RUNNING"
    assert api.post("/processes/gpu-1/heartbeat", {"state": "PAUSED"}).status_code == 200
    assert api.get("/processes/gpu-1").json()["state"] == "PAUSED"
    _error(api.post("/processes/gpu-1/heartbeat", {"seq": "7"}), 422, "invalid_request")


def test_the_location_shown_is_derived_from_the_gpu_uuid_alone(api: Api) -> None:
    """An older client still sends gpu_index and physical_device: ignored, not refused, and its
    plain heartbeats are still answered from memory (the derived fields are compared nowhere)."""
    body = process_body("gpu-1", gpu_index=2, visible_gpus=["GPU-0002", "GPU-0000", "GPU-0001", "GPU-0003"])
    r = api.post("/processes", {**body, "gpu_index": 7, "physical_device": "cuda:7"})
    assert r.status_code == 201, r.text
    shown = r.json()["process"]
    assert (shown["gpu_uuid"], shown["gpu_index"], shown["physical_device"]) == ("GPU-0002", 2, "cuda:0")
    api.ctx.beats.clear()
    beat = {
        "state": "RUNNING",
        "memory_bytes": 10 * GIB,
        "gpu_uuid": "GPU-0002",
        "gpu_index": 9,
        "physical_device": "x",
    }
    assert api.post("/processes/gpu-1/heartbeat", beat).status_code == 200
    assert api.ctx.beats  # from memory: nothing changed
    api.ctx.beats.clear()
    assert api.post("/processes/gpu-1/heartbeat", {**beat, "gpu_uuid": "GPU-0003"}).status_code == 200
    assert not api.ctx.beats  # a move is written through
    proc = api.get("/processes/gpu-1").json()
    assert (proc["gpu_uuid"], proc["gpu_index"], proc["physical_device"]) == ("GPU-0003", 3, "cuda:3")
    # no engine, no GPU: what the training code names is what it runs on
    cpu = process_body("cpu-job", gpu_uuid=None, logical_device="cpu", visible_gpus=[])
    assert api.post("/processes", cpu).json()["process"]["physical_device"] == "cpu"
    assert api.get("/processes/cpu-job").json()["gpu_index"] is None


@pytest.mark.parametrize(
    "target,code,message",
    [
        ("²", "invalid_request", "target '²' is not a GPU name"),  # str.isdigit() says yes, int() says no
        ("cuda:²", "invalid_request", "is not cuda:N"),
        ("cuda:١", "invalid_request", "is not cuda:N"),  # an Arabic-Indic one
    ],
)
def test_digits_that_are_not_ascii_are_refused_not_a_500(api: Api, target: str, code: str, message: str) -> None:
    api.register()
    assert message in _error(api.command("migrate", target=target), 422, code)["message"]


def test_one_active_command_409(api: Api) -> None:
    api.register()
    first = api.command("pause").json()
    body = _error(api.command("migrate", target=3), 409, "busy")
    assert body["detail"] == {"command_id": first["id"]}


def test_command_wait_returns_when_finished(api: Api) -> None:
    api.register()
    cmd = api.command("pause").json()

    def finish() -> None:
        time.sleep(0.3)
        api.post(f"/commands/{cmd['id']}/report", {"state": "succeeded"})

    t = threading.Thread(target=finish)
    start = time.monotonic()
    t.start()
    r = api.get(f"/commands/{cmd['id']}?wait=10")
    t.join()
    # Answered when the report came (0.3 s), not at the end of the 10 s wait: half of it leaves room
    # for a machine shared with other work.
    assert r.json()["state"] == "succeeded" and time.monotonic() - start < 5
    start = time.monotonic()
    assert api.get(f"/commands/{cmd['id']}?wait=10").json()["state"] == "succeeded"
    assert time.monotonic() - start < 5  # an ended command is answered at once, not after the wait


def test_long_poll_wakes_on_command(api: Api) -> None:
    api.register()
    out: dict[str, Any] = {}

    def poll() -> None:
        r = api.get("/processes/gpu-1/commands/next?wait=20")
        out["received"] = time.monotonic()
        out["response"] = r

    t = threading.Thread(target=poll)
    t.start()
    time.sleep(0.5)  # the poll is waiting
    created = time.monotonic()
    assert api.command("pause").status_code == 201
    t.join(10)
    assert out["response"].status_code == 200 and out["response"].json()["kind"] == "pause"
    assert out["received"] - created < 5  # at once, not at the end of the 20 s wait (room for a loaded machine)


def test_long_poll_times_out_with_204(api: Api) -> None:
    api.register()
    start = time.monotonic()
    r = api.get("/processes/gpu-1/commands/next?wait=0.3")
    assert r.status_code == 204 and 0.25 < time.monotonic() - start < 5
    _error(api.get("/processes/nope/commands/next?wait=0"), 404, "not_found")
    _error(api.get("/processes/gpu-1/commands/next?wait=999"), 422, "invalid_request")


# --- bad input ------------------------------------------------------------------------------

BAD_REGISTRATIONS = [
    ("not json", '{"process_id": ', 400, "bad_request"),
    ("a list", [], 422, "invalid_request"),
    ("no host", {"process_id": "gpu-1"}, 422, "invalid_request"),
    ("pid as string", {**process_body(), "pid": "4242"}, 422, "invalid_request"),
    ("negative memory", {**process_body(), "memory_bytes": -1}, 422, "invalid_request"),
    ("huge memory", {**process_body(), "memory_bytes": 10**30}, 422, "invalid_request"),
    ("float memory", {**process_body(), "memory_bytes": 1.5}, 422, "invalid_request"),
    ("bool pid", {**process_body(), "pid": True}, 422, "invalid_request"),
    ("bad state", {**process_body(), "state": "DANCING"}, 422, "invalid_request"),
    ("bad process id", {**process_body(), "process_id": "../../etc"}, 422, "invalid_request"),
    ("NUL in host", {**process_body(), "host": "node\x001"}, 422, "invalid_request"),
    ("long host", {**process_body(), "host": "h" * 300}, 422, "invalid_request"),
    ("NaN start", "NAN_START", 422, "invalid_request"),
    (
        "deep capabilities",
        {**process_body(), "capabilities": json.loads('{"a":' * 20 + "1" + "}" * 20)},
        422,
        "invalid_request",
    ),
    ("NUL in capabilities", {**process_body(), "capabilities": {"x": "a\x00b"}}, 422, "invalid_request"),
    # What Python keeps of a non-UTF-8 argument or file name: a lone surrogate has no UTF-8.
    ("lone surrogate in cmdline", {**process_body(), "cmdline": "train.py donn\udce9es.csv"}, 422, "invalid_request"),
    (
        "lone surrogate in a problem",
        {**process_body(), "capabilities": {"problems": ["\udcff"]}},
        422,
        "invalid_request",
    ),
    ("lone surrogate in a key", {**process_body(), "capabilities": {"\ud800": 1}}, 422, "invalid_request"),
    ("device without uuid", {**process_body(), "devices": [{"index": 0}]}, 422, "invalid_request"),
    ("device bad index", {**process_body(), "devices": [{**gpu(0), "index": -3}]}, 422, "invalid_request"),
    ("device utilization 500", {**process_body(), "devices": [{**gpu(0), "utilization": 500}]}, 422, "invalid_request"),
    ("too many devices", {**process_body(), "devices": [gpu(i) for i in range(100)]}, 422, "invalid_request"),
    ("devices not a list", {**process_body(), "devices": {"uuid": "GPU-1"}}, 422, "invalid_request"),
]


@pytest.mark.parametrize("name,body,status,code", BAD_REGISTRATIONS, ids=[b[0] for b in BAD_REGISTRATIONS])
def test_bad_registration_refused_database_unchanged(api: Api, name: str, body: Any, status: int, code: str) -> None:
    api.register("existing")
    before = table_snapshot(api.db)
    headers = {**api.headers(), "Content-Type": "application/json"}
    if body == "NAN_START":
        content = json.dumps(process_body(), allow_nan=True)[:-1] + ', "started_at": NaN}'
    elif isinstance(body, str):
        content = body
    else:
        content = json.dumps(body)
    r = api.client.post(api.base + "/processes", content=content, headers=headers)
    _error(r, status, code)
    assert table_snapshot(api.db) == before


def test_text_stored_before_it_was_checked_never_breaks_a_list(api: Api) -> None:
    """A workspace holding a lone surrogate in a process's capabilities and a command's result
    (what requests could store on SQLite before text was checked; PostgreSQL's jsonb refuses it)
    still lists, pages and reads."""
    from sqlalchemy import exc, text

    api.register()
    command = api.command("pause").json()
    bad = '{"problems": ["\\udcff"], "pause_resume": true}'
    if api.db.engine.dialect.name == "postgresql":
        with pytest.raises(exc.DataError, match="Unicode"), api.db.engine.begin() as conn:
            conn.execute(text("UPDATE processes SET capabilities = CAST(:bad AS JSONB)"), {"bad": bad})
        return
    with api.db.engine.begin() as conn:
        conn.execute(text("UPDATE processes SET capabilities = :bad"), {"bad": bad})
        conn.execute(text("UPDATE commands SET result = :bad"), {"bad": '{"error": "\\udcff"}'})
    listed = api.get("/processes")
    assert listed.status_code == 200, listed.text
    assert listed.json()[0]["capabilities"]["pause_resume"] is False  # unreadable: taken as none
    assert api.get(f"/commands/{command['id']}").status_code == 200
    assert api.get("/commands").status_code == 200
    assert all(page for page in api.pages("/ui/processes", "/ui/commands"))


def test_huge_bodies_413(api: Api) -> None:
    api.register()
    before = table_snapshot(api.db)
    big = json.dumps({**process_body(), "cmdline": "x" * (2 << 20)})
    r = api.client.post(
        api.base + "/processes", content=big, headers={**api.headers(), "Content-Type": "application/json"}
    )
    _error(r, 413, "payload_too_large")

    def chunks() -> Any:
        for _ in range(40):
            yield b"x" * 65536

    r = api.client.post(
        api.base + "/processes/gpu-1/heartbeat",
        content=chunks(),
        headers={**api.headers(), "Content-Type": "application/json"},
    )
    _error(r, 413, "payload_too_large")
    assert table_snapshot(api.db) == before


def test_bad_reports_and_ids(api: Api) -> None:
    api.register()
    cmd = api.command("pause").json()
    before = table_snapshot(api.db)
    cases = [
        (api.post(f"/commands/{cmd['id']}/report", {"state": "queued"}), 422),
        (
            api.post(
                f"/commands/{cmd['id']}/report", {"state": "succeeded", "result": {"seconds": "NaN", "x": [1] * 1000}}
            ),
            422,
        ),
        (api.post(f"/commands/{cmd['id']}/report", {"state": "failed", "error": "e" * 10_000}), 422),
        (api.post(f"/commands/{cmd['id']}/report", {"state": "failed", "process": {"state": "LOST"}}), 422),
        (api.post("/commands/999999/report", {"state": "running"}), 404),
        (api.post("/commands/99999999999999999999/report", {"state": "running"}), 422),
        (api.post("/commands/-1/report", {"state": "running"}), 422),
        (api.post("/commands/abc/report", {"state": "running"}), 422),
        (api.get("/commands/0"), 422),
        (api.get("/commands/999"), 404),
        (api.get("/commands?limit=0"), 422),
        (api.get("/commands?limit=abc"), 422),
        (api.get("/commands?state=lost"), 422),
        (api.get("/processes/" + "x" * 300), 422),
        (api.get("/processes/%00"), 422),
        (api.get("/processes?host=a%00b"), 422),
        (api.get("/commands?process_id=a%00b"), 422),
        (api.post("/processes/gpu-1/heartbeat", {"memory_bytes": "lots"}), 422),
        (api.post("/processes/gpu-1/heartbeat", {"devices": [{"uuid": ""}]}), 422),
        (api.post("/processes/gpu-1/heartbeat", {"state": "PAUSED\x00"}), 422),
        (api.delete("/tokens/abc"), 422),
        (api.post("/tokens", {"name": 5}), 422),
        (
            api.client.post(
                api.base + "/commands",
                content=b"\xff\xfe",
                headers={**api.headers(), "Content-Type": "application/json"},
            ),
            400,
        ),
        (
            api.client.post(
                api.base + "/commands", content=b"", headers={**api.headers(), "Content-Type": "application/json"}
            ),
            422,
        ),
    ]
    for r, status in cases:
        assert r.status_code == status, (r.request.url, r.text)
        assert r.json()["message"]
    assert table_snapshot(api.db) == before


def test_heartbeat_pending_devices_throttled(api: Api) -> None:
    api.register()
    hb = {"devices": [gpu(0, used=50 * GIB), gpu(1), gpu(2), gpu(3)]}
    assert api.post("/processes/gpu-1/heartbeat", hb).status_code == 200
    # within device_write_interval_s of the registration's report: not written
    assert api.get("/devices").json()["hosts"][0]["devices"][0]["memory_used"] == 10 * GIB
    api.ctx.device_writes.clear()
    assert api.post("/processes/gpu-1/heartbeat", hb).status_code == 200
    assert api.get("/devices").json()["hosts"][0]["devices"][0]["memory_used"] == 50 * GIB


def test_the_heartbeat_after_a_command_ends_writes_its_gpus_at_once(api: Api) -> None:
    """A pause or move changes where the job's memory is: the job's heartbeat right after it ends
    is stored with its GPUs, within device_write_interval_s of the last report or not."""
    api.register()
    moved = {"devices": [gpu(0), gpu(1), gpu(2, used=10 * GIB), gpu(3)]}
    cmd = api.command("migrate", target="GPU-0002").json()
    assert api.get("/processes/gpu-1/commands/next?wait=0").status_code == 200
    assert api.post(f"/commands/{cmd['id']}/report", {"state": "running"}).status_code == 200
    assert api.post("/processes/gpu-1/heartbeat", moved).status_code == 200  # still running: throttled
    assert [d["memory_used"] for d in api.get("/devices").json()["hosts"][0]["devices"]][:3] == [10 * GIB, 0, 0]
    result = {"kind": "migrate", "path": "fast", "ok": True, "seconds": 0.8}
    final = {"state": "succeeded", "result": result, "process": {"state": "RUNNING", "seq": 2000}}
    assert api.post(f"/commands/{cmd['id']}/report", final).status_code == 200
    # A beat older than the final report (its GPUs read while the job was checkpointed: its memory
    # nowhere) is not stored, and leaves the write due for the next.
    during = {"devices": [gpu(0), gpu(1), gpu(2), gpu(3)], "seq": 1999}
    assert api.post("/processes/gpu-1/heartbeat", during).status_code == 200
    assert [d["memory_used"] for d in api.get("/devices").json()["hosts"][0]["devices"]][:3] == [10 * GIB, 0, 0]
    assert api.post("/processes/gpu-1/heartbeat", {**moved, "seq": 2001}).status_code == 200
    assert [d["memory_used"] for d in api.get("/devices").json()["hosts"][0]["devices"]][:3] == [0, 0, 10 * GIB]
