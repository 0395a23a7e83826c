"""A host's GPUs are reported only by the token with a live process there (issue 41 item 6): an
admin's heartbeat or registration speaking for a job's process, with a GPU report, is refused
before anything changes (its report would be filed under the job's token); without devices it
is taken as before, and the process's own token reports its GPUs. (A report not due for a write,
``--device-write-interval``, is dropped whoever sends it: here every report is due.)"""

from __future__ import annotations

import pytest

from flexium.server.settings import Settings
from support.server import Api, gpu, make_settings, process_body


@pytest.fixture
def app_settings(database_url_at_head: str) -> Settings:
    return make_settings(database_url_at_head, device_write_interval_s=0.001)


def _gpus(api: Api) -> set[str]:
    return {d["uuid"] for host in api.get("/devices").json()["hosts"] for d in host["devices"]}


def test_only_the_processs_own_token_reports_its_hosts_gpus(api: Api) -> None:
    job = api.post("/tokens", {"role": "job", "name": "cluster-a"}).json()["token"]
    assert api.post("/processes", process_body("gpu-1"), headers=api.headers(job)).status_code == 201
    before = _gpus(api)
    forged = {"devices": [gpu(9)]}

    r = api.post("/processes/gpu-1/heartbeat", forged)  # the admin's token: no process on node1
    assert r.status_code == 403 and "node1" in r.json()["message"] and "own token" in r.json()["message"]
    r = api.post("/processes", process_body("gpu-1", devices=[gpu(9)]))
    assert r.status_code == 403
    assert _gpus(api) == before

    assert api.post("/processes/gpu-1/heartbeat", {}).status_code == 200  # a beat without devices: taken
    r = api.post("/processes/gpu-1/heartbeat", forged, headers=api.headers(job))
    assert r.status_code == 200 and "GPU-0009" in _gpus(api)  # its own token: taken
