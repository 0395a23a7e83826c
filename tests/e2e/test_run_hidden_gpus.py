"""``flexium run`` where CUDA_VISIBLE_DEVICES hides some of the host's GPUs from the job (NVML, which the
reports come from, lists them all; the server places on any GPU of the host), against a real server:
with one GPU left visible the job goes there; with several, --gpu auto is refused before anything is
asked of the server; a placement on a GPU the job cannot see anyway starts nothing, is closed, and
mints no token."""

from __future__ import annotations

import signal
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from flexium import wire
from flexium.cli import main as cli_main
from flexium.cli import run as cli_run
from support.e2e import Server
from support.server import GIB, gpu

pytestmark = pytest.mark.timeout(120)


@pytest.fixture
def server(tmp_path: Path) -> Iterator[Server]:
    with Server(tmp_path).serving(signal.SIGKILL) as srv:
        yield srv


def host(monkeypatch: pytest.MonkeyPatch, server: Server, visible: list[int]) -> None:
    """Three GPUs on host node9: GPU 0 nearly full, GPU 1 empty (the most room), GPU 2 with 10 GiB used; the
    job sees `visible`."""
    used = {0: 130 * GIB, 1: 0, 2: 10 * GIB}
    reports = [wire.GpuReport.model_validate(gpu(i, used=used[i])) for i in range(3)]
    gpus = cli_run.HostGpus(
        ordinals={f"GPU-{i:04d}": ordinal for ordinal, i in enumerate(visible)},
        indexes={i: f"GPU-{i:04d}" for i in visible},
        reports=reports,
    )
    monkeypatch.setattr(cli_run.HostGpus, "read", classmethod(lambda cls: gpus))
    monkeypatch.setattr(cli_run, "read_reports", lambda: reports)
    monkeypatch.setattr(cli_run, "reported_host", lambda: "node9")
    monkeypatch.setenv("FLEXIUM_SERVER", server.address)
    monkeypatch.setenv("FLEXIUM_TOKEN", server.token or "")
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", ",".join(map(str, visible)))


def placements(server: Server) -> list[dict[str, Any]]:
    answer: list[dict[str, Any]] = server.get("/placements", params={"all": "true"}).json()
    return answer


def job_tokens(server: Server) -> list[dict[str, Any]]:
    return [t for t in server.get("/tokens").json() if t["name"].startswith("flexium run")]


def test_with_one_gpu_visible_the_job_goes_there(
    server: Server, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    host(monkeypatch, server, [0])
    assert cli_main.main(["run", "--memory", "4GiB", "--", "true"]) == 0, capsys.readouterr().err
    (placed,) = placements(server)
    assert placed["placed_index"] == 0 and placed["state"] == "ended", placed


def test_with_several_gpus_visible_auto_is_refused_before_asking(
    server: Server, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    host(monkeypatch, server, [0, 2])
    assert cli_main.main(["run", "--memory", "4GiB", "--", "true"]) == 2
    err = capsys.readouterr().err
    assert "CUDA_VISIBLE_DEVICES=0,2 hides GPU(s) 1 of this host" in err and "--gpu cuda:N (N from 0 to 1)" in err, err
    assert placements(server) == []
    # Named, a GPU it sees is taken.
    assert cli_main.main(["run", "--memory", "4GiB", "--gpu", "cuda:1", "--", "true"]) == 0
    assert [p["placed_index"] for p in placements(server)] == [2]


def test_a_placement_on_a_gpu_it_cannot_see_starts_nothing(
    server: Server, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str], tmp_path: Path
) -> None:
    host(monkeypatch, server, [0, 2])
    monkeypatch.setattr(cli_run, "_only_visible", lambda gpus: None)  # as a server that placed it anywhere
    started = tmp_path / "started"
    assert cli_main.main(["run", "--memory", "4GiB", "--", "touch", str(started)]) == 1
    err = capsys.readouterr().err
    assert "which this job cannot see (CUDA_VISIBLE_DEVICES=0,2); nothing was started" in err, err
    assert not started.exists()
    (closed,) = placements(server)
    assert closed["placed_index"] == 1 and closed["state"] not in ("placed", "waiting"), closed
    assert closed["reservation"] is None
    assert job_tokens(server) == []
