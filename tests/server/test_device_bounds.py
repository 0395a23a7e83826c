"""GPU rows within quotas (issue 41 item 6): one job token once stored 19,202 GPUs (and as many
history samples) in 7 s with a new UUID or a new host name in each report. GPUs per host and
hosts per workspace are capped, each refusal a 409 naming the setting that raises it, and
nothing of a refused report is stored; a host's own GPUs reported again pass at its limit."""

from __future__ import annotations

from typing import Any

import pytest
from sqlalchemy import func, select

from flexium.server.models import Device, GpuSample
from flexium.server.settings import Settings
from support.server import Api, gpu, make_settings, process_body


@pytest.fixture
def app_settings(database_url_at_head: str) -> Settings:
    return make_settings(database_url_at_head, max_gpus_per_host=4, max_hosts=2)


def _gpus(*indexes: int) -> list[dict[str, Any]]:
    return [gpu(i) for i in indexes]


def _stored(api: Api) -> tuple[int, int]:
    with api.db.session(write=False) as s:
        return s.scalar(select(func.count()).select_from(Device)) or 0, s.scalar(
            select(func.count()).select_from(GpuSample)
        ) or 0


def _refused(r: Any, option: str, limit: str) -> str:
    assert r.status_code == 409, r.text
    body = r.json()
    assert body["error"] == "quota_exceeded" and body["detail"]["limit"] == limit
    assert option in body["message"]
    return str(body["message"])


def test_gpus_per_host_are_capped(api: Api) -> None:
    assert api.post("/processes", process_body("p-1", devices=_gpus(0, 1, 2, 3))).status_code == 201
    assert api.post("/processes", process_body("p-1", devices=_gpus(0, 1, 2, 3))).status_code == 200
    message = _refused(
        api.post("/processes", process_body("p-1", devices=_gpus(4, 5))),
        "--max-gpus-per-host or FLEXIUM_MAX_GPUS_PER_HOST",
        "max_gpus_per_host",
    )
    assert message.startswith("host 'node1' would have 6 GPUs, over the limit of 4")
    assert _stored(api) == (4, 4)
    hosts = api.get("/devices").json()["hosts"]
    assert [[d["uuid"] for d in h["devices"]] for h in hosts] == [["GPU-0000", "GPU-0001", "GPU-0002", "GPU-0003"]]


def test_hosts_per_workspace_are_capped(api: Api) -> None:
    for host in ("node1", "node2"):
        r = api.post("/processes", process_body("hopper", host=host, devices=_gpus(0)))
        assert r.status_code in (200, 201), r.text
    message = _refused(
        api.post("/processes", process_body("hopper", host="node3", devices=_gpus(0))),
        "--max-hosts or FLEXIUM_MAX_HOSTS",
        "max_hosts",
    )
    assert message.startswith("the workspace has GPUs of 2 hosts, its limit")
    assert _stored(api) == (2, 2)
    assert api.get("/processes/hopper").json()["host"] == "node2"  # the refused registration changed nothing
    assert api.post("/processes", process_body("other", host="node1", devices=_gpus(0))).status_code == 201
