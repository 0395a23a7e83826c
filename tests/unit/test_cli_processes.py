"""`flexium ps`: the columns that no end-to-end job on the CPU fills (MOVES for every kind of
process, the GPU of a process on several, STEPS and SPEED), the table fitted to a terminal of 80,
120 and 200 characters and whole lines to a pipe, its legend in --help, and a note where processes
run on simulated GPUs."""

from __future__ import annotations

import argparse
import io
import json
import os
import shutil
import sys
import time
from types import SimpleNamespace
from typing import Any

import pytest

from flexium import wire
from flexium.cli import main, processes, terminal
from flexium.cli.printing import count
from flexium.simulated import SIMULATED_DRIVER, SIMULATED_MODEL
from support.e2e import ps_row


@pytest.mark.parametrize(
    "capabilities, moves",
    [
        ({"pause_resume": True, "migration": True, "fast_path": True}, "fast"),
        ({"pause_resume": True, "migration": True, "fast_path": False, "fast_path_problem": "no pool"}, "driver"),
        ({"pause_resume": True, "migration": False, "fast_path": True}, "pause"),
        ({"pause_resume": False, "migration": False, "problems": ["no driver"]}, "-"),
        ({}, "-"),
    ],
)
def test_ps_says_how_a_process_can_move(capabilities: dict[str, Any], moves: str) -> None:
    assert processes._moves(wire.ProcessCapabilities.model_validate(capabilities)) == moves


def test_ps_counts_the_other_gpus_of_a_process_on_several() -> None:
    def cell(index: Any, others: list[str]) -> str:
        return processes._gpu_cell(SimpleNamespace(gpu_index=index, gpu_model="NVIDIA H200", other_gpus=others))  # type: ignore[arg-type]

    assert cell(0, []) == "0 NVIDIA H200"
    assert cell(0, ["GPU-b"]) == "0 NVIDIA H200 (+1 GPU)"
    assert cell(2, ["GPU-a", "GPU-b", "GPU-d"]) == "2 NVIDIA H200 (+3 GPUs)"
    assert processes._gpu_cell(SimpleNamespace(gpu_index=None, gpu_model="", other_gpus=[])) == "-"  # type: ignore[arg-type]


def _process(process_id: str, **fields: Any) -> wire.ProcessInfo:
    now = time.time()
    info: dict[str, Any] = {
        "process_id": process_id,
        "host": "node-a",
        "user": "ann",
        "pid": 4242,
        "state": "RUNNING",
        "reported_state": "RUNNING",
        "stale": False,
        "gpu_uuid": "GPU-aaaa",
        "gpu_model": "NVIDIA H200",
        "gpu_index": 0,
        "logical_device": "cuda:0",
        "physical_device": "cuda:0",
        "visible_gpus": ["GPU-aaaa"],
        "torch_version": "2.13.0",
        "driver_version": "580.82.07",
        "flexium_version": "0.4.0",
        "capabilities": {"pause_resume": True, "migration": True, "fast_path": True},
        "memory_bytes": 6 << 30,
        "footprint_bytes": 0,
        "started_at": now - 3600,
        "registered_at": now - 3600,
        "last_seen": now,
        "cmdline": "/usr/bin/python3 train.py --config configs/llama-7b.yaml --batch-size 32 --lr 3e-4",
        "name": "train.py",
        "active_command": None,
        "steps": 1660,
        "steps_per_s": 4.21,
        "steps_at": now,
    }
    return wire.ProcessInfo.model_validate(info | fields)


PROCESSES = [
    _process("gpu-1a2b3c4d"),
    _process(
        "gpu-5e6f7a8b",
        name="finetune_bert.py",
        state="PAUSED",
        memory_bytes=0,
        footprint_bytes=6 << 30,
        steps=123456,
        steps_per_s=3.0,
    ),
    _process(
        "gpu-demo0001",
        name="demo_job.py",
        gpu_model=SIMULATED_MODEL,
        driver_version=SIMULATED_DRIVER,
        cmdline="python -m flexium.cli.demo_job",
        steps=None,
        steps_per_s=None,
    ),
]


