"""A training job started from a folder and with arguments whose bytes are not UTF-8
(``python /data/donn<0xE9>es/train.py --data donn<0xE9>es.csv`` on a UTF-8 system): Python keeps
those bytes as lone surrogates, which no JSON for the server can carry. The client sends U+FFFD
in their place, so the job registers, is listed and takes commands like any other."""

from __future__ import annotations

import json
import os
import shutil
from collections.abc import Iterator
from pathlib import Path

import pytest
import requests

from support.e2e import TRAIN_JOB, Job, Server, wait_until

pytestmark = pytest.mark.timeout(180)

NOT_UTF8 = b"donn\xe9es"  # "données" in Latin-1
SHOWN = "donn\ufffdes"


@pytest.fixture(scope="module")
def job(server: Server, module_tmp: Path) -> Iterator[Job]:
    folder = Path(os.fsdecode(os.fsencode(module_tmp) + b"/" + NOT_UTF8))
    folder.mkdir()
    script = folder / "train.py"
    shutil.copy(TRAIN_JOB, script)
    shutil.copy(TRAIN_JOB.with_name("job_output.py"), folder)  # what it imports from its own folder
    j = Job(server, fake=True, script=script, args=[b"--data", NOT_UTF8 + b".csv", "--note", "caf\u00e9"])
    j.wait_registered()
    yield j
    j.stop()


def test_it_registers_with_its_command_line_cleaned(server: Server, job: Job) -> None:
    shown = server.process(job.process_id)
    assert shown is not None
    assert f"{SHOWN}/train.py" in shown["cmdline"], shown["cmdline"]
    assert f"{SHOWN}.csv" in shown["cmdline"] and "caf\u00e9" in shown["cmdline"], shown["cmdline"]
    assert shown["state"] == "RUNNING" and shown["capabilities"]["pause_resume"] is True
    done = server.cli("ps", "--json")
    assert done.returncode == 0, done.stderr
    assert {p["process_id"]: p["cmdline"] for p in json.loads(done.stdout)}[job.process_id] == shown["cmdline"]
    browser = requests.Session()
    assert browser.post(server.url + "/login", data={"token": server.token}, timeout=10).status_code == 200
    page = browser.get(server.url + "/", timeout=10)
    assert page.status_code == 200 and job.process_id in page.text and "train.py" in page.text


def test_it_takes_commands(server: Server, job: Job) -> None:
    for action, state in (("pause", "PAUSED"), ("resume", "RUNNING")):
        done = server.cli(action, job.process_id)
        assert done.returncode == 0, done.stdout + done.stderr
        wait_until(lambda s=state: (server.process(job.process_id) or {}).get("state") == s, 30, state)
