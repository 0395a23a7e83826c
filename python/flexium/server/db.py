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
  processes (a CLI creating a workspace while the server runs), bounded by ``lock_timeout_s``:
  a process that holds the write lock longer gets this server's writes refused (503), not
  queued. Calls run on the event loop (``call``), where a write waits for the lock at most
  ``INLINE_LOCK_WAIT_S``; one that finds it held longer is handed to a worker thread (which
  waits up to ``lock_timeout_s``), and so are the writes after it until one succeeds: another
  process's lock never stalls the loop.
- The server keeps its connections open, so a file made read-only, deleted or replaced while
  it runs would go on taking writes that are lost or refused at the restart: ``write_problem``
  looks at the file before writes (at most once a second) and refuses them while it is so.
"""

from __future__ import annotations

import contextlib
import functools
import os
import random
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import TYPE_CHECKING, Any, TypeVar

import anyio
import anyio.to_thread
from sqlalchemy import create_engine, event, text
from sqlalchemy.engine import Engine
from sqlalchemy.exc import DBAPIError, OperationalError
from sqlalchemy.orm import Session
from sqlalchemy.pool import StaticPool

from flexium.server.settings import default_data_dir, sqlite_file

if TYPE_CHECKING:
    from alembic.config import Config as AlembicConfig

T = TypeVar("T")

_WRITE_OPTION = "flexium_write"
_LOCK_WAIT_OPTION = "flexium_lock_wait_ms"  # SQLite's busy_timeout for this write
INLINE_LOCK_WAIT_S = 0.05  # what a write on the event loop waits for SQLite's write lock
MIGRATION_LOCK_KEY = 0x666C6578  # PostgreSQL advisory lock: one schema upgrade at a time, whatever the servers
# PostgreSQL: the most a schema change waits for one lock before it gives way (at most half the
# server's deadlock_timeout)
UPGRADE_LOCK_WAIT_MS = 200
UPGRADE_TRIES_S = 120.0  # ... and for how long it tries again
_PG_LOCK_NOT_AVAILABLE = "55P03"  # SQLSTATE of lock_timeout
_PG_DEADLOCK_TIMEOUT_MS = "SELECT setting::int FROM pg_settings WHERE name = 'deadlock_timeout'"
# SQLSTATE of a write refused because the transaction is read-only (default_transaction_read_only,
# or a standby in recovery).
_PG_READ_ONLY = "25006"
_WRITE_CHECK_EVERY_S = 1.0  # how often writes look at the SQLite file (write_problem)
HEALTH_TIMEOUT_S = 1.0  # the health check answers within about this, whatever the database does


def require_folder(database_file: str) -> None:
    """A SQLite file's folder: flexium's own (FLEXIUM_HOME, ~/.flexium) is made where missing; another
    must be there already (a mistyped path would make a database no one meant). DatabaseUnavailable."""
    folder = Path(database_file).parent
    if folder.is_dir():
        return
    if folder.absolute() == default_data_dir().absolute():
        folder.mkdir(mode=0o700, parents=True, exist_ok=True)
        return
    raise DatabaseUnavailable(
        f"no folder {folder} for the SQLite database: check the path, or make the folder first (mkdir -p {folder})"
    )


def redacted(url: str) -> str:
    """A database URL as it may be printed: its password, if any, as ***."""
    if "@" in url and "://" in url:
        scheme, rest = url.split("://", 1)
        creds, host = rest.rsplit("@", 1)
        return f"{scheme}://{creds.split(':', 1)[0]}:***@{host}" if ":" in creds else url
    return url


# Written beside a SQLite file once a server has used it: a file that is gone then was lost.
USED_MARK = ".used"


class DatabaseUnavailable(Exception):
    """The database cannot be reached or is locked for too long (mapped to 503)."""


class DatabaseLocked(DatabaseUnavailable):
    """SQLite: another process holds the write lock."""


class SchemaTooNew(Exception):
    """The database was upgraded by a newer flexium than this one."""


class Database:
    def __init__(self, url: str, *, threads: int = 8, echo: bool = False, lock_timeout_s: float = 30.0) -> None:
        self.url = url
        self.lock_timeout_s = lock_timeout_s
        self.dialect = "sqlite" if url.startswith("sqlite") else "postgresql"
        self._write_lock: threading.Lock | None = threading.Lock() if self.is_sqlite else None
        self._limiter = anyio.CapacityLimiter(threads)
        self._health_limiter = anyio.CapacityLimiter(1)  # a hung check holds no worker of the requests
        self._locked_out = False  # a write found the SQLite file locked: writes go to threads
        self._write_checked_at = 0.0
        self._write_problem: str | None = None
        # What every transaction carries in Session.info (the server's quotas: storage/quotas.py).
        self.session_info: dict[str, Any] = {}
        # The SQLite file (None: PostgreSQL, or in memory) and the file it was when first used: open
        # connections keep writing to a file deleted or replaced under them, and every write is then lost
        # at the restart.
        self._file = sqlite_file(url)
        self.engine = self._create_engine(url, threads=threads, echo=echo)
        self._write_engine = self.engine.execution_options(
            **{_WRITE_OPTION: True, _LOCK_WAIT_OPTION: int(self.lock_timeout_s * 1000)}
        )
        self._inline_write_engine = self.engine.execution_options(
            **{_WRITE_OPTION: True, _LOCK_WAIT_OPTION: int(min(self.lock_timeout_s, INLINE_LOCK_WAIT_S) * 1000)}
        )
        self.inline = self.is_sqlite
        self._checkpointer: threading.Thread | None = None
        self._file_identity: tuple[int, int] | None = None
        self._stop_checkpoints = threading.Event()
        self.migration_seconds: float | None = None

    @property
    def is_sqlite(self) -> bool:
        return self.dialect == "sqlite"

    def _create_engine(self, url: str, *, threads: int, echo: bool) -> Engine:
        if self.is_sqlite:
            if self._file is not None:
                require_folder(self._file)
            kwargs: dict[str, Any] = {"connect_args": {"check_same_thread": False, "timeout": self.lock_timeout_s}}
            if self._file is None:  # in memory
                kwargs["poolclass"] = StaticPool
            else:
                # a connection per worker thread, kept: opening one costs the pragmas again
                kwargs.update(pool_size=threads + 2, max_overflow=4, pool_timeout=30)
            engine = create_engine(url, echo=echo, **kwargs)
            event.listen(
                engine, "connect", functools.partial(_sqlite_on_connect, busy_ms=int(self.lock_timeout_s * 1000))
            )
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
            connect_args={"connect_timeout": 5},  # an unreachable server: refused in seconds, not minutes
        )

    # --- transactions -----------------------------------------------------------------------

    @contextlib.contextmanager
    def session(self, *, write: bool, inline: bool = False) -> Iterator[Session]:
        """One transaction: committed when the block ends, rolled back on an exception.
        ``inline``: on the event loop, so a write waits for a lock at most INLINE_LOCK_WAIT_S."""
        if write:
            problem = self.write_problem()
            if problem is not None:
                raise DatabaseUnavailable(problem)
        lock = self._write_lock if write else None
        wait = min(self.lock_timeout_s, INLINE_LOCK_WAIT_S) if inline else self.lock_timeout_s
        if lock is not None and not lock.acquire(timeout=wait):
            raise DatabaseLocked(self._locked_message())
        write_engine = self._inline_write_engine if inline else self._write_engine
        try:
            with Session(
                bind=write_engine if write else self.engine,
                expire_on_commit=False,
                autoflush=False,
                info=self.session_info,
            ) as session:
                with session.begin():
                    yield session
            if write:
                self._locked_out = False
        except OperationalError as exc:
            if self.is_sqlite and "locked" in str(exc.orig):
                self._locked_out = True
                raise DatabaseLocked(self._locked_message()) from exc
            raise DatabaseUnavailable(_short(exc)) from exc
        except DBAPIError as exc:
            if exc.connection_invalidated:
                raise DatabaseUnavailable(_short(exc)) from exc
            if getattr(exc.orig, "sqlstate", None) == _PG_READ_ONLY:
                raise DatabaseUnavailable(f"the database is read-only: {_short(exc)}") from exc
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
        if self.inline and not (write and self._locked_out):
            try:
                with self.session(write=write, inline=True) as session:
                    return fn(session=session, **kwargs)
            except DatabaseLocked:
                if not write:
                    raise
                # held longer than a loop may wait (BEGIN IMMEDIATE took nothing): a thread waits
        return await anyio.to_thread.run_sync(
            functools.partial(self.run, fn, write=write, **kwargs), limiter=self._limiter
        )

    @property
    def calls_waiting(self) -> int:
        """Database calls queued for a worker thread (a sign of overload when it stays up)."""
        return 0 if self.inline else self._limiter.statistics().tasks_waiting

    async def ping(self, timeout_s: float = HEALTH_TIMEOUT_S) -> None:
        """The health check: raises DatabaseUnavailable unless a write could be made now: the
        database answers within ``timeout_s``, is not read-only and (SQLite) is not locked by
        another process, and its file is the one this server writes to."""
        problem = self.write_problem(fresh=True)
        if problem is not None:
            raise DatabaseUnavailable(problem)
        with anyio.move_on_after(timeout_s):
            await anyio.to_thread.run_sync(
                functools.partial(self._probe, min(self.lock_timeout_s, timeout_s / 2)),
                limiter=self._health_limiter,
                abandon_on_cancel=True,
            )
            return
        raise DatabaseUnavailable(f"no answer within {timeout_s:g} s")

    def _probe(self, wait_s: float) -> None:
        """SQLite: take the write lock and let go, on a connection of its own that waits at most
        ``wait_s`` (another process holding the lock shows here); PostgreSQL: ask whether this
        session may write."""
        if self._file is not None:
            import sqlite3

            conn = sqlite3.connect(self._file, timeout=wait_s, isolation_level=None)
            try:
                conn.execute("BEGIN IMMEDIATE")
                conn.execute("ROLLBACK")
            except sqlite3.OperationalError as exc:
                if "locked" in str(exc):
                    self._locked_out = True
                    raise DatabaseLocked(self._locked_message()) from exc
                raise DatabaseUnavailable(str(exc)) from exc
            finally:
                conn.close()
            return
        if self.is_sqlite:  # in memory
            self.run(_select_one, write=False)
            return
        read_only = self.run(_pg_read_only, write=False)
        if read_only is not None:
            raise DatabaseUnavailable(read_only)

    def _locked_message(self) -> str:
        return (
            f"the database file is locked by another process (waited {self.lock_timeout_s:g} s; "
            "--db-lock-timeout): writes are refused until it lets go"
        )

    def write_problem(self, *, fresh: bool = False) -> str | None:
        """Why a write now would be lost or refused (SQLite: the file is gone, replaced or
        read-only); looked at once a second at most, unless ``fresh``."""
        if self._file is None:
            return None
        now = time.monotonic()
        if fresh or now - self._write_checked_at >= _WRITE_CHECK_EVERY_S:
            self._write_checked_at = now
            self._write_problem = self.file_problem() or self._read_only_problem()
        return self._write_problem

    def _read_only_problem(self) -> str | None:
        assert self._file is not None
        if not os.access(self._file, os.W_OK):
            return f"the database file {self._file} is read-only: writes are refused until it is writable again"
        folder = os.path.dirname(self._file)
        if not os.access(folder, os.W_OK):
            return (
                f"the folder of the database file, {folder}, is read-only: SQLite cannot make its -wal and "
                "-shm files there; writes are refused until it is writable again"
            )
        return None

    def file_problem(self) -> str | None:
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
        `new_database`: DatabaseUnavailable says where it was and what to do. PostgreSQL: one
        server at a time (``MIGRATION_LOCK_KEY``), giving way to the requests of replicas that
        serve meanwhile (``UPGRADE_LOCK_WAIT_MS``)."""
        self._check_not_lost(new_database=new_database)
        self._keep_file_private()
        from alembic import command
        from alembic.runtime.migration import MigrationContext
        from alembic.script import ScriptDirectory

        config = migration_config()
        script = ScriptDirectory.from_config(config)
        known = {rev.revision for rev in script.walk_revisions()}
        start = time.perf_counter()
        give_up = time.monotonic() + UPGRADE_TRIES_S
        lock = self._write_lock
        if lock is not None:
            lock.acquire()
        try:
            while True:
                try:
                    with self._write_engine.begin() as conn:
                        if not self.is_sqlite:
                            conn.execute(text("SELECT pg_advisory_xact_lock(:k)"), {"k": MIGRATION_LOCK_KEY})
                            # Older replicas serve on while it runs: a request holding one table and
                            # waiting for another this change holds would be a deadlock's victim
                            # (refused, 503) once it waited deadlock_timeout (1 s); the change
                            # waits less for each lock, gives way, and tries again.
                            deadlock_ms = conn.execute(text(_PG_DEADLOCK_TIMEOUT_MS)).scalar_one()
                            wait_ms = max(1, min(UPGRADE_LOCK_WAIT_MS, int(deadlock_ms) // 2))
                            conn.execute(text(f"SET LOCAL lock_timeout = {wait_ms}"))
                        unknown = set(MigrationContext.configure(conn).get_current_heads()) - known
                        if unknown:
                            raise SchemaTooNew(
                                f"the database schema is at revision {', '.join(sorted(unknown))}, "
                                "which this flexium does not know: upgrade flexium"
                            )
                        config.attributes["connection"] = conn
                        command.upgrade(config, "head")
                    break
                except OperationalError as exc:
                    if getattr(exc.orig, "sqlstate", None) != _PG_LOCK_NOT_AVAILABLE:
                        raise
                    if time.monotonic() > give_up:
                        raise DatabaseUnavailable(
                            f"the schema upgrade found its tables locked by other sessions for {UPGRADE_TRIES_S:g} s "
                            "(a long transaction? pg_stat_activity shows it); start the server again once it ended"
                        ) from exc
                    time.sleep(random.uniform(0.1, 0.5))  # the requests it held up go first
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

    def _keep_file_private(self) -> None:
        """SQLite: the database holds token hashes, login codes and every job's command line, so
        its file is its owner's alone (0600). SQLite makes the -wal and -shm files with the
        database file's mode, so a file made here 0600 keeps them so; files an earlier server
        left readable to others are made 0600."""
        if self._file is None:
            return
        if not os.path.exists(self._file):
            with contextlib.suppress(OSError):  # a folder it cannot write to: SQLite says so below
                os.close(os.open(self._file, os.O_CREAT | os.O_WRONLY, 0o600))
        for path in (self._file, self._file + "-wal", self._file + "-shm"):
            try:
                if os.stat(path).st_mode & 0o077:
                    os.chmod(path, 0o600)
            except FileNotFoundError:
                pass
            except PermissionError:  # another user's file: theirs to restrict
                pass

    def start_checkpoints(self, interval: float = 1.0) -> None:
        """SQLite: move the WAL into the database file from a thread of its own. Serving
        connections have automatic checkpoints off: a checkpoint (the one fsync of WAL mode)
        inside a request would stall the event loop for as long as the disk takes."""
        path = self._file
        if path is None or self._checkpointer is not None:
            return
        import sqlite3

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


def migration_config() -> AlembicConfig:
    """Alembic's configuration of this version's schema changes (``migrations/versions``)."""
    from alembic.config import Config

    config = Config()
    config.set_main_option("script_location", "flexium.server:migrations")
    return config


def _select_one(*, session: Session) -> None:
    session.execute(text("SELECT 1"))


def _pg_read_only(*, session: Session) -> str | None:
    in_recovery, read_only = session.execute(
        text("SELECT pg_is_in_recovery(), current_setting('transaction_read_only')")
    ).one()
    if in_recovery:
        return "the database is read-only: the PostgreSQL server is a standby in recovery"
    if read_only == "on":
        return "the database is read-only: default_transaction_read_only is on"
    return None


def _sqlite_on_connect(dbapi_connection: Any, _record: Any, *, busy_ms: int) -> None:
    dbapi_connection.isolation_level = None  # we emit BEGIN ourselves (see module docstring)
    cursor = dbapi_connection.cursor()
    # wal_autocheckpoint=0: Database.start_checkpoints does it off the request path; without
    # it (the CLI), SQLite checkpoints when the last connection closes.
    for pragma in (
        "journal_mode=WAL",
        "synchronous=NORMAL",
        f"busy_timeout={busy_ms}",
        "foreign_keys=ON",
        "temp_store=MEMORY",
        "cache_size=-16000",
        "wal_autocheckpoint=0",
    ):
        cursor.execute(f"PRAGMA {pragma}")
    cursor.close()


def _sqlite_on_begin(conn: Any) -> None:
    options = conn.get_execution_options()
    if options.get(_WRITE_OPTION, False):
        conn.exec_driver_sql(f"PRAGMA busy_timeout={options[_LOCK_WAIT_OPTION]}")
        conn.exec_driver_sql("BEGIN IMMEDIATE")
    else:
        conn.exec_driver_sql("BEGIN")


def _short(exc: BaseException) -> str:
    orig = getattr(exc, "orig", None) or exc
    return str(orig).strip().splitlines()[0][:300] if str(orig).strip() else type(orig).__name__