class Listing:
    workspace = "team"
    base_url = "http://127.0.0.1:8080"

    def __init__(self, listed: list[wire.ProcessInfo]) -> None:
        self.listed = listed

    def list_processes(self, state: str | None = None, host: str | None = None) -> list[wire.ProcessInfo]:
        return self.listed


def _ps(capsys: pytest.CaptureFixture[str], listed: list[wire.ProcessInfo], as_json: bool = False) -> tuple[str, str]:
    assert processes._ps(Listing(listed), argparse.Namespace(state=None, host=None, json=as_json)) == 0  # type: ignore[arg-type]
    done = capsys.readouterr()
    return done.out, done.err


def _headers(table: str) -> list[str]:
    return table.splitlines()[0].split()


@pytest.mark.parametrize(
    "columns, shown, left_out",
    [
        (80, ["PROCESS", "NAME", "STATE", "DEVICE", "MEMORY", "STEPS", "SPEED"], ["COMMAND", "PID", "UP", "GPU"]),
        (120, ["PROCESS", "NAME", "STATE", "DEVICE", "GPU", "MEMORY", "UP", "STEPS", "SPEED", "MOVES"], ["COMMAND"]),
        (200, ["PROCESS", "NAME", "STATE", "PID", "GPU", "UP", "STEPS", "SPEED", "MOVES", "COMMAND"], ["JOB", "DOING"]),
    ],
)
def test_ps_fits_the_terminal_leaving_out_what_tells_least(
    monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture[str],
    columns: int,
    shown: list[str],
    left_out: list[str],
) -> None:
    monkeypatch.setenv("COLUMNS", str(columns))
    table, _ = _ps(capsys, PROCESSES)
    assert max(len(line) for line in table.splitlines()) <= columns, table
    headers = _headers(table)
    assert all(header in headers for header in shown), table
    assert not any(header in headers for header in left_out), table
    assert "HOST" not in headers  # one host: said by --json
    row = ps_row(table, "gpu-5e6f7a8b")
    assert (row["STATE"], row["MEMORY"], row["STEPS"], row["SPEED"]) == ("PAUSED", "6.0 GiB paused", "123,456", "-")
    row = ps_row(table, "gpu-1a2b3c4d")
    assert (row["STEPS"], row["SPEED"]) == ("1,660", "4.21/s"), row


def test_ps_to_a_pipe_prints_whole_lines(monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]) -> None:
    monkeypatch.delenv("COLUMNS", raising=False)
    table, _ = _ps(capsys, PROCESSES)  # capsys's stdout is no terminal
    assert _headers(table) == [
        "PROCESS",
        "NAME",
        "JOB",
        "RANK",
        "STATE",
        "PID",
        "DEVICE",
        "GPU",
        "MEMORY",
        "UP",
        "STEPS",
        "SPEED",
        "MOVES",
        "DOING",
        "COMMAND",
    ]
    assert "python3 train.py --config configs/llama-7b.yaml --batch-size 32 --lr 3e-4" in table
    assert ps_row(table, "gpu-demo0001")["GPU"] == f"0 {SIMULATED_MODEL}"


