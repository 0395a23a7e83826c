"""`flexium server`: its options build the server's one Settings object, then
``flexium.server.app.serve`` runs the server until a stop signal."""

from __future__ import annotations

import argparse
import logging
import sys
from typing import Any

from flexium import protocol
from flexium.cli.exit_status import EXIT_USAGE
from flexium.cli.server_extra import server_module
from flexium.server.settings import BACKFILL_PATIENCE_S, SWEEP_INTERVAL_S, Settings, load_settings

DESCRIPTION = "Run the flexium server: API, dashboard and live events in one process."


def add_command(commands: Any) -> None:
    """``commands``: the ``flexium`` parser's subparsers."""
    parser = commands.add_parser(
        "server", description=DESCRIPTION, help="run the server: API, dashboard, live events (flexium server --help)"
    )
    parser.add_argument("--host", default=None, help="address to listen on (default 127.0.0.1)")
    parser.add_argument("--port", type=int, default=None, help=f"port (default {protocol.DEFAULT_PORT})")
    parser.add_argument(
        "--database",
        default=None,
        metavar="URL",
        help="sqlite:///PATH or postgresql://USER@HOST/DB (default: "
        f"${protocol.DATABASE_ENV}, else ~/.flexium/server.db)",
    )
    parser.add_argument(
        "--new-database",
        action="store_true",
        default=None,
        help="where a SQLite file this server used is gone, begin with an empty one (default: refuse to start)",
    )
    parser.add_argument("--public-url", default=None, help="base URL printed in links (behind a proxy)")
    parser.add_argument(
        "--log-level", default="info", choices=["debug", "info", "warning", "error"], help="what the server logs"
    )
    parser.add_argument("--access-log", action="store_true", help="log every request")
    timing = parser.add_argument_group("timing (seconds; defaults suit most clusters)")
    for flag, dest, default, what in (
        ("--heartbeat-interval", "heartbeat_interval_s", protocol.HEARTBEAT_INTERVAL_S, "how often jobs report"),
        ("--poll-timeout", "poll_timeout_s", protocol.POLL_TIMEOUT_S, "how long a job's wait for a command lasts"),
        ("--stale-after", "stale_after_s", protocol.STALE_AFTER_S, "a job silent this long shows STALE"),
        ("--remove-after", "remove_after_s", protocol.REMOVE_AFTER_S, "a STALE job is forgotten after this"),
        ("--command-ttl", "command_ttl_s", protocol.COMMAND_TTL_S, "a command not taken by then expires"),
        ("--sweep-interval", "sweep_interval_s", SWEEP_INTERVAL_S, "how often stale, removed and expired are applied"),
    ):
        timing.add_argument(
            flag, type=float, default=None, dest=dest, metavar="SECONDS", help=f"{what} (default {default:g})"
        )
    timing.add_argument(
        "--device-write-interval",
        type=float,
        default=None,
        dest="device_write_interval_s",
        help="store a host's GPU report at most this often (5); --stale-after must be longer",
    )
    timing.add_argument(
        "--backfill-patience",
        type=float,
        default=None,
        dest="backfill_patience_s",
        metavar="SECONDS",
        help="a queued job that fits goes ahead of an earlier one of its priority that fits nowhere until that "
        f"one has waited this long; 0: never (default {BACKFILL_PATIENCE_S:g}; also $FLEXIUM_BACKFILL_PATIENCE)",
    )
    tls = parser.add_argument_group("HTTPS (both or neither; also $FLEXIUM_CERTFILE, $FLEXIUM_KEYFILE)")
    tls.add_argument("--certfile", default=None, metavar="PEM", help="the server's certificate (chain)")
    tls.add_argument("--keyfile", default=None, metavar="PEM", help="its private key (unencrypted)")
    bounds = parser.add_argument_group(
        "bounds (also $FLEXIUM_<NAME>, e.g. FLEXIUM_MAX_PROCESSES; defaults suit hundreds of jobs)"
    )
    bounds.add_argument(
        "--request-timeout",
        type=float,
        default=None,
        dest="request_timeout_s",
        metavar="S",
        help="close a connection whose request has not fully arrived within S seconds (10)",
    )
    bounds.add_argument(
        "--body-timeout",
        type=float,
        default=None,
        dest="body_timeout_s",
        metavar="S",
        help="close a connection whose request body has not arrived within S seconds of its headers (5)",
    )
    bounds.add_argument(
        "--max-header-bytes",
        type=int,
        default=None,
        metavar="N",
        help="answer 431 to a request whose header block is over N bytes (65536)",
    )
    bounds.add_argument(
        "--max-header-lines",
        type=int,
        default=None,
        metavar="N",
        help="answer 431 to a request with over N header lines (200)",
    )
    bounds.add_argument("--max-connections", type=int, default=None, metavar="N", help="open connections (8192)")
    bounds.add_argument(
        "--max-connections-per-client",
        type=int,
        default=None,
        metavar="N",
        help="open connections from one address, a trusted proxy's aside (256)",
    )
    bounds.add_argument(
        "--max-requests",
        type=int,
        default=None,
        metavar="N",
        help="requests in progress, long-polls included; then 503 (4096)",
    )
    bounds.add_argument(
        "--job-request-share",
        type=float,
        default=None,
        metavar="F",
        help="the share of --max-requests kept for registered jobs' heartbeats and polls (0.25)",
    )
    bounds.add_argument(
        "--max-requests-per-client",
        type=int,
        default=None,
        metavar="N",
        help="requests in progress from one address, jobs' heartbeats and polls aside (256)",
    )
    bounds.add_argument(
        "--max-streams-per-token", type=int, default=None, metavar="N", help="event streams one token holds (32)"
    )
    bounds.add_argument(
        "--db-lock-timeout",
        type=float,
        default=None,
        dest="db_lock_timeout_s",
        metavar="S",
        help="SQLite: wait at most S seconds for another process's write lock, then answer 503 (1)",
    )
    bounds.add_argument("--max-processes", type=int, default=None, metavar="N", help="processes per workspace (1000)")
    bounds.add_argument(
        "--max-tokens",
        type=int,
        default=None,
        metavar="N",
        help="tokens neither revoked nor expired per workspace (200)",
    )
    bounds.add_argument(
        "--max-payload-bytes",
        type=int,
        default=None,
        metavar="N",
        help="a process's capabilities, a command's result, as JSON (65536)",
    )
    bounds.add_argument(
        "--max-gpus-per-host", type=int, default=None, metavar="N", help="GPUs stored for one host (16)"
    )
    bounds.add_argument("--max-hosts", type=int, default=None, metavar="N", help="hosts with GPUs per workspace (256)")
    kept = parser.add_argument_group("what the server keeps (also $FLEXIUM_<NAME>, e.g. FLEXIUM_HISTORY_KEEP_DAYS)")
    for flag, dest, what in (
        ("--audit-access-keep-days", "audit_access_keep_days", "audit entries of logins, logouts and refusals"),
        ("--audit-change-keep-days", "audit_change_keep_days", "other audit entries: commands, tokens, the queue"),
        ("--history-keep-days", "history_keep_days", "GPU history, the dashboard's charts"),
        ("--progress-keep-days", "progress_keep_days", "training history, a job page's curves"),
    ):
        kept.add_argument(
            flag, type=float, default=None, dest=dest, metavar="DAYS", help=f"{what} ({getattr(Settings, dest):g})"
        )
    kept.add_argument(
        "--max-sessions-per-token",
        type=int,
        default=None,
        metavar="N",
        help=f"dashboard sessions one token holds; a login past it ends the oldest ({Settings.max_sessions_per_token})",
    )
    metrics = parser.add_argument_group("metrics (GET /metrics takes a viewer or admin token)")
    metrics.add_argument(
        "--metrics-refresh",
        type=float,
        default=None,
        dest="metrics_refresh_s",
        metavar="S",
        help="read the database for /metrics at most every S seconds, however often it is scraped (5)",
    )
    metrics.add_argument(
        "--public-metrics",
        action="store_true",
        help="serve the totals (no workspace's GPUs or jobs) to scrapes without a token",
    )
    parser.set_defaults(usage_parser=parser)


