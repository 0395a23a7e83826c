"""The one database module: engine, SQLite pragmas, transactions, schema migrations.

Everything dialect-specific lives here so storage functions are plain SQLAlchemy for both
SQLite and PostgreSQL.

SQLite hazards handled here:
- WAL lets readers run beside the one writer; ``synchronous=NORMAL`` is durable across a
  crash of this process (only power loss can drop the last commits).
- A deferred transaction that reads and then writes can fail at once with SQLITE_BUSY when
  another writer got in first (the busy timeout does not help there), so write transactions
  start with ``BEGIN IMMEDIATE``. pysqlite's own transaction handling is switched off for that.
- The busy handler sleeps in steps up to 100 ms, which would wreck delivery latency, so
  writers inside this server queue on a lock instead; ``busy_timeout`` still covers other
  processes (a CLI creating a workspace while the server runs).
"""

from __future__ import annotations

import contextlib
import functools
import os
import threading
import time
from pathlib import Path
from typing import Any, Callable, Iterator, Optional, TypeVar

import anyio
import anyio.to_thread
from sqlalchemy import create_engine, event, text
from sqlalchemy.engine import Engine
from sqlalchemy.exc import DBAPIError, OperationalError
from sqlalchemy.orm import Session
from sqlalchemy.pool import StaticPool

T = TypeVar("T")

_WRITE_OPTION = "flexium_write"
_PG_MIGRATION_LOCK = 0x666C6578  # any constant; serialises schema upgrades of several servers


def _sqlite_file(url: str) -> Optional[str]:
    path = url.split(":///", 1)[1] if ":///" in url else ""
    return None if path in ("", ":memory:") else os.path.abspath(path)


# Written beside a SQLite file once a server has used it: a file that is gone then was lost.
USED_MARK = ".used"


class DatabaseUnavailable(Exception):
    """The database cannot be reached or is locked for too long (mapped to 503)."""


class SchemaTooNew(Exception):
    """The database was upgraded by a newer flexium than this one."""