def test_a_narrow_terminal_shortens_names_before_leaving_them_out(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    monkeypatch.setenv("COLUMNS", "60")
    table, _ = _ps(capsys, PROCESSES)
    assert _headers(table) == ["PROCESS", "NAME", "STATE", "DEVICE", "STEPS", "SPEED"], table
    assert ps_row(table, "gpu-5e6f7a8b")["NAME"] == "finetune_be~"
    monkeypatch.setenv("COLUMNS", "20")
    table, _ = _ps(capsys, PROCESSES)
    assert _headers(table) == ["PROCESS"]


def test_ps_shows_hosts_when_there_are_several(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    monkeypatch.setenv("COLUMNS", "80")
    table, _ = _ps(capsys, [PROCESSES[0], _process("gpu-9c9c9c9c", host="node-b.cluster.example.org")])
    assert "HOST" in _headers(table)
    host = ps_row(table, "gpu-9c9c9c9c")["HOST"]
    assert host.startswith("node-b.") and host.endswith("~"), table  # clipped, to the room left
    assert max(len(line) for line in table.splitlines()) <= 80


def test_ps_keeps_its_legend_for_help(monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]) -> None:
    monkeypatch.setenv("COLUMNS", "100")
    table, notes = _ps(capsys, PROCESSES[:2])
    assert "MOVES:" not in table and "DOING:" not in table and not notes
    with pytest.raises(SystemExit):
        main.main(["ps", "--help"])
    help_text = " ".join(capsys.readouterr().out.split())
    for said in ("STEPS = optimizer steps", "SPEED = steps per second", "MOVES: fast = ", "DOING: the command"):
        assert said in help_text, help_text


def test_ps_says_which_processes_run_on_simulated_gpus(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    monkeypatch.setenv("COLUMNS", "80")
    table, notes = _ps(capsys, PROCESSES)
    assert "gpu-demo0001 runs on flexium's simulated host" in notes and "simulated, not measured" in notes
    listed, _ = _ps(capsys, PROCESSES, as_json=True)
    assert [p["simulated"] for p in json.loads(listed)] == [False, False, True]


def test_the_terminal_width_is_columns_then_the_terminal_s_then_none(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("COLUMNS", "93")
    assert terminal.terminal_width() == 93
    monkeypatch.delenv("COLUMNS")
    monkeypatch.setattr(sys, "stdout", io.StringIO())
    assert terminal.terminal_width() is None
    monkeypatch.setattr(sys.stdout, "isatty", lambda: True)
    monkeypatch.setattr(shutil, "get_terminal_size", lambda: os.terminal_size((132, 40)))
    assert terminal.terminal_width() == 132


def test_a_silent_processs_time_up_ends_where_it_went_silent() -> None:
    now = time.time()
    silent = _process("gpu-0dead000", state="STALE", stale=True, started_at=now - 600, last_seen=now - 540)
    live = _process("gpu-1live000", started_at=now - 600, last_seen=now)
    [up] = [c for c in processes._columns([silent, live], now) if c.header == "UP"]
    assert up.cells == ["60s", "10m"], up.cells


def test_a_process_whose_token_was_revoked_or_expired_says_so_beside_its_state() -> None:
    now = time.time()
    orphan = _process("gpu-0rphan00", state="STALE", stale=True, last_seen=now - 30, token_revoked=True)
    lapsed = _process("gpu-0ld00000", state="STALE", stale=True, last_seen=now - 30, token_expired=True)
    live = _process("gpu-1live000", last_seen=now)
    [state] = [c for c in processes._columns([orphan, lapsed, live], now) if c.header == "STATE"]
    assert state.cells == ["STALE (token revoked)", "STALE (token expired)", "RUNNING"], state.cells


def test_counts_are_singular_for_one() -> None:
    assert (count(1, "rank"), count(2, "rank"), count(0, "GPU")) == ("1 rank", "2 ranks", "0 GPUs")


def test_a_filter_that_matches_nothing_says_so_not_that_the_workspace_is_empty(
    capsys: pytest.CaptureFixture[str],
) -> None:
    for state, host, said in (
        ("PAUSED", None, "no process matches --state PAUSED in workspace 'team' (`flexium ps` lists them all)"),
        (None, "nohost", "no process matches --host nohost in workspace 'team' (`flexium ps` lists them all)"),
        (None, None, "no processes in workspace 'team' at http://127.0.0.1:8080"),
    ):
        assert processes._ps(Listing([]), argparse.Namespace(state=state, host=host, json=False)) == 0  # type: ignore[arg-type]
        assert capsys.readouterr().out.strip() == said
