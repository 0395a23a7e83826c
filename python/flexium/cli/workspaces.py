"""`flexium workspace create|list|delete` and `flexium token issue|revoke|list|link`: on the database
directly (``flexium.server.database_admin``), so they work while the server runs or not. A new token
is printed alone on the last line of output, for scripts."""

from __future__ import annotations

import argparse
import sys
from typing import TYPE_CHECKING, Any

from flexium import protocol, wire
from flexium.cli.exit_status import EXIT_FAILED, EXIT_OK, EXIT_USAGE
from flexium.cli.printing import print_table
from flexium.cli.server_extra import server_module
from flexium.units import read_duration, utc_time

if TYPE_CHECKING:  # the server extra may be missing: imported where a command needs it
    from flexium.server.settings import Settings
    from flexium.server.storage import WorkspaceDeleted


def add_commands(commands: Any) -> None:
    """``commands``: the ``flexium`` parser's subparsers."""
    db_help = f"database URL (default ${protocol.DATABASE_ENV}, else ~/.flexium/server.db)"
    ws = commands.add_parser("workspace", help="create or list workspaces (flexium workspace --help)")
    actions = ws.add_subparsers(dest="action", required=True)
    p = actions.add_parser(
        "create", help="create a workspace; prints its first token (an admin token) on the last line"
    )
    p.add_argument("name", help="lowercase letters, digits, '.', '_', '-' (e.g. vision-team)")
    p.add_argument("--database", metavar="URL", help=db_help)
    p = actions.add_parser("list", help="list workspaces")
    p.add_argument("--database", metavar="URL", help=db_help)
    p = actions.add_parser(
        "delete",
        help="delete a workspace and everything of it: tokens, processes, commands, history, audit log "
        "(asks for its name again unless --yes)",
    )
    p.add_argument("name", help="the workspace's name")
    p.add_argument("--yes", action="store_true", help="do not ask: delete it (for scripts)")
    p.add_argument(
        "--force",
        action="store_true",
        help="delete it even while processes of it are heard (they train on, unmanaged, their tokens refused)",
    )
    p.add_argument("--database", metavar="URL", help=db_help)
    tok = commands.add_parser(
        "token", help="issue, revoke or list tokens, or print a dashboard login link (flexium token --help)"
    )
    actions = tok.add_subparsers(dest="action", required=True)
    p = actions.add_parser("issue", help="issue another token; prints it on the last line")
    p.add_argument("workspace", help="the workspace's name")
    p.add_argument("--name", default="", help="a label to recognise it by")
    p.add_argument(
        "--role",
        choices=protocol.TOKEN_ROLES,
        default=protocol.DEFAULT_ISSUED_ROLE,
        help="; ".join(f"{role}: {does}" for role, does in protocol.ROLE_PURPOSES.items())
        + f" (default {protocol.DEFAULT_ISSUED_ROLE}: most tokens go to training jobs, and a token that can do "
        "less is the safer one to hand out)",
    )
    p.add_argument(
        "--expires-in",
        type=_life,
        metavar="DURATION",
        help="refuse it after this long, as if revoked: e.g. 90d, 12h, 30m, 2w (default: valid until revoked)",
    )
    p.add_argument("--database", metavar="URL", help=db_help)
    p = actions.add_parser("revoke", help="revoke a token (by value or id) and every token it minted")
    p.add_argument("workspace", help="the workspace's name")
    p.add_argument("token", help="the token, or its id from 'token list'")
    p.add_argument("--database", metavar="URL", help=db_help)
    p = actions.add_parser(
        "list", help="list a workspace's tokens (no secrets): id, prefix, state, role, minted by, label"
    )
    p.add_argument("workspace", help="the workspace's name")
    p.add_argument("--database", metavar="URL", help=db_help)
    p = actions.add_parser(
        "link",
        help="print a one-time dashboard login link (valid 10 minutes) for a token of the workspace: "
        "for a workspace whose first link has expired or was lost",
    )
    p.add_argument("workspace", help="the workspace's name")
    p.add_argument(
        "token",
        nargs="?",
        help="the token (admin or viewer), or its id from 'token list' (default: the workspace's oldest admin "
        "token neither revoked nor expired)",
    )
    p.add_argument("--database", metavar="URL", help=db_help)


