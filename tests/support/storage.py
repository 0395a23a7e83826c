"""What the storage tests share: a fixed clock, a workspace, a registered process, a command,
its delivery and reports, a sweep, and work released on many threads at once."""

from __future__ import annotations

import threading
from collections.abc import Callable
from typing import Any

from flexium import wire
from flexium.server import storage
from flexium.server.db import Database
from support.server import process_body, register

NOW = 1_800_000_000.0
STALE = 30.0


def make_workspace(db: Database, name: str = "team") -> tuple[int, str]:
    record, token = db.run(storage.create_workspace, write=True, name=name, now=NOW)
    return record.id, token


def add_process(db: Database, ws: int, process_id: str = "gpu-1", now: float = NOW, **fields: Any) -> dict[str, Any]:
    body = process_body(process_id, **fields)
    body.setdefault("footprint_bytes", None)
    proc: dict[str, Any] = register(db, ws, body, now=now, stale_after=STALE)
    return proc


def make_command(
    db: Database,
    ws: int,
    kind: str,
    process_id: str = "gpu-1",
    target: Any = None,
    now: float = NOW,
    gpus: dict[str, Any] | None = None,
) -> wire.CommandInfo:
    created: list[wire.CommandInfo] = db.run(
        storage.create_commands,
        write=True,
        workspace_id=ws,
        kind=kind,
        process_id=process_id,
        target=target,
        gpus=gpus,
        now=now,
        stale_after=STALE,
    )
    return created[0]


def next_for(db: Database, ws: int, process_id: str = "gpu-1", now: float = NOW) -> Any:
    return db.run(storage.next_command, write=True, workspace_id=ws, process_id=process_id, now=now)


def report(db: Database, ws: int, command_id: int, state: str, now: float = NOW, **extra: Any) -> Any:
    return db.run(
        storage.report_command,
        write=True,
        workspace_id=ws,
        command_id=command_id,
        report=wire.CommandReport.model_validate({"state": state, **extra}),
        now=now,
        stale_after=STALE,
    )


def sweep_at(db: Database, now: float, alive_since: float = NOW - 10_000, **kw: Any) -> storage.SweepResult:
    args = dict(stale_after=STALE, remove_after=600.0, command_ttl=120.0, stale_since=now - 2, reservation_ttl=300.0)
    args.update(kw)
    return db.run(storage.sweep, write=True, now=now, alive_since=alive_since, **args)


def all_at_once(count: int, work: Callable[[int], None]) -> list[BaseException]:
    """Runs work(0) .. work(count - 1) on threads released together; returns what they raised."""
    failures: list[BaseException] = []
    barrier = threading.Barrier(count)

    def run(i: int) -> None:
        barrier.wait()
        try:
            work(i)
        except BaseException as exc:  # noqa: BLE001
            failures.append(exc)

    threads = [threading.Thread(target=run, args=(i,)) for i in range(count)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    return failures