def settings_from_args(args: argparse.Namespace) -> Settings:
    return load_settings(
        host=args.host,
        port=args.port,
        database_url=args.database,
        new_database=args.new_database,
        public_url=args.public_url,
        log_level=args.log_level,
        access_log=args.access_log or None,
        heartbeat_interval_s=args.heartbeat_interval_s,
        poll_timeout_s=args.poll_timeout_s,
        stale_after_s=args.stale_after_s,
        remove_after_s=args.remove_after_s,
        command_ttl_s=args.command_ttl_s,
        sweep_interval_s=args.sweep_interval_s,
        device_write_interval_s=args.device_write_interval_s,
        backfill_patience_s=args.backfill_patience_s,
        certfile=args.certfile,
        keyfile=args.keyfile,
        request_timeout_s=args.request_timeout_s,
        body_timeout_s=args.body_timeout_s,
        max_header_bytes=args.max_header_bytes,
        max_header_lines=args.max_header_lines,
        max_connections=args.max_connections,
        max_connections_per_client=args.max_connections_per_client,
        max_requests=args.max_requests,
        job_request_share=args.job_request_share,
        max_requests_per_client=args.max_requests_per_client,
        max_streams_per_token=args.max_streams_per_token,
        db_lock_timeout_s=args.db_lock_timeout_s,
        max_processes=args.max_processes,
        max_tokens=args.max_tokens,
        max_payload_bytes=args.max_payload_bytes,
        max_gpus_per_host=args.max_gpus_per_host,
        max_hosts=args.max_hosts,
        audit_access_keep_days=args.audit_access_keep_days,
        audit_change_keep_days=args.audit_change_keep_days,
        history_keep_days=args.history_keep_days,
        progress_keep_days=args.progress_keep_days,
        max_sessions_per_token=args.max_sessions_per_token,
        metrics_refresh_s=args.metrics_refresh_s,
        public_metrics=args.public_metrics or None,
    )


def run(args: argparse.Namespace) -> int:
    if server_module("flexium.server.app") is None:
        return EXIT_USAGE
    from flexium.server.app import serve

    try:
        settings = settings_from_args(args)
    except ValueError as exc:
        print(f"flexium server: {exc}", file=sys.stderr)
        return EXIT_USAGE
    logging.basicConfig(
        level=getattr(logging, settings.log_level.upper()), format="%(asctime)s %(levelname)s %(name)s: %(message)s"
    )
    logging.getLogger("alembic").setLevel(logging.WARNING)
    return serve(settings)
