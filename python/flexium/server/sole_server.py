"""SQLite takes one server at a time. A server keeps in memory what spares the database most
heartbeats and polls (``ServerContext``): a second server on the same file would answer from views
the first one changes under it, and both would queue on one write lock. Several servers run on
PostgreSQL instead (docs/guide/server.md).

The server holds an exclusive ``flock`` on a file beside the database for as long as it runs; the
kernel drops it when the process ends, however it ends (a SIGKILLed server's successor starts at
once). What the file says of its holder names it in the refusal."""

from __future__ import annotations

import fcntl
import json
import os
import time


class ServedElsewhere(Exception):
    """Another server process serves this SQLite database."""


def lock_path(database_file: str) -> str:
    return database_file + ".server-lock"


def claim(database_file: str, *, address: str, link: str) -> int:
    """Take the database file for this process (until it ends); returns the open lock's file
    descriptor, kept open by the caller. Raises ServedElsewhere naming the server that holds it.
    ``link``: where its dashboard's links point (``serving`` reads it back). The database's folder is
    there (``db.require_folder``)."""
    path = lock_path(database_file)
    fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o600)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        holder = _holder(fd)
        os.close(fd)
        raise ServedElsewhere(
            f"another flexium server{holder} serves {database_file}: a SQLite database takes one server at a "
            "time. Stop that server first (or use it), give this one another database (--database "
            "sqlite:///other.db), or run several servers on one PostgreSQL database (--database postgresql://...)"
        ) from None
    os.ftruncate(fd, 0)
    said = {"pid": os.getpid(), "address": address, "link": link, "since": time.time()}
    os.pwrite(fd, json.dumps(said).encode(), 0)
    return fd


def serving_link(database_file: str) -> str | None:
    """Where the dashboard of the server that serves this SQLite database now is (its links' base),
    or None when no server runs on it. Read without taking the lock, even for a moment: a server
    starting then would find it taken and refuse to start."""
    try:
        with open(lock_path(database_file), "rb") as file:
            said = json.loads(file.read(4096) or b"{}")
            stat = os.fstat(file.fileno())
    except (OSError, ValueError):
        return None
    if not isinstance(said, dict) or not isinstance(said.get("link"), str):
        return None
    return said["link"] if _held_by(stat, said.get("pid")) else None


def _held_by(stat: os.stat_result, pid: object) -> bool:
    """Whether process ``pid`` holds the flock on the file of ``stat`` (Linux's /proc/locks)."""
    where = f"{os.major(stat.st_dev):02x}:{os.minor(stat.st_dev):02x}:{stat.st_ino}"
    try:
        with open("/proc/locks") as locks:
            for line in locks:
                fields = line.split()
                if fields[1:2] == ["FLOCK"] and fields[5:6] == [where]:
                    return fields[4] == str(pid)
    except OSError:
        pass
    return False


def _holder(fd: int) -> str:
    try:
        said = json.loads(os.pread(fd, 4096, 0) or b"{}")
        return f" (process {int(said['pid'])}, {said['address']})"
    except (OSError, ValueError, KeyError, TypeError):
        return ""
