"""What the server's health check says about its database (Database.ping)."""

from __future__ import annotations

import asyncio
import os
from pathlib import Path

import pytest

from flexium.server.db import Database, DatabaseUnavailable


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
