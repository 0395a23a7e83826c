"""Workspace and token management straight on the database, for the command line
(``flexium workspace create NAME``, ``flexium token issue|revoke|list``, parsed in
cli/workspaces.py): they work while the server runs or not; each upgrades the schema first, like
the server.

Functions for the CLI to call (each takes ``database_url=None``: then ``$FLEXIUM_DATABASE_URL``,
else the default SQLite file):

- ``create_workspace(name) -> str``: the new workspace's first token (an admin token)
- ``issue_token(workspace, name="", role=protocol.DEFAULT_ISSUED_ROLE, expires_in_s=None) -> wire.TokenCreated``
- ``revoke_token(workspace, token_or_id) -> wire.TokenRevoked`` (with what it minted)
- ``login_code(token) -> str``: a one-time dashboard login code (``/login#code=...``)
- ``login_code_as(workspace, token_or_id=None) -> (str, wire.TokenInfo)``: one for a token named by
  its id or itself, else the workspace's oldest admin token (``flexium token link``)
- ``list_tokens(workspace) -> list[wire.TokenInfo]``, ``list_workspaces() -> list[WorkspaceRecord]``
- ``delete_workspace(workspace, force=False, dry_run=False) -> WorkspaceDeleted``: it and everything of it
"""

from __future__ import annotations

import os
import time

from pydantic import ValidationError

from flexium import protocol, wire
from flexium.server import storage
from flexium.server.db import Database
from flexium.server.errors import InvalidRequest
from flexium.server.settings import Settings, load_settings, sqlite_file
from flexium.server.storage import quotas, retention


class NoDatabase(ValueError):
    """No SQLite file where the settings point: a read or a token would go to a database no server uses."""


def open_database(database_url: str | None = None, *, create: bool = False) -> Database:
    """The database the settings name, its schema upgraded. A SQLite file that is not there is made
    only to ``create`` a workspace (before the server first starts; its folder too, as asked for); else
    it is refused, naming where it was looked for (a mistyped --database or FLEXIUM_HOME would make a
    database no server uses)."""
    return _open(load_settings(database_url=database_url), create=create)


def _open(settings: Settings, *, create: bool = False) -> Database:
    path = sqlite_file(settings.database_url)
    if path is not None and not create and not os.path.exists(path):
        raise NoDatabase(
            f"no database at {path}: `flexium server` makes it when it first starts; check --database, "
            f"{protocol.DATABASE_ENV} or FLEXIUM_HOME (the server's default is under it)"
        )
    if path is not None and create:
        os.makedirs(os.path.dirname(path), mode=0o700, exist_ok=True)
    db = Database(settings.database_url, threads=2)
    db.session_info[quotas.SESSION_KEY] = quotas.Quotas.of(settings)  # FLEXIUM_MAX_TOKENS, as the server
    db.session_info[retention.SESSION_KEY] = retention.Retention.of(settings)  # the audit entries' keep
    db.upgrade()
    return db


def _workspace_id(db: Database, workspace: str) -> int:
    return db.run(storage.get_workspace, write=False, name=workspace).id


def _id_or_value(token_or_id: str | int) -> tuple[int | None, str | None]:
    """A token named on the command line: (its id, None) for a number, else (None, the token)."""
    token_id = protocol.ascii_number(str(token_or_id))
    return (token_id, None) if token_id is not None else (None, str(token_or_id))


def create_workspace(name: str, *, database_url: str | None = None) -> str:
    db = open_database(database_url, create=True)
    try:
        _record, token = db.run(storage.create_workspace, write=True, name=name, now=time.time())
        return token
    finally:
        db.dispose()


def issue_token(
    workspace: str,
    *,
    name: str = "",
    role: str = protocol.DEFAULT_ISSUED_ROLE,
    expires_in_s: float | None = None,
    database_url: str | None = None,
) -> wire.TokenCreated:
    """Issued by the command line (its audit entry says so; no token minted it, so only its
    own revocation, or its expiry after ``expires_in_s``, ends it); the token in clear is ``.token``."""
    try:  # the API's rules for a name (a command line may hold NUL or bytes that are not UTF-8) and a life
        name = wire.TokenRequest(name=name, expires_in_s=expires_in_s).name
    except ValidationError as exc:
        error = exc.errors()[0]
        what = f"token name {name!r}" if error["loc"] == ("name",) else f"a life of {expires_in_s!r} s"
        raise InvalidRequest(f"{what}: {error['msg']}") from None
    db = open_database(database_url)
    try:
        ws = _workspace_id(db, workspace)
        return db.run(
            storage.issue_token,
            write=True,
            workspace_id=ws,
            name=name,
            role=role,
            expires_in_s=expires_in_s,
            now=time.time(),
        )
    finally:
        db.dispose()


