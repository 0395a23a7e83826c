"""A job token registers ranks only under its own jobs' keys (issue 41 item 7): a rank joins its
job by key alone, and a job's ranks are paused and moved as one, so a rank under another token's
key is refused, naming why, and nothing of it is stored."""

from __future__ import annotations

from support.server import Api, rank_body


def _job_token(api: Api, name: str) -> str:
    r = api.post("/tokens", {"name": name, "role": "job"})
    assert r.status_code == 201, r.text
    return str(r.json()["token"])


def test_a_rank_under_another_tokens_key_is_refused(api: Api) -> None:
    mine, theirs = _job_token(api, "mine"), _job_token(api, "theirs")
    first = api.post("/processes", rank_body(0, key="run-a"), headers=api.headers(mine))
    assert first.status_code == 201, first.text

    r = api.post("/processes", rank_body(1, key="run-a"), headers=api.headers(theirs))
    assert r.status_code == 403, r.text
    assert r.json()["message"].startswith("job 'run-a' has ranks registered by another token ('rank-0' among them)")
    assert [p["process_id"] for p in api.get("/processes").json()] == ["rank-0"]

    assert api.post("/processes", rank_body(1, key="run-a"), headers=api.headers(mine)).status_code == 201
    other_run = rank_body(0, key="run-b")
    other_run["process_id"] = "their-rank-0"
    assert api.post("/processes", other_run, headers=api.headers(theirs)).status_code == 201


def test_an_admin_token_may_register_any_rank(api: Api) -> None:
    job = _job_token(api, "job")
    assert api.post("/processes", rank_body(0, key="run-a"), headers=api.headers(job)).status_code == 201
    assert api.post("/processes", rank_body(1, key="run-a")).status_code == 201  # the admin's own token
