"""A command's notice ends at its outcome whichever comes first: the answer to the POST that
sent it, or the command's events (a job may carry it out before the answer reaches the page).
The page's POST answers are held back here so that the events always come first."""

from __future__ import annotations

import pytest

from support.dashboard import GIB, FakeHost, Jobs, two_rank_job
from support.dashboard_page import Dashboard

pytestmark = pytest.mark.timeout(120)

HOLD_S = 2.5

# Wraps the page's fetch: the answer to POST .../commands reaches the script HOLD_S late.
_HOLD_COMMAND_ANSWERS = """
var real = window.fetch, hold = arguments[0] * 1000;
window.fetch = function (url, init) {
  var answer = real.apply(this, arguments);
  if (!(init && init.method === "POST" && /\\/commands$/.test(String(url)))) { return answer; }
  window.heldAnswers = (window.heldAnswers || 0) + 1;
  return answer.then(function (r) { return new Promise(function (ok) { setTimeout(function () { ok(r); }, hold); }); });
};
"""


def _outcome(dash: Dashboard, starts: str, ends: str) -> str:
    return str(
        dash.wait(
            lambda: next((t for _r, t in dash.notices() if t.startswith(starts) and ends in t), None),
            f"the notice '{starts}…' ends with '{ends}'",
            timeout=HOLD_S + 10,
        )
    )


def test_a_command_done_before_its_answer_arrives_still_ends_at_its_outcome(dash: Dashboard, jobs: Jobs) -> None:
    job = jobs(FakeHost("early-events"), "gpu-ear1yev1", gpu=0, memory=3 * GIB, op_seconds=0.2)
    dash.open()
    dash.wait(lambda: dash.has_row(job.process_id), "the row")
    dash.js(_HOLD_COMMAND_ANSWERS, HOLD_S)
    dash.click(job.process_id, "pause")
    dash.wait(lambda: job.state == "PAUSED", "the job paused (its answer still held)")
    assert dash.js("return window.heldAnswers") == 1
    text = _outcome(dash, f"pause {job.process_id} (command ", "succeeded in 0.20 s (driver path)")
    assert "queued" not in text


def test_a_job_operation_done_before_its_answer_arrives_still_ends_at_its_outcome(dash: Dashboard, jobs: Jobs) -> None:
    host, key = FakeHost("early-events-ddp"), "early-ddp-7"
    ranks = two_rank_job(jobs, host, key, op_seconds=0.2)
    dash.open()
    dash.wait(lambda: dash.has_row(ranks[1].process_id), "the ranks' rows")
    dash.js(_HOLD_COMMAND_ANSWERS, HOLD_S)
    dash.click_job(key, "pause")
    dash.wait(lambda: all(r.state == "PAUSED" for r in ranks), "both ranks paused (the answer still held)")
    _outcome(dash, f"pause job {key} (operation ", "succeeded on every rank")
