"""Many hosts through the real server, real jobs on the simulated driver and the CLI: three
simulated hosts of four simulated GPUs each (FLEXIUM_SIMULATED_HOST), a job on each. The listing
groups the jobs by host and lists each host's own GPUs (UUIDs of its own); a move within a host
works, a move to another host's GPU is refused naming both hosts; a paused job queued to resume
when free is not resumed by room on another host, and is once its own host has room."""

from __future__ import annotations

import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from support.e2e import Job, Server, ps_row, wait_until
from support.fake_driver import write_host_file

pytestmark = pytest.mark.timeout(300)

HOSTS = ("sim-a", "sim-b", "sim-c")
GPUS = 4
GPU_MIB = 143771  # the simulated driver's GPUs (FAKE_CUDA_TOTAL_MIB's default)
FULL = (GPU_MIB - 256) << 20  # a neighbour that leaves 256 MiB on a GPU: less than a job needs


@pytest.fixture(scope="module")
def fleet(server: Server, module_tmp: Path) -> Iterator[dict[str, Job]]:
    jobs: dict[str, Job] = {}
    try:
        for host in ("sim-b", "sim-c", "sim-a"):  # not in the order of their names: the listing groups them
            host_file = module_tmp / f"neighbours-{host}"
            write_host_file(host_file, {})
            env = {"FLEXIUM_SIMULATED_HOST": host, "FAKE_CUDA_GPUS": str(GPUS), "FAKE_CUDA_HOST_FILE": str(host_file)}
            jobs[host] = Job(server, fake=True, extra_env=env)
        for job in jobs.values():
            job.wait_registered()
        wait_until(lambda: len(_hosts(server)) == len(HOSTS), 20, "every host's GPU report")
        yield jobs
    finally:
        for job in jobs.values():
            job.stop()


def _hosts(server: Server) -> dict[str, list[dict[str, Any]]]:
    return {h["host"]: h["devices"] for h in server.get("/devices").json()["hosts"]}


def _host_file(module_tmp: Path, host: str) -> Path:
    return module_tmp / f"neighbours-{host}"


def test_each_host_has_its_own_gpus_and_the_listing_groups_by_host(server: Server, fleet: dict[str, Job]) -> None:
    hosts = _hosts(server)
    assert sorted(hosts) == list(HOSTS)
    uuids = [d["uuid"] for devices in hosts.values() for d in devices]
    assert all(len(devices) == GPUS for devices in hosts.values())
    assert len(set(uuids)) == len(HOSTS) * GPUS, "each simulated host's GPUs have UUIDs of their own"
    for host, job in fleet.items():
        process = server.process(job.process_id)
        assert process is not None and process["host"] == host
        assert set(process["visible_gpus"]) == {d["uuid"] for d in hosts[host]}

    ps = server.cli("ps")
    assert ps.returncode == 0, ps.stderr
    rows = [line for line in ps.stdout.splitlines() if line.startswith("gpu-")]
    assert [ps_row(ps.stdout, line.split()[0])["HOST"] for line in rows] == list(HOSTS)
    only_b = server.cli("ps", "--host", "sim-b")
    assert fleet["sim-b"].process_id in only_b.stdout
    assert fleet["sim-a"].process_id not in only_b.stdout and fleet["sim-c"].process_id not in only_b.stdout
    listed = server.get("/processes", params={"host": "sim-c"}).json()
    assert [p["process_id"] for p in listed] == [fleet["sim-c"].process_id]


def test_a_move_within_a_host_works_and_to_another_hosts_gpu_is_refused(server: Server, fleet: dict[str, Job]) -> None:
    job = fleet["sim-a"]
    moved = server.cli("migrate", job.process_id, "cuda:2")
    assert moved.returncode == 0, moved.stdout + moved.stderr
    process = server.process(job.process_id)
    assert process is not None and process["gpu_index"] == 2 and process["host"] == "sim-a"

    elsewhere = _hosts(server)["sim-b"][1]["uuid"]
    refused = server.cli("migrate", job.process_id, elsewhere)
    assert refused.returncode == 1, refused.stdout + refused.stderr
    assert "'sim-b'" in refused.stderr and "'sim-a'" in refused.stderr, refused.stderr
    assert "GPU of its own host" in refused.stderr, refused.stderr
    process = server.process(job.process_id)
    assert process is not None and process["gpu_index"] == 2


def test_a_queued_resume_is_not_satisfied_by_room_on_another_host(
    server: Server, fleet: dict[str, Job], module_tmp: Path
) -> None:
    job = fleet["sim-c"]
    assert server.cli("pause", job.process_id).returncode == 0
    write_host_file(_host_file(module_tmp, "sim-c"), dict.fromkeys(range(GPUS), FULL))
    wait_until(
        lambda: all(d["memory_free"] < 1 << 30 for d in _hosts(server)["sim-c"]), 20, "sim-c's GPUs reported full"
    )
    refused = server.cli("resume", job.process_id, "--when-free", "--host", "sim-a")
    assert refused.returncode == 1, refused.stdout + refused.stderr
    assert "'sim-c'" in refused.stderr and "'sim-a'" in refused.stderr, refused.stderr

    queued = server.cli("resume", job.process_id, "--when-free")
    assert queued.returncode == 0, queued.stdout + queued.stderr
    time.sleep(3.0)  # sim-a and sim-b have room all along, and report it
    process = server.process(job.process_id)
    assert process is not None and process["state"] == "PAUSED"
    commands = server.get("/commands", params={"process_id": job.process_id}).json()
    assert not [c for c in commands if c["kind"] == "resume"], commands

    write_host_file(_host_file(module_tmp, "sim-c"), {})
    wait_until(lambda: server.process(job.process_id)["state"] == "RUNNING", 20, "sim-c's job resumed on sim-c")
    process = server.process(job.process_id)
    assert process is not None and process["host"] == "sim-c"
    assert process["gpu_uuid"] in {d["uuid"] for d in _hosts(server)["sim-c"]}