def login_code(token: str, *, database_url: str | None = None) -> str:
    db = open_database(database_url)
    try:
        return db.run(storage.login_code_for, write=True, token=token, now=time.time())
    finally:
        db.dispose()


def login_code_as(
    workspace: str, token_or_id: str | int | None = None, *, database_url: str | None = None
) -> tuple[str, wire.TokenInfo]:
    db = open_database(database_url)
    try:
        ws = _workspace_id(db, workspace)
        token_id, token = _id_or_value(token_or_id) if token_or_id is not None else (None, None)
        return db.run(
            storage.login_code_as, write=True, workspace_id=ws, token_id=token_id, token=token, now=time.time()
        )
    finally:
        db.dispose()


def revoke_token(workspace: str, token_or_id: str | int, *, database_url: str | None = None) -> wire.TokenRevoked:
    """Revoke by the token itself or by its id (``list_tokens`` shows ids), and every token it
    minted. Their dashboard sessions end at once. On PostgreSQL the running servers are told (their
    replica link): they refuse the tokens and end their event streams and long-polls at once; a
    server on SQLite stops accepting them within its token cache time (5 s), and ends their streams
    and long-polls at its next sweep, as does a server on PostgreSQL that could not hear it."""
    db = open_database(database_url)
    try:
        ws = _workspace_id(db, workspace)
        token_id, token = _id_or_value(token_or_id)
        revoked = db.run(
            storage.revoke_token, write=True, workspace_id=ws, token_id=token_id, token=token, now=time.time()
        )
        _tell_servers_revoked(db, [revoked.id, *revoked.cascade], announce_in=ws)
        return revoked
    finally:
        db.dispose()


def _tell_servers_revoked(db: Database, token_ids: list[int], *, announce_in: int | None = None) -> None:
    """The servers on a PostgreSQL database refuse these tokens at once and end their event streams and
    long-polls (those on SQLite, and any that could not hear it, within their token cache time, and
    their streams and long-polls at their next sweep); with ``announce_in``, each tells its dashboards
    of that workspace which processes the tokens registered."""
    if db.is_sqlite or not token_ids:
        return
    import psycopg  # PostgreSQL's alone: the command line on SQLite never imports it

    from flexium.server.context import revocation_messages
    from flexium.server.replica_link import tell_replicas

    for message in revocation_messages(token_ids, announce_in=announce_in):
        try:
            tell_replicas(db.url, "command line", message)
        except psycopg.Error:  # revoked all the same: the servers' caches forget it within 5 s
            return


def delete_workspace(
    workspace: str, *, force: bool = False, dry_run: bool = False, database_url: str | None = None
) -> storage.WorkspaceDeleted:
    """The workspace and everything of it (its tokens, processes, commands, queue, drains, history and
    audit log); refused while a process of it was heard within the server's ``stale_after_s`` unless
    ``force``. Its tokens are refused by the running servers as revoked ones are (told at once on
    PostgreSQL; on SQLite within their token cache time, and their streams at the next sweep)."""
    settings = load_settings(database_url=database_url)
    db = _open(settings)
    try:
        deleted = db.run(
            storage.delete_workspace,
            write=True,
            name=workspace,
            now=time.time(),
            stale_after=settings.stale_after_s,
            force=force,
            dry_run=dry_run,
        )
        if not dry_run:
            _tell_servers_revoked(db, deleted.tokens)
        return deleted
    finally:
        db.dispose()


def list_tokens(workspace: str, *, database_url: str | None = None) -> list[wire.TokenInfo]:
    db = open_database(database_url)
    try:
        return db.run(storage.list_tokens, write=False, workspace_id=_workspace_id(db, workspace), now=time.time())
    finally:
        db.dispose()


def list_workspaces(*, database_url: str | None = None) -> list[storage.WorkspaceRecord]:
    db = open_database(database_url)
    try:
        return db.run(storage.list_workspaces, write=False)
    finally:
        db.dispose()
