"""Fixtures for server tests. Every test that takes ``database_url`` runs twice: on a fresh
SQLite file and on a fresh PostgreSQL database (``FLEXIUM_TEST_POSTGRES_URL`` names an
admin connection; ci/test.sh starts a server and sets it. Without it the PostgreSQL half is
skipped, except under CI, where that is an error)."""

from __future__ import annotations

import os
import uuid
from collections.abc import Iterator
from typing import Any

import pytest

pytest.importorskip("fastapi", reason='the server extra is not installed: pip install ".[server]"')

import warnings  # noqa: E402

# Starlette suggests a successor of httpx for its TestClient; httpx still works.
warnings.filterwarnings("ignore", message=".*httpx.*")

from fastapi.testclient import TestClient  # noqa: E402

from flexium.server.app import bootstrap, create_app  # noqa: E402
from flexium.server.db import Database  # noqa: E402
from flexium.server.settings import Settings, normalize_database_url  # noqa: E402
from support.server import Api, make_settings  # noqa: E402

PG_ENV = "FLEXIUM_TEST_POSTGRES_URL"


def _pg_admin_url() -> str | None:
    url = os.environ.get(PG_ENV)
    if not url and os.environ.get("CI"):
        raise RuntimeError(f"{PG_ENV} is not set: ci/test.sh starts PostgreSQL and sets it")
    return url


@pytest.fixture(params=["sqlite", "postgresql"])
def database_url(request: pytest.FixtureRequest, tmp_path: Any) -> Iterator[str]:
    if request.param == "sqlite":
        yield f"sqlite:///{tmp_path / 'server.db'}"
        return
    admin = _pg_admin_url()
    if not admin:
        pytest.skip(f"PostgreSQL: set {PG_ENV}")
    import psycopg

    name = "flx_" + uuid.uuid4().hex[:12]
    with psycopg.connect(admin, autocommit=True) as conn:
        conn.execute(f'CREATE DATABASE "{name}"')
    base = admin.rsplit("/", 1)[0]
    try:
        yield f"{base}/{name}"
    finally:
        with psycopg.connect(admin, autocommit=True) as conn:
            conn.execute(f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)')


@pytest.fixture
def db(database_url: str) -> Iterator[Database]:
    database = Database(normalize_database_url(database_url), threads=8)
    database.upgrade()
    yield database
    database.dispose()


@pytest.fixture
def app_settings(database_url: str) -> Settings:
    return make_settings(database_url)


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
