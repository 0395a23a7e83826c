"""What the server's health check says about its database (Database.ping)."""

from __future__ import annotations

import asyncio
import os
import sqlite3
import time
from pathlib import Path
from typing import Any

import pytest
from sqlalchemy import text

from flexium.server.db import Database, DatabaseLocked, DatabaseUnavailable


def _select_one(*, session: Any) -> None:
    session.execute(text("SELECT 1"))


def test_health_fails_when_the_sqlite_file_is_deleted_or_replaced(tmp_path: Path) -> None:
    """Open connections go on writing to a deleted file, and everything is lost at the restart:
    the health check says so instead of answering ok."""
    path = tmp_path / "flexium.db"
    db = Database(f"sqlite:///{path}")
    try:
        db.upgrade()
        asyncio.run(db.ping())
        os.rename(path, tmp_path / "moved.db")
        with pytest.raises(DatabaseUnavailable, match=r"flexium\.db is gone \(deleted or moved while the server ran\)"):
            asyncio.run(db.ping())
        path.write_bytes(b"")  # another file where it was
        with pytest.raises(DatabaseUnavailable, match="was replaced while the server ran"):
            asyncio.run(db.ping())
        os.remove(path)
        os.rename(tmp_path / "moved.db", path)  # put back: the same file again
        asyncio.run(db.ping())
    finally:
        db.dispose()


def test_a_used_sqlite_file_that_is_gone_is_not_created_again_empty(tmp_path: Path) -> None:
    path = tmp_path / "flexium.db"
    first = Database(f"sqlite:///{path}")
    first.upgrade()  # a fresh file where none was: created
    first.dispose()
    for leftover in tmp_path.glob("flexium.db*"):
        if not leftover.name.endswith(".used"):
            leftover.unlink()
    again = Database(f"sqlite:///{path}")
    try:
        with pytest.raises(DatabaseUnavailable, match=r"flexium\.db is gone, though a server used it before"):
            again.upgrade()
        assert not path.exists()
        again.upgrade(new_database=True)  # told to
        assert path.exists()
    finally:
        again.dispose()


def test_writes_are_refused_while_the_sqlite_file_is_gone(tmp_path: Path) -> None:
    """Acknowledged writes to a deleted file would all be lost at the restart: 503 instead."""
    path = tmp_path / "flexium.db"
    db = Database(f"sqlite:///{path}")
    try:
        db.upgrade()
        db.run(_select_one, write=True)
        os.rename(path, tmp_path / "moved.db")
        time.sleep(1.1)  # writes look at the file once a second
        with pytest.raises(DatabaseUnavailable, match="is gone"):
            db.run(_select_one, write=True)
        db.run(_select_one, write=False)  # reads of what is there go on
        os.rename(tmp_path / "moved.db", path)
        asyncio.run(db.ping())  # looks afresh
        db.run(_select_one, write=True)
    finally:
        db.dispose()


def test_a_postgresql_server_that_does_not_answer_fails_the_health_check_within_about_a_second() -> None:
    """A host that drops packets (or refuses, where the network says so at once): never a hang."""
    db = Database("postgresql+psycopg://postgres@10.255.255.1:5432/flexium", threads=2)
    try:
        started = time.monotonic()
        with pytest.raises(DatabaseUnavailable):
            asyncio.run(db.ping(timeout_s=1.0))
        # Its own 1 s, with room for a machine shared with other work; not the connection's 5 s.
        assert time.monotonic() - started < 4.0
    finally:
        db.dispose()


def test_a_sqlite_file_locked_by_another_connection_is_reported_not_waited_for(tmp_path: Path) -> None:
    path = tmp_path / "flexium.db"
    db = Database(f"sqlite:///{path}", lock_timeout_s=0.3)
    holder = sqlite3.connect(path, isolation_level=None)
    try:
        db.upgrade()
        holder.execute("BEGIN IMMEDIATE")
        started = time.monotonic()
        with pytest.raises(DatabaseLocked, match=r"locked by another process \(waited 0.3 s; --db-lock-timeout\)"):
            db.run(_select_one, write=True)
        # The 0.3 s it waited, ten times over on a loaded machine; a write that waited for the lock
        # itself would wait as long as the holder holds it.
        assert time.monotonic() - started < 10 * 0.3
        with pytest.raises(DatabaseUnavailable, match="locked by another process"):
            asyncio.run(db.ping())
        holder.execute("ROLLBACK")
        asyncio.run(db.ping())
        db.run(_select_one, write=True)
    finally:
        holder.close()
        db.dispose()
