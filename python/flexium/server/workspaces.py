"""Workspace and token management for the command line (``flexium workspace create NAME``,
``flexium token issue|revoke|list``). These work on the database directly, so they work while
the server runs or not; each upgrades the schema first, like the server.

Functions for the CLI to call (each takes ``database_url=None``: then ``$FLEXIUM_DATABASE_URL``,
else the default SQLite file):

- ``create_workspace(name) -> str``: the new workspace's first token
- ``issue_token(workspace, name="") -> str``
- ``revoke_token(workspace, token_or_id) -> dict``
- ``list_tokens(workspace) -> list[dict]``, ``list_workspaces() -> list[dict]``
- ``main(argv) -> int``: the whole command line, token alone on the last line of output
"""

from __future__ import annotations

import argparse
import sys
import time
from typing import Any, Optional, Sequence, Union

from flexium import protocol
from flexium.server import storage
from flexium.server.db import Database, DatabaseUnavailable, SchemaTooNew
from flexium.server.errors import ApiError
from flexium.server.settings import load_settings


def open_database(database_url: Optional[str] = None) -> Database:
    settings = load_settings(database_url=database_url)
    db = Database(settings.database_url, threads=2)
    db.upgrade()
    return db


def _workspace_id(db: Database, workspace: str) -> int:
    return int(db.run(storage.get_workspace, write=False, name=workspace)["id"])


def create_workspace(name: str, *, database_url: Optional[str] = None) -> str:
    db = open_database(database_url)
    try:
        _row, token = db.run(storage.create_workspace, write=True, name=name, now=time.time())
        return token
    finally:
        db.dispose()


def issue_token(workspace: str, *, name: str = "", database_url: Optional[str] = None) -> str:
    db = open_database(database_url)
    try:
        ws = _workspace_id(db, workspace)
        _info, token = db.run(storage.issue_token, write=True, workspace_id=ws, name=name, now=time.time())
        return token
    finally:
        db.dispose()


def revoke_token(workspace: str, token_or_id: Union[str, int], *,
                 database_url: Optional[str] = None) -> dict[str, Any]:
    """Revoke by the token itself or by its id (``list_tokens`` shows ids). A running server
    stops accepting it within its token cache time (5 s)."""
    db = open_database(database_url)
    try:
        ws = _workspace_id(db, workspace)
        text = str(token_or_id)
        if text.isdigit():
            return db.run(storage.revoke_token, write=True, workspace_id=ws, token_id=int(text), now=time.time())
        return db.run(storage.revoke_token, write=True, workspace_id=ws, token=text, now=time.time())
    finally:
        db.dispose()


def list_tokens(workspace: str, *, database_url: Optional[str] = None) -> list[dict[str, Any]]:
    db = open_database(database_url)
    try:
        return db.run(storage.list_tokens, write=False, workspace_id=_workspace_id(db, workspace))
    finally:
        db.dispose()


def list_workspaces(*, database_url: Optional[str] = None) -> list[dict[str, Any]]:
    db = open_database(database_url)
    try:
        return db.run(storage.list_workspaces, write=False)
    finally:
        db.dispose()


def build_parser(prog: str = "flexium") -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog=prog)
    db_help = f"database URL (default ${protocol.DATABASE_ENV}, else ~/.flexium/server.db)"
    groups = parser.add_subparsers(dest="group", required=True)
    ws = groups.add_parser("workspace", help="workspaces").add_subparsers(dest="action", required=True)
    p = ws.add_parser("create", help="create a workspace; prints its first token on the last line")
    p.add_argument("name")
    p.add_argument("--database", metavar="URL", help=db_help)
    p = ws.add_parser("list", help="list workspaces")
    p.add_argument("--database", metavar="URL", help=db_help)
    tok = groups.add_parser("token", help="tokens").add_subparsers(dest="action", required=True)
    p = tok.add_parser("issue", help="issue another token; prints it on the last line")
    p.add_argument("workspace")
    p.add_argument("--name", default="", help="a label to recognise it by")
    p.add_argument("--database", metavar="URL", help=db_help)
    p = tok.add_parser("revoke", help="revoke a token (by value or id)")
    p.add_argument("workspace")
    p.add_argument("token", help="the token, or its id from 'token list'")
    p.add_argument("--database", metavar="URL", help=db_help)
    p = tok.add_parser("list", help="list a workspace's tokens (no secrets)")
    p.add_argument("workspace")
    p.add_argument("--database", metavar="URL", help=db_help)
    return parser


def main(argv: Optional[Sequence[str]] = None) -> int:
    args = build_parser().parse_args(argv)
    url = args.database
    try:
        if args.group == "workspace" and args.action == "create":
            token = create_workspace(args.name, database_url=url)
            print(f"created workspace '{args.name}'. Its token (shown once; "
                  f"training jobs read it from {protocol.TOKEN_ENV}):")
            print(token)
        elif args.group == "workspace":
            for row in list_workspaces(database_url=url):
                print(row["name"])
        elif args.action == "issue":
            token = issue_token(args.workspace, name=args.name, database_url=url)
            print(f"new token for workspace '{args.workspace}' (shown once):")
            print(token)
        elif args.action == "revoke":
            info = revoke_token(args.workspace, args.token, database_url=url)
            print(f"revoked token {info['id']} ({info['prefix']}...) of workspace '{args.workspace}'")
        else:
            for row in list_tokens(args.workspace, database_url=url):
                state = "revoked" if row["revoked"] else "active"
                print(f"{row['id']}\t{row['prefix']}...\t{state}\t{row['name']}")
    except ApiError as exc:
        print(f"flexium: {exc.message}", file=sys.stderr)
        return 1
    except (DatabaseUnavailable, SchemaTooNew, ValueError) as exc:
        print(f"flexium: {exc}", file=sys.stderr)
        return 1
    return 0
