"""Quotas counted under concurrency (issue 41 item 7): forty registrations at once against a limit
of ten add exactly ten processes, and as many token issues exactly as many tokens as the limit
leaves, on PostgreSQL too (where the counts once ran in parallel and let 11 to 17 through)."""

from __future__ import annotations

from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor

from flexium import wire
from flexium.server import storage
from flexium.server.db import Database
from flexium.server.errors import QuotaExceeded
from flexium.server.storage import quotas
from support.server import process_body

NOW = 1_800_000_000.0
AT_ONCE = 40


def _workspace(db: Database) -> int:
    record, _token = db.run(storage.create_workspace, write=True, name="team", now=NOW)
    return record.id


def _attempts(attempt: Callable[[int], None]) -> list[str]:
    def outcome(i: int) -> str:
        try:
            attempt(i)
        except QuotaExceeded:
            return "refused"
        return "added"

    with ThreadPoolExecutor(AT_ONCE) as pool:
        return list(pool.map(outcome, range(AT_ONCE)))


def test_registrations_at_once_stop_at_the_limit(db: Database) -> None:
    db.session_info[quotas.SESSION_KEY] = quotas.Quotas(max_processes=10)
    ws = _workspace(db)

    def register(i: int) -> None:
        report = wire.RegisterRequest.model_validate(process_body(f"p-{i}", devices=[]))
        db.run(storage.register_process, write=True, workspace_id=ws, report=report, now=NOW, stale_after=30.0)

    outcomes = _attempts(register)
    assert outcomes.count("added") == 10 and outcomes.count("refused") == AT_ONCE - 10
    listed = db.run(storage.list_processes, write=False, workspace_id=ws, now=NOW, stale_after=30.0)
    assert len(listed) == 10


def test_token_issues_at_once_stop_at_the_limit(db: Database) -> None:
    db.session_info[quotas.SESSION_KEY] = quotas.Quotas(max_tokens=10)
    ws = _workspace(db)  # its first token counts: nine more

    def issue(i: int) -> None:
        db.run(storage.issue_token, write=True, workspace_id=ws, name=f"t-{i}", now=NOW)

    outcomes = _attempts(issue)
    assert outcomes.count("added") == 9 and outcomes.count("refused") == AT_ONCE - 9
    assert len(db.run(storage.list_tokens, write=False, workspace_id=ws, now=NOW)) == 10
