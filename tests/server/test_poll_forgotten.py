"""A long-poll of a process forgotten meanwhile (issue 41 item 7): DELETE wakes it, and it
answers at once that the process is unknown (the job registers again), not after its full wait."""

from __future__ import annotations

import threading
import time
from typing import Any

from support.server import Api


def test_a_poll_woken_by_delete_answers_at_once(api: Api) -> None:
    api.register("gpu-1")
    answered: dict[str, Any] = {}

    def poll() -> None:
        started = time.monotonic()
        r = api.get("/processes/gpu-1/commands/next?wait=20")
        answered.update(status=r.status_code, seconds=time.monotonic() - started)

    poller = threading.Thread(target=poll)
    poller.start()
    time.sleep(1.0)  # the poll is waiting
    assert "status" not in answered
    assert api.delete("/processes/gpu-1").status_code == 204
    poller.join(timeout=30)
    assert answered["status"] == 404
    assert answered["seconds"] < 10  # its wait was 20 s: it answered when woken
