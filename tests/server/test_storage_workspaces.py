"""Workspaces and tokens in storage, and the names and addresses they are checked by; on SQLite
and PostgreSQL."""

from __future__ import annotations

import time

import pytest
from sqlalchemy import text

from flexium.server import errors, storage
from flexium.server.db import Database
from support.storage import (
    NOW,
    make_workspace,
)


def test_workspace_tokens_hashed_and_revocable(db: Database) -> None:
    ws, token = make_workspace(db)
    assert token.startswith("flx_") and len(token) > 40
    with db.session(write=False) as s:
        stored = [r[0] for r in s.execute(text("SELECT token_hash FROM tokens"))]
    assert token not in stored and storage.hash_token(token) in stored
    auth = db.run(storage.authenticate, write=False, token=token, now=time.time())
    assert auth is not None and auth.workspace == "team" and auth.workspace_id == ws
    created = db.run(storage.issue_token, write=True, workspace_id=ws, name="ci", now=NOW)
    second = created.token
    assert db.run(storage.authenticate, write=False, token=second, now=time.time()).token_id == created.id
    db.run(storage.revoke_token, write=True, workspace_id=ws, token=second, now=NOW)
    assert db.run(storage.authenticate, write=False, token=second, now=time.time()) is None
    assert db.run(storage.authenticate, write=False, token=token, now=time.time()) is not None
    assert db.run(storage.authenticate, write=False, token="flx_nope", now=time.time()) is None
    tokens = db.run(storage.list_tokens, write=False, workspace_id=ws, now=time.time())
    assert [t.revoked for t in tokens] == [False, True]


def test_workspace_names(db: Database) -> None:
    make_workspace(db, "a")
    with pytest.raises(errors.Conflict):
        make_workspace(db, "a")
    for bad in ("", "A", "-x", "a b", "x" * 64, "a/b"):
        with pytest.raises(errors.InvalidRequest):
            make_workspace(db, bad)
    assert [w.name for w in db.run(storage.list_workspaces, write=False)] == ["a"]


def test_default_workspace_only_on_empty_database(db: Database) -> None:
    token = db.run(storage.ensure_default_workspace, write=True, now=NOW)
    assert token and db.run(storage.authenticate, write=False, token=token, now=time.time()).workspace == "default"
    assert db.run(storage.ensure_default_workspace, write=True, now=NOW) is None


def test_revoke_token_of_other_workspace_is_not_found(db: Database) -> None:
    ws_a, _ = make_workspace(db, "a")
    _ws_b, token_b = make_workspace(db, "b")
    with pytest.raises(errors.NotFound):
        db.run(storage.revoke_token, write=True, workspace_id=ws_a, token=token_b, now=NOW)


@pytest.mark.parametrize("name", ["team\n", "team\r\n", "Team", "-team", "te am", ""])
def test_a_workspace_name_is_checked_to_its_last_character(db: Database, name: str) -> None:
    with pytest.raises(errors.InvalidRequest):
        db.run(storage.create_workspace, write=True, name=name, now=NOW)
    assert all(w.name != name for w in db.run(storage.list_workspaces, write=False))


def test_a_server_address_whose_port_is_not_ascii_digits_is_refused() -> None:
    from flexium import protocol

    for address in ("host:８０８０/team", "host:²/team"):  # int() reads the first, refuses the second
        with pytest.raises(ValueError):
            protocol.parse_server_address(address)
    assert (
        protocol.ascii_number("42") == 42 and protocol.ascii_number("²") is None and protocol.ascii_number("١") is None
    )
