"""Making room through the real server, a real job on the simulated driver and the CLI: a paused job
of high priority asks for room (`flexium resume JOB --make-room`); a job of low priority holding the
GPU is paused for it (a stand-in speaking the job's protocol, whose memory is on the simulated host
for every process to see), the high one resumes there, and the low one, queued, resumes when room
appears on another GPU."""

from __future__ import annotations

import threading
import time
from pathlib import Path
from typing import Any

import pytest
import requests

from support.e2e import HEARTBEAT_S, Job, Server, wait_until
from support.fake_driver import write_host_file

pytestmark = pytest.mark.timeout(240)

GIB = 1 << 30
GPU_MIB = 16 << 10  # small simulated GPUs: a pause needs the job's memory in host memory


class SimulatedHost:
    """What other programs hold on the simulated host's GPUs, by holder, written to its host file."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self._held: dict[str, tuple[int, int]] = {}
        self._lock = threading.Lock()
        write_host_file(path, {})

    def hold(self, holder: str, physical: int, nbytes: int) -> None:
        with self._lock:
            self._held[holder] = (physical, nbytes)
            others: dict[int, int] = {}
            for gpu, held in self._held.values():
                others[gpu] = others.get(gpu, 0) + held
            write_host_file(self.path, others)


class StandIn:
    """A job of the host reduced to what it says over HTTP, its memory held on the simulated host:
    a pause frees it there, a resume takes it again where the command says."""

    def __init__(self, server: Server, host: SimulatedHost, like: dict[str, Any], **body: Any) -> None:
        self.server = server
        self.host = host
        self.uuids = like["visible_gpus"]
        self.process_id = "low-job"
        self.gpu = 0
        self.memory = 13 * GIB
        self.state = "RUNNING"
        self.received: list[dict[str, Any]] = []
        self.stop = threading.Event()
        self.body = {
            "process_id": self.process_id,
            "host": like["host"],
            "gpu_model": like["gpu_model"],
            "visible_gpus": self.uuids,
            "capabilities": {"pause_resume": True, "migration": True},
            "cmdline": "python low.py",
            **body,
        }
        self.threads = [threading.Thread(target=loop, daemon=True) for loop in (self._beat, self._poll)]

    def start(self) -> StandIn:
        self.host.hold(self.process_id, self.gpu, self.memory)
        r = self.server.post("/processes", {**self.body, **self._where()})
        assert r.status_code in (200, 201), r.text
        for thread in self.threads:
            thread.start()
        return self

    def close(self) -> None:
        self.stop.set()
        for thread in self.threads:
            thread.join(10)

    def _where(self) -> dict[str, Any]:
        held = 0 if self.state == "PAUSED" else self.memory
        return {
            "state": self.state,
            "gpu_uuid": self.uuids[self.gpu],
            "memory_bytes": held,
            "footprint_bytes": self.memory,
        }

    def _beat(self) -> None:
        while not self.stop.wait(HEARTBEAT_S):
            self.server.post(f"/processes/{self.process_id}/heartbeat", self._where())

    def _poll(self) -> None:
        while not self.stop.is_set():
            try:
                r = self.server.get(f"/processes/{self.process_id}/commands/next", params={"wait": 1}, timeout=10)
            except requests.RequestException:
                continue
            if r.status_code == 200:
                self._run(r.json())

    def _run(self, command: dict[str, Any]) -> None:
        self.received.append(command)
        self.server.post(f"/commands/{command['id']}/report", {"state": "running"})
        if command["kind"] == "pause":
            self.host.hold(self.process_id, self.gpu, 0)
            self.state = "PAUSED"
        else:
            self.gpu = self.uuids.index(command["target_uuid"]) if command["target_uuid"] else self.gpu
            self.host.hold(self.process_id, self.gpu, self.memory)
            self.state = "RUNNING"
        report = {"state": "succeeded", "result": {"kind": command["kind"], "ok": True}, "process": self._where()}
        self.server.post(f"/commands/{command['id']}/report", report)


def test_room_is_made_for_a_job_of_higher_priority(server: Server, tmp_path: Path) -> None:
    host = SimulatedHost(tmp_path / "host")
    urgent = Job(
        server,
        fake=True,
        memory_mib=4 << 10,
        extra_env={
            "FAKE_CUDA_HOST_FILE": str(host.path),
            "FAKE_CUDA_TOTAL_MIB": str(GPU_MIB),
            "FLEXIUM_PRIORITY": "high",
        },
    )
    low: StandIn | None = None
    try:
        shown = urgent.wait_registered()
        assert shown["priority"] == 90
        assert server.cli("pause", urgent.process_id).returncode == 0
        host.hold("neighbour", 1, (GPU_MIB - 256) << 20)  # GPU 1 is taken by another program
        low = StandIn(server, host, shown, priority=10).start()
        wait_until(
            lambda: all(
                d["memory_free"] < 4 * GIB for h in server.get("/devices").json()["hosts"] for d in h["devices"]
            ),
            20,
            "a GPU report with the low job and the neighbour",
        )

        made = server.cli("resume", urgent.process_id, "--make-room", timeout=90)
        assert made.returncode == 0, made.stdout + made.stderr
        assert f"making room: pausing {low.process_id}" in made.stderr
        assert server.process(urgent.process_id)["state"] == "RUNNING"
        [pause] = [c for c in low.received if c["kind"] == "pause"]
        assert pause["reason"].startswith(f"make room: process '{urgent.process_id}' (priority high) needs")
        waiting = server.get("/waits", params={"process_id": low.process_id}).json()
        assert [w["state"] for w in waiting] == ["waiting"] and waiting[0]["priority"] == 10

        freed = time.monotonic()
        host.hold("neighbour", 1, 0)  # the other program ends: the low job resumes there
        wait_until(lambda: low is not None and low.state == "RUNNING", 30, "the low job to resume when free")
        print(
            f"\nFIGURES make room: the job paused for it resumed {time.monotonic() - freed:.1f} s after room appeared"
        )
        resume = low.received[-1]
        assert resume["kind"] == "resume" and resume["target_uuid"] == shown["visible_gpus"][1]
        assert resume["reason"].startswith("resume when free: GPU 1 had")
    finally:
        if low is not None:
            low.close()
        urgent.stop()
