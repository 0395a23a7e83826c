"""Fixtures for server tests. Every test that takes ``database_url`` runs twice: on a fresh
SQLite file and on a fresh PostgreSQL database (``FLEXIUM_TEST_POSTGRES_URL`` names an
admin connection; ci/test.sh starts a server and sets it. Without it the PostgreSQL half is
skipped, except under CI, where that is an error). ``db`` and ``api`` run twice the same way on
a fresh database whose schema is already at head: a copy of one migrated once per session (and
per pytest-xdist worker), since running every migration for each of some 600 tests took a third
of a second of CPU each; they still upgrade it at set-up, which finds nothing to do."""

from __future__ import annotations

import os
import resource
import sqlite3
import uuid
from collections.abc import Iterator
from contextlib import closing
from pathlib import Path

import pytest

pytest.importorskip("fastapi", reason='the server extra is not installed: pip install ".[server]"')

import warnings  # noqa: E402

# Starlette suggests a successor of httpx for its TestClient; httpx still works.
warnings.filterwarnings("ignore", message=".*httpx.*")

from fastapi.testclient import TestClient  # noqa: E402

from flexium.server.app import bootstrap, create_app  # noqa: E402
from flexium.server.db import Database  # noqa: E402
from flexium.server.settings import Settings, normalize_database_url  # noqa: E402
from support.server import Api, LiveServer, make_settings  # noqa: E402

PG_ENV = "FLEXIUM_TEST_POSTGRES_URL"


def _pg_admin_url() -> str | None:
    url = os.environ.get(PG_ENV)
    if not url and os.environ.get("CI"):
        raise RuntimeError(f"{PG_ENV} is not set: ci/test.sh starts PostgreSQL and sets it")
    return url


def _create_database(template: str | None = None) -> str:
    """A new PostgreSQL database (a copy of `template`, else empty); its URL."""
    import psycopg

    admin = _pg_admin_url()
    if not admin:
        pytest.skip(f"PostgreSQL: set {PG_ENV}")
    name = "flx_" + uuid.uuid4().hex[:12]
    with psycopg.connect(admin, autocommit=True) as conn:
        conn.execute(f'CREATE DATABASE "{name}"' + (f' TEMPLATE "{template}"' if template else ""))
    return f"{admin.rsplit('/', 1)[0]}/{name}"


def _drop_database(url: str) -> None:
    import psycopg

    admin = _pg_admin_url()
    assert admin
    with psycopg.connect(admin, autocommit=True) as conn:
        conn.execute(f'DROP DATABASE IF EXISTS "{url.rsplit("/", 1)[1]}" WITH (FORCE)')


def _migrate_to_head(url: str) -> None:
    database = Database(normalize_database_url(url), threads=1)
    try:
        database.upgrade(new_database=True)
    finally:
        database.dispose()


@pytest.fixture(params=["sqlite", "postgresql"])
def database_kind(request: pytest.FixtureRequest) -> str:
    return str(request.param)


@pytest.fixture
def database_url(database_kind: str, tmp_path: Path) -> Iterator[str]:
    """A fresh, empty database."""
    if database_kind == "sqlite":
        yield f"sqlite:///{tmp_path / 'server.db'}"
        return
    url = _create_database()
    try:
        yield url
    finally:
        _drop_database(url)


@pytest.fixture(scope="session")
def sqlite_at_head(tmp_path_factory: pytest.TempPathFactory) -> Path:
    path = tmp_path_factory.mktemp("schema-at-head") / "server.db"
    _migrate_to_head(f"sqlite:///{path}")
    return path


@pytest.fixture(scope="session")
def postgresql_at_head() -> Iterator[str]:
    """The name of a database migrated to head, the template of each test's copy (PostgreSQL
    copies it only while nobody is connected to it: the migration's connections are closed)."""
    url = _create_database()
    try:
        _migrate_to_head(url)
        yield url.rsplit("/", 1)[1]
    finally:
        _drop_database(url)


@pytest.fixture
def database_url_at_head(database_kind: str, tmp_path: Path, request: pytest.FixtureRequest) -> Iterator[str]:
    """A fresh database whose schema is at head, as if this version's server had just made it."""
    if database_kind == "sqlite":
        path = tmp_path / "server.db"
        template: Path = request.getfixturevalue("sqlite_at_head")
        with closing(sqlite3.connect(template)) as source, closing(sqlite3.connect(path)) as copy:
            source.backup(copy)
        yield f"sqlite:///{path}"
        return
    url = _create_database(template=request.getfixturevalue("postgresql_at_head"))
    try:
        yield url
    finally:
        _drop_database(url)


@pytest.fixture
def db(database_url_at_head: str) -> Iterator[Database]:
    database = Database(normalize_database_url(database_url_at_head), threads=8)
    database.upgrade()
    yield database
    database.dispose()


@pytest.fixture
def app_settings(database_url_at_head: str) -> Settings:
    return make_settings(database_url_at_head)


@pytest.fixture
def api(app_settings: Settings) -> Iterator[Api]:
    app = create_app(app_settings)
    token = bootstrap(app.state.ctx.db)
    assert token
    with TestClient(app) as client:
        bound = Api(client, token)
        bound.ctx = app.state.ctx
        bound.db = app.state.ctx.db
        yield bound


def _live_server(database_url: str, tmp_path: Path, *, sweep_interval_s: float) -> Iterator[LiveServer]:
    server = LiveServer(database_url, str(tmp_path / "home"), "--sweep-interval", str(sweep_interval_s))
    server.start()
    try:
        yield server
    finally:
        server.stop()


@pytest.fixture
def live_server(database_url: str, tmp_path: Path) -> Iterator[LiveServer]:
    """A real server process on the test's database (no sweep of its own during a test)."""
    yield from _live_server(database_url, tmp_path, sweep_interval_s=3600)


@pytest.fixture
def swept_live_server(database_url: str, tmp_path: Path) -> Iterator[LiveServer]:
    """A real server process on the test's database that sweeps every second: what it finds by itself
    (a token or a session ended on the database without its knowing) shows within the test."""
    yield from _live_server(database_url, tmp_path, sweep_interval_s=1)


@pytest.fixture
def enough_file_descriptors() -> None:
    """This test process may open the thousands of sockets a flood test holds: its soft limit on
    open files raised to 8192, or to its hard limit if that is lower."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    wanted = 8192 if hard == resource.RLIM_INFINITY else min(hard, 8192)
    if soft != resource.RLIM_INFINITY and soft < wanted:
        resource.setrlimit(resource.RLIMIT_NOFILE, (wanted, hard))
