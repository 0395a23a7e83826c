"""The `flexium` command reading what jobs sent: hostile text (tests/support/hostile_text.py) in hosts,
command lines, GPU names and token names is listed by `flexium ps`, `flexium devices` and
`flexium token list`, and no control character of it reaches the terminal (cli/terminal.py)."""

from __future__ import annotations

import re
import time

import pytest

from support.e2e import Server
from support.hostile_text import ACCEPTED

pytestmark = pytest.mark.timeout(120)

RAW_CONTROLS = re.compile("[\x00-\x08\x0b-\x1f\x7f-\x9f\u202a-\u202e\u2066-\u2069]")


def test_lists_show_hostile_text_without_its_control_characters(server: Server) -> None:
    for i, value in enumerate(ACCEPTED.values()):
        device = {"uuid": f"GPU-hostile-{i}", "index": 0, "name": value, "memory_total": 1 << 30, "health": value}
        body = {
            "process_id": f"hostile-{i}",
            "host": f"{value} {i}",
            "user": value,
            "cmdline": value,
            "gpu_uuid": device["uuid"],
            "visible_gpus": [device["uuid"]],
            "gpu_model": value,
            "devices": [device],
            "started_at": time.time(),
        }
        r = server.post("/processes", body)
        assert r.status_code == 201, r.text
        assert server.post("/tokens", {"name": value}).status_code == 201
    outputs = []
    for args in (("ps",), ("devices",), ("token", "list", "e2e", "--database", server.database)):
        done = server.cli(*args)
        assert done.returncode == 0, (args, done.stderr)
        outputs.append(done.stdout + done.stderr)
    ps, devices, tokens = outputs
    for i in range(len(ACCEPTED)):
        assert f"hostile-{i}" in ps
    assert "\\x1b[31mred\\x1b[0m\\x07\\x7f" in ps + devices + tokens
    assert "\\u202egpj.exe\\u202c" in devices and "\\u202egpj.exe\\u202c" in tokens
    assert "<script>alert" in devices  # a terminal shows markup as text: nothing to escape
    for output in outputs:
        assert not RAW_CONTROLS.search(output), repr(RAW_CONTROLS.search(output))
