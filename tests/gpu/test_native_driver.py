"""flexium._C against the real driver: the measured facts our engine relies on still hold."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from typing import Any

import pytest

from conftest import GIB, HERE, _keep_log, end_process_group
from live_server import ProcessOutput


def run_native() -> dict[str, dict[str, Any]]:
    proc = subprocess.run([sys.executable, str(HERE / "native_job.py")], capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return {c["check"]: c for c in (json.loads(line) for line in proc.stdout.splitlines() if line.startswith("{"))}


# native_job.py restores GPU 0's context onto GPU 1 (devices[1]).
@pytest.mark.usefixtures("two_gpus")
def test_native_layer_on_the_real_driver(host_gpus: list[Any]) -> None:
    checks = run_native()
    devices = checks["devices"]
    assert devices["status"]["loaded"] and devices["status"]["checkpoint_api"]
    assert set(devices["uuids"]) <= set(devices["nvml"])

    unlock = checks["unlock_running"]
    assert unlock["raised"] and unlock["call"] == "cuCheckpointProcessUnlock"
    assert unlock["name"] in unlock["message"]

    # One pair is refused (docs/facts.md fact 2); the recover rollback brings the job back in place
    # (docs/facts.md fact 3).
    single = checks["single_pair"]
    failed = [o for o in single["outcomes"] if o["code"] != 0]
    assert failed[0]["step"] == "restore" and not failed[0]["rollback"]
    assert [o["step"] for o in single["outcomes"] if o["rollback"]] == ["restore", "unlock"]
    assert single["state"] == "RUNNING" and single["intact"]
    assert single["ours"][devices["uuids"][0]] >= GIB

    full = checks["full_pairs"]
    assert all(o["code"] == 0 for o in full["outcomes"]), full["outcomes"]
    assert full["state"] == "RUNNING" and full["intact"]
    assert full["ours"][devices["uuids"][1]] >= GIB and full["ours"][devices["uuids"][0]] == 0
    # The driver API names the new GPU after the move (PyTorch's cached properties do not: docs/facts.md fact 5).
    assert full["reported_uuid"] == devices["uuids"][1]


def test_importing_flexium_before_torch_leaves_torch_working() -> None:
    # docs/facts.md fact 20: a job that imports flexium first (python -m flexium.cli.demo_job does)
    # once crashed inside `import torch`.
    code = "import flexium._C; import torch; print(torch.ones(2, device='cuda').sum().item())"
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, f"exit {proc.returncode}: {proc.stderr[-3000:]}"
    assert proc.stdout.strip().splitlines()[-1] == "2.0"


def test_a_restore_of_memory_the_driver_cannot_restore_fails_or_is_said_while_it_waits() -> None:
    """The driver cannot restore a process holding cuMem host memory (docs/facts.md fact 26): its
    restore either never returns (the probe's runs) or fails (flexium's locked section, 2026-12-02).
    Either way the job must not stop without a word: a failed restore is an outcome the engine sees
    and rolls back from, and one still waiting is named on stderr by the native layer, here every
    2 s (FLEXIUM_DRIVER_CALL_REPORT_S), with what to do."""
    env = {**os.environ, "FLEXIUM_DRIVER_CALL_REPORT_S": "2", "PYTHONUNBUFFERED": "1"}
    job = subprocess.Popen(
        [sys.executable, str(HERE / "stuck_restore_job.py")],
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        env=env,
        start_new_session=True,
    )
    output = ProcessOutput(job)
    try:
        pid = json.loads(output.wait_for(r'^\{"event": "ready"', 120).string)["pid"]
        # Returned, or said twice: it goes on saying so while the call waits.
        report = r"^\[flexium\] cuCheckpointProcessRestore \(process (\d+)\) has not returned after 4 s"
        seen = output.wait_for(rf'^\{{"event": "returned"|{report}', 60)
        if seen.string.startswith("{"):
            steps = json.loads(seen.string)["steps"]
            assert steps[:2] == [["lock", 0], ["checkpoint", 0]] and steps[2][0] == "restore", steps
            assert steps[2][1] != 0, f"the driver restored memory it could not before (fact 26): {steps}"
        else:
            assert int(seen.group(1)) == pid
            what_to_do = f"end the job (kill {pid}) and start it again from its last checkpoint"
            assert seen.string.endswith(what_to_do), seen.string
    finally:
        end_process_group(job, lambda seconds: job.wait(seconds))
        job.wait(30)  # reaped after a SIGKILL too; a process the kill cannot end fails here
        _keep_log(("stuck_restore_job.py",), {"FLEXIUM_DRIVER_CALL_REPORT_S": "2"}, job.returncode, output.text, "")