def run(args: argparse.Namespace) -> int:
    if server_module("flexium.server.database_admin") is None:
        return EXIT_USAGE
    from flexium.server import database_admin
    from flexium.server.db import DatabaseUnavailable, SchemaTooNew
    from flexium.server.errors import ApiError
    from flexium.server.settings import load_settings

    url = args.database
    try:
        if args.command == "workspace" and args.action == "create":
            token = database_admin.create_workspace(args.name, database_url=url)
            _print_created(args.name, token, url)
        elif args.command == "workspace" and args.action == "delete":
            return _delete_workspace(args)
        elif args.command == "workspace":
            for record in database_admin.list_workspaces(database_url=url):
                print(record.name)
        elif args.action == "issue":
            issued = database_admin.issue_token(
                args.workspace, name=args.name, role=args.role, expires_in_s=args.expires_in, database_url=url
            )
            notes = ["shown once"]
            if issued.expires_at is not None:
                notes.append(f"expires {utc_time(issued.expires_at)}")
            if args.role == protocol.ROLE_JOB:
                notes.append(f"training jobs read it from {protocol.TOKEN_ENV}")
            print(f"new {args.role} token for workspace '{args.workspace}' ({'; '.join(notes)}):")
            print(issued.token)
        elif args.action == "link":
            code, opened = database_admin.login_code_as(args.workspace, args.token, database_url=url)
            label = f"token {opened.id} ({opened.prefix}...{', ' + opened.name if opened.name else ''})"
            print(f"a dashboard login as {label}, role {opened.role}, in workspace '{args.workspace}':")
            print(_dashboard_link(code, load_settings(database_url=url)))
        elif args.action == "revoke":
            revoked = database_admin.revoke_token(args.workspace, args.token, database_url=url)
            also = f", and the tokens it minted: {', '.join(map(str, revoked.cascade))}" if revoked.cascade else ""
            print(f"revoked token {revoked.id} ({revoked.prefix}...) of workspace '{args.workspace}'{also}")
            if revoked.processes:
                print(
                    f"processes it registered: {', '.join(revoked.processes)}. They train on, but the server no "
                    f"longer hears or commands them: start them again with a valid {protocol.TOKEN_ENV} to manage "
                    "them (flexium ps shows them as token revoked)"
                )
        else:
            _print_tokens(database_admin.list_tokens(args.workspace, database_url=url))
    except ApiError as exc:
        print(f"flexium: {exc.message}", file=sys.stderr)
        return EXIT_FAILED
    except (DatabaseUnavailable, SchemaTooNew, ValueError) as exc:
        print(f"flexium: {exc}", file=sys.stderr)
        return EXIT_FAILED
    return EXIT_OK


def _delete_workspace(args: argparse.Namespace) -> int:
    """What would go is shown and confirmed (its name typed again) before anything goes; --yes skips
    the question, which a command without a terminal to ask on needs."""
    from flexium.server import database_admin

    url = args.database
    if not args.yes:
        if not sys.stdin.isatty():
            print(
                f"flexium: deleting workspace '{args.name}' cannot be undone and there is no terminal to confirm it "
                "on: pass --yes",
                file=sys.stderr,
            )
            return EXIT_USAGE
        preview = database_admin.delete_workspace(args.name, force=args.force, dry_run=True, database_url=url)
        print(f"workspace '{args.name}' holds {_contents(preview)}; all of it goes, and cannot be brought back.")
        if input("type the workspace's name to delete it: ").strip() != args.name:
            print("flexium: not deleted (the name typed was not the workspace's)", file=sys.stderr)
            return EXIT_FAILED
    deleted = database_admin.delete_workspace(args.name, force=args.force, database_url=url)
    print(f"deleted workspace '{args.name}': {_contents(deleted)}")
    if deleted.heard:
        print(
            f"processes of it still heard: {', '.join(p for p, _host in deleted.heard)}. They train on; the "
            "servers refuse their tokens, so they run unmanaged until started again in another workspace"
        )
    return EXIT_OK


def _contents(deleted: WorkspaceDeleted) -> str:
    return (
        f"{len(deleted.tokens)} token(s) in use, {deleted.processes} process(es), {deleted.commands} command(s), "
        f"{deleted.audit_entries} audit log entries"
    )


def _print_created(workspace: str, token: str, database_url: str | None) -> None:
    """A login link to the new workspace's dashboard (a one-time code: the token itself never
    goes in a URL), how training jobs get a token, and the admin token alone on the last line."""
    from flexium.server import database_admin
    from flexium.server.db import redacted
    from flexium.server.settings import load_settings

    settings = load_settings(database_url=database_url)
    code = database_admin.login_code(token, database_url=database_url)
    print(f"created workspace '{workspace}' in the database {redacted(settings.database_url)}")
    print(_dashboard_link(code, settings))
    print(f"training jobs: give them a job token: flexium token issue {workspace} --role job")
    print("its admin token, for the command line and the dashboard (shown once):")
    print(token)


def _dashboard_link(code: str, settings: Settings) -> str:
    """The line that gives a login code as a link: to the server that serves this SQLite file, which
    says where it is, else to the address a server takes by default."""
    from flexium.server import sole_server, storage
    from flexium.server.settings import sqlite_file

    database_file = sqlite_file(settings.database_url)
    serving = sole_server.serving_link(database_file) if database_file is not None else None
    minutes = f"works once, within {storage.LOGIN_CODE_TTL_S / 60:.0f} min"
    if serving is not None:
        return f"dashboard: {serving}/login#code={code}  ({minutes}; the server that serves this database)"
    return (
        f"dashboard: {settings.link_base}/login#code={code}  ({minutes}; "
        "a server at another address: that address before /login)"
    )


def _life(text: str) -> float:
    try:
        return read_duration(text)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None


def _print_tokens(tokens: list[wire.TokenInfo]) -> None:
    rows = [("ID", "PREFIX", "STATE", "ROLE", "EXPIRES", "LAST USED", "MINTED BY", "LABEL")]
    for info in tokens:
        minted_by = "-" if info.minted_by is None else str(info.minted_by)
        rows.append(
            (
                str(info.id),
                f"{info.prefix}...",
                info.state,
                info.role,
                "-" if info.expires_at is None else utc_time(info.expires_at),
                "-" if info.last_used_at is None else utc_time(info.last_used_at),
                minted_by,
                info.name,
            )
        )
    print_table(rows)
