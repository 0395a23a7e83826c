"""The job's helper processes (the copier, the NVML reader) belong to the job alone. A process
forked from the job later (a DataLoader worker) lets go of its inherited copies of their socket
and pipes, so the helpers still see the job's end when the job goes, while the worker lives on.

Run in a fresh interpreter: forking pytest's own (threaded) process would prove less and warn."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap

from support.engine import driver  # noqa: F401  (fixture)
from support.fake_driver import FakeDriver

SCRIPT = textwrap.dedent("""
    import json, os, signal, sys, time
    from flexium.engine import nvml
    from flexium.engine.fast.host_copier import Copier, CopierError

    copier = Copier.start()
    nvml.start_reader()
    reader = nvml._reader
    assert reader is not None, "no NVML reader"
    nvml.set_frozen(True)
    before = [g.uuid for g in nvml.host_gpus()]          # through the reader
    result_r, result_w = os.pipe()
    worker = os.fork()
    if worker == 0:                                      # the "DataLoader worker"
        seen = {"copier_alive": copier.alive(), "reader_kept": nvml._reader is not None}
        try:
            copier.detach()
            seen["copier_refused"] = ""
        except CopierError as exc:
            seen["copier_refused"] = str(exc)
        seen["reads_in_child"] = [g.uuid for g in nvml.host_gpus()]   # a child of its own
        os.write(result_w, json.dumps(seen).encode())
        time.sleep(60)
        os._exit(0)
    os.close(result_w)
    seen = json.loads(os.read(result_r, 1 << 16))
    copier.detach()                                      # the parent's copier still answers it
    after = [g.uuid for g in nvml.host_gpus()]
    # The job goes without a word: its ends close; both helpers must see it and exit.
    copier._sock.close()
    reader.proc.stdin.close()
    exits = {}
    deadline = time.monotonic() + 15
    for name, proc in (("copier", copier._process), ("reader", reader.proc)):
        try:
            exits[name] = proc.wait(timeout=max(0.1, deadline - time.monotonic()))
        except Exception:
            exits[name] = None
            proc.kill()
    worker_alive = os.waitpid(worker, os.WNOHANG) == (0, 0)
    os.kill(worker, signal.SIGKILL)
    os.waitpid(worker, 0)
    print(json.dumps({"child": seen, "before": before, "after": after, "exits": exits,
                      "worker_alive": worker_alive}))
""")


def test_a_forked_worker_lets_go_of_the_copier_and_the_nvml_reader(driver: FakeDriver) -> None:  # noqa: F811
    proc = subprocess.run(
        [sys.executable, "-c", SCRIPT],
        capture_output=True,
        text=True,
        timeout=120,
        env=dict(os.environ, FLEXIUM_HOST_COPIER="1"),
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    out = json.loads(proc.stdout.strip().splitlines()[-1])
    child = out["child"]
    assert child["copier_alive"] is False and child["reader_kept"] is False
    assert "forked from process" in child["copier_refused"]
    assert out["before"] == out["after"] == child["reads_in_child"] == driver.uuids()
    # both helpers exited on the job's end while the worker, holding nothing of theirs, lived on
    assert out["worker_alive"] is True
    assert out["exits"] == {"copier": 0, "reader": 0}
