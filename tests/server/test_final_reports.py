"""A command's final report is taken whatever its result's size (issue 41 item 7): one over
--max-payload-bytes was refused 413 and left its job busy for good, as the process never sends
it again; now its state is taken and its result kept without its steps and notes, saying so."""

from __future__ import annotations

from support.server import Api


def test_a_final_report_over_the_payload_bound_is_taken_cut(api: Api) -> None:
    api.register("gpu-1")
    command = api.command("pause").json()
    assert api.get("/processes/gpu-1/commands/next?wait=0").json()["id"] == command["id"]
    assert api.post(f"/commands/{command['id']}/report", {"state": "running"}).status_code == 200
    limit = api.ctx.settings.max_payload_bytes
    notes = ["n" * 4000] * (limit // 4000 + 2)  # over the bound by a note or two
    result = {"kind": "pause", "ok": True, "seconds": 1.5, "bytes_moved": 7, "notes": notes}
    r = api.post(f"/commands/{command['id']}/report", {"state": "succeeded", "result": result})
    assert r.status_code == 200, r.text
    done = api.get(f"/commands/{command['id']}").json()
    assert done["state"] == "succeeded"
    assert (done["result"]["seconds"], done["result"]["bytes_moved"], done["result"]["steps"]) == (1.5, 7, [])
    (note,) = done["result"]["notes"]
    assert note.startswith("cut by the server: the command's result is ") and str(limit) in note
    assert api.get("/processes/gpu-1").json()["state"] == "PAUSED"  # not busy: the pause was taken
    # a running report's result is none of this: only what fits is ever stored
    small = api.command("resume").json()
    api.get("/processes/gpu-1/commands/next?wait=0")
    r = api.post(f"/commands/{small['id']}/report", {"state": "failed", "error": "no room", "result": {"ok": False}})
    assert r.status_code == 200 and r.json()["result"]["notes"] == []