class Database:
    def __init__(self, url: str, *, threads: int = 8, echo: bool = False) -> None:
        self.url = url
        self.dialect = "sqlite" if url.startswith("sqlite") else "postgresql"
        self._write_lock: Optional[threading.Lock] = threading.Lock() if self.is_sqlite else None
        self._limiter = anyio.CapacityLimiter(threads)
        self.engine = self._create_engine(url, threads=threads, echo=echo)
        self._write_engine = self.engine.execution_options(**{_WRITE_OPTION: True})
        self.inline = self.is_sqlite
        self._checkpointer: Optional[threading.Thread] = None
        # The SQLite file and the file it was when first used: open connections keep writing to
        # a file deleted or replaced under them, and every write is then lost at the restart.
        self._file = _sqlite_file(url) if self.is_sqlite else None
        self._file_identity: Optional[tuple[int, int]] = None
        self._stop_checkpoints = threading.Event()
        self.migration_seconds: Optional[float] = None

    @property
    def is_sqlite(self) -> bool:
        return self.dialect == "sqlite"

    def _create_engine(self, url: str, *, threads: int, echo: bool) -> Engine:
        if self.is_sqlite:
            path = url.split(":///", 1)[1] if ":///" in url else ""
            in_memory = path in ("", ":memory:")
            if not in_memory:
                Path(path).parent.mkdir(parents=True, exist_ok=True)
            kwargs: dict[str, Any] = {"connect_args": {"check_same_thread": False, "timeout": 30}}
            if in_memory:
                kwargs["poolclass"] = StaticPool
            else:
                # a connection per worker thread, kept: opening one costs the pragmas again
                kwargs.update(pool_size=threads + 2, max_overflow=4, pool_timeout=30)
            engine = create_engine(url, echo=echo, **kwargs)
            event.listen(engine, "connect", _sqlite_on_connect)
            event.listen(engine, "begin", _sqlite_on_begin)
            return engine
        return create_engine(
            url,
            echo=echo,
            pool_size=threads + 2,
            max_overflow=4,
            pool_timeout=30,
            pool_pre_ping=True,
            pool_recycle=1800,
        )

    # --- transactions -----------------------------------------------------------------------

    @contextlib.contextmanager
    def session(self, *, write: bool) -> Iterator[Session]:
        """One transaction: committed when the block ends, rolled back on an exception."""
        lock = self._write_lock if write else None
        if lock is not None:
            lock.acquire()
        try:
            with Session(
                bind=self._write_engine if write else self.engine, expire_on_commit=False, autoflush=False
            ) as session:
                with session.begin():
                    yield session
        except OperationalError as exc:
            raise DatabaseUnavailable(_short(exc)) from exc
        except DBAPIError as exc:
            if exc.connection_invalidated:
                raise DatabaseUnavailable(_short(exc)) from exc
            raise
        finally:
            if lock is not None:
                lock.release()

    def run(self, fn: Callable[..., T], /, *, write: bool, **kwargs: Any) -> T:
        """Call a storage function ``fn(session=..., **kwargs)`` inside one transaction."""
        with self.session(write=write) as session:
            return fn(session=session, **kwargs)

    async def call(self, fn: Callable[..., T], /, *, write: bool, **kwargs: Any) -> T:
        """``run`` from the event loop.

        SQLite: right here. On a worker thread each statement hands the GIL back and forth with
        the busy event loop (up to the 5 ms switch interval each), which made command delivery
        take hundreds of ms under load; a call is a few hundred microseconds of work holding
        the GIL anyway, writes take turns, and checkpoints (the one fsync) run on their own
        thread (``start_checkpoints``).
        PostgreSQL: on a worker thread, so other requests go on while psycopg waits for the
        server. (SQLAlchemy's asyncio bridge measured no better here, with greenlet to carry.)
        """
        if self.inline:
            return self.run(fn, write=write, **kwargs)
        return await anyio.to_thread.run_sync(
            functools.partial(self.run, fn, write=write, **kwargs), limiter=self._limiter
        )

    @property
    def calls_waiting(self) -> int:
        """Database calls queued for a worker thread (a sign of overload when it stays up)."""
        return 0 if self.inline else self._limiter.statistics().tasks_waiting

    async def ping(self) -> None:
        """Raises DatabaseUnavailable when the database does not answer, or (SQLite) its file
        is no longer the one the server writes to (the health check)."""
        await self.call(_select_one, write=False)
        problem = self.file_problem()
        if problem is not None:
            raise DatabaseUnavailable(problem)

    def file_problem(self) -> Optional[str]:
        """Why the SQLite file on disk is not the database this server writes to; None when it
        is (or the database is not a file)."""
        if self._file is None:
            return None
        try:
            found = os.stat(self._file)
        except FileNotFoundError:
            return (
                f"the database file {self._file} is gone (deleted or moved while the server ran): what is "
                "written now is lost when the server stops; put the file back, or stop the server"
            )
        identity = (found.st_dev, found.st_ino)
        if self._file_identity is None:
            self._file_identity = identity
        elif identity != self._file_identity:
            return (
                f"the database file {self._file} was replaced while the server ran: the server still writes to "
                "the old one; restart the server to use the new one"
            )
        return None

    # --- schema -----------------------------------------------------------------------------

    def upgrade(self, *, new_database: bool = False) -> float:
        """Create or upgrade the schema to this version's head; returns seconds taken. A SQLite
        file this server used before and that is gone now is not created again empty unless
        `new_database`: DatabaseUnavailable says where it was and what to do."""
        self._check_not_lost(new_database=new_database)
        from alembic import command
        from alembic.config import Config
        from alembic.runtime.migration import MigrationContext
        from alembic.script import ScriptDirectory

        config = Config()
        config.set_main_option("script_location", "flexium.server:migrations")
        script = ScriptDirectory.from_config(config)
        known = {rev.revision for rev in script.walk_revisions()}
        start = time.perf_counter()
        lock = self._write_lock
        if lock is not None:
            lock.acquire()
        try:
            with self._write_engine.begin() as conn:
                if not self.is_sqlite:
                    conn.execute(text("SELECT pg_advisory_xact_lock(:k)"), {"k": _PG_MIGRATION_LOCK})
                unknown = set(MigrationContext.configure(conn).get_current_heads()) - known
                if unknown:
                    raise SchemaTooNew(
                        f"the database schema is at revision {', '.join(sorted(unknown))}, "
                        "which this flexium does not know: upgrade flexium"
                    )
                config.attributes["connection"] = conn
                command.upgrade(config, "head")
        except OperationalError as exc:
            raise DatabaseUnavailable(_short(exc)) from exc
        finally:
            if lock is not None:
                lock.release()
        self.migration_seconds = time.perf_counter() - start
        self.file_problem()  # the file this server writes to, from now on
        if self._file is not None:
            Path(self._file + USED_MARK).write_text("a flexium server used the database file beside this one\n")
        return self.migration_seconds

    def _check_not_lost(self, *, new_database: bool) -> None:
        if self._file is None or os.path.exists(self._file):
            return
        mark = Path(self._file + USED_MARK)
        if mark.exists() and not new_database:
            raise DatabaseUnavailable(
                f"the database file {self._file} is gone, though a server used it before ({mark} says so): put it "
                "back (with its -wal file, if any); to begin with an empty one instead, start `flexium server` with "
                f"--new-database, or delete {mark}"
            )

    def start_checkpoints(self, interval: float = 1.0) -> None:
        """SQLite: move the WAL into the database file from a thread of its own. Serving
        connections have automatic checkpoints off: a checkpoint (the one fsync of WAL mode)
        inside a request would stall the event loop for as long as the disk takes."""
        if not self.is_sqlite or self._checkpointer is not None or ":///" not in self.url:
            return
        import sqlite3

        path = self.url.split(":///", 1)[1]
        if path in ("", ":memory:"):
            return

        def loop() -> None:
            conn = sqlite3.connect(path, timeout=30, isolation_level=None, check_same_thread=False)
            try:
                while not self._stop_checkpoints.wait(interval):
                    try:
                        conn.execute("PRAGMA wal_checkpoint(PASSIVE)").fetchall()
                    except sqlite3.Error:
                        pass  # busy now; the next round catches up
            finally:
                conn.close()

        self._stop_checkpoints.clear()
        self._checkpointer = threading.Thread(target=loop, name="flexium-sqlite-checkpoint", daemon=True)
        self._checkpointer.start()

    def stop_checkpoints(self) -> None:
        if self._checkpointer is not None:
            self._stop_checkpoints.set()
            self._checkpointer.join(10)
            self._checkpointer = None

    def dispose(self) -> None:
        self.stop_checkpoints()
        self.engine.dispose()


def _select_one(*, session: Session) -> None:
    session.execute(text("SELECT 1"))


def _sqlite_on_connect(dbapi_connection: Any, _record: Any) -> None:
    dbapi_connection.isolation_level = None  # we emit BEGIN ourselves (see module docstring)
    cursor = dbapi_connection.cursor()
    # wal_autocheckpoint=0: Database.start_checkpoints does it off the request path; without
    # it (the CLI), SQLite checkpoints when the last connection closes.
    for pragma in (
        "journal_mode=WAL",
        "synchronous=NORMAL",
        "busy_timeout=30000",
        "foreign_keys=ON",
        "temp_store=MEMORY",
        "cache_size=-16000",
        "wal_autocheckpoint=0",
    ):
        cursor.execute(f"PRAGMA {pragma}")
    cursor.close()


def _sqlite_on_begin(conn: Any) -> None:
    write = conn.get_execution_options().get(_WRITE_OPTION, False)
    conn.exec_driver_sql("BEGIN IMMEDIATE" if write else "BEGIN")


def _short(exc: BaseException) -> str:
    orig = getattr(exc, "orig", None) or exc
    return str(orig).strip().splitlines()[0][:300] if str(orig).strip() else type(orig).__name__
