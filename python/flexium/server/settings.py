"""The server's one settings object. Built once by ``load_settings`` from command-line values,
then environment variables, then defaults; everything else receives it, nothing reads the
environment on its own."""

from __future__ import annotations

import os
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

from flexium import protocol

DEFAULT_HOST = "127.0.0.1"
SWEEP_INTERVAL_S = 2.0  # stale marking, removal, expiry
BACKFILL_PATIENCE_S = 60.0  # policies/waited_for.py
# The least the header-block bounds take: below them a browser's ordinary request, its cookies
# included, could be refused, and with it the dashboard.
MIN_HEADER_BYTES = 8 << 10
MIN_HEADER_LINES = 40


def default_data_dir() -> Path:
    return Path(os.environ.get("FLEXIUM_HOME") or Path.home() / ".flexium")


def default_database_url() -> str:
    return f"sqlite:///{default_data_dir() / 'server.db'}"


@dataclass(frozen=True)
class Settings:
    database_url: str = field(default_factory=default_database_url)
    new_database: bool = False  # an empty database where a used SQLite file is gone (Database.upgrade)
    host: str = DEFAULT_HOST
    port: int = protocol.DEFAULT_PORT
    public_url: str | None = None  # what links printed on start point at

    heartbeat_interval_s: float = protocol.HEARTBEAT_INTERVAL_S
    poll_timeout_s: float = protocol.POLL_TIMEOUT_S
    stale_after_s: float = protocol.STALE_AFTER_S
    remove_after_s: float = protocol.REMOVE_AFTER_S
    command_ttl_s: float = protocol.COMMAND_TTL_S
    sweep_interval_s: float = SWEEP_INTERVAL_S
    device_write_interval_s: float = 5.0  # one host's GPU report is written at most this often
    # Room held for a job, from when it was made or its flexium run last asked, or (made by pausing
    # others) from when the last of those pauses ended.
    reservation_ttl_s: float = protocol.RESERVATION_TTL_S
    # An earlier job of equal priority that fits nowhere lets later ones that fit go first this long.
    backfill_patience_s: float = BACKFILL_PATIENCE_S
    beat_flush_interval_s: float = 0.5  # plain heartbeats are written in batches this often
    token_cache_s: float = 5.0  # a token revoked outside this server stops working within this
    max_body_bytes: int = protocol.MAX_BODY_BYTES
    sse_keepalive_s: float = 15.0
    sse_queue_size: int = 1000
    sse_queue_bytes: int = 4 << 20  # what one event stream may have queued before it resyncs
    event_history: int = 2000  # events kept for Last-Event-ID replay, per workspace
    event_history_bytes: int = 4 << 20  # and at most this much of them (events carry whole results)

    # Bounds on connections (server/connections.py) and requests (server/fair_share.py). A job holds
    # one long-poll and now and then a heartbeat; a dashboard one event stream.
    # Each is counted from a connection's accept (its TLS handshake included) and, past the
    # per-client bounds, by client address (fair_share.py, connection_book.py).
    request_timeout_s: float = 10.0  # a connection's whole request must arrive within this
    body_timeout_s: float = 5.0  # and a request's body within this of its headers
    max_header_bytes: int = 64 << 10  # a request's header block (Go allows 1 MiB, nginx 32 KiB)
    max_header_lines: int = 200  # and its header lines
    max_connections: int = 8192  # past it, the oldest connection outside a request is closed
    max_connections_per_client: int = 256  # the same, for one client address (proxies excepted)
    max_requests: int = 4096  # requests in progress (long-polls and streams included); then 503
    job_request_share: float = 0.25  # of max_requests, kept for registered jobs' heartbeats and polls
    max_requests_per_client: int = 256  # requests in progress from one client address, jobs' aside
    max_streams_per_token: int = 32  # event streams one token holds (a dashboard tab holds one)
    db_lock_timeout_s: float = 1.0  # SQLite: wait this long for another process's write lock

    # Per-workspace quotas (server/storage/quotas.py), answered 4xx naming the setting.
    max_processes: int = 1000  # processes registered in one workspace
    max_tokens: int = 200  # tokens of one workspace neither revoked nor expired
    max_payload_bytes: int = 64 << 10  # a process's capabilities, a command's result (as JSON)
    max_gpus_per_host: int = 16  # GPUs stored for one host (a GPU stays ~remove_after_s after it left)
    max_hosts: int = 256  # hosts with GPUs stored in one workspace

    # What the server keeps, and how long (server/storage/retention.py).
    audit_access_keep_days: float = 90.0  # logins, logouts, refused logins and requests
    audit_change_keep_days: float = 365.0  # every other audit entry: commands, tokens, the queue
    history_keep_days: float = 1.0  # GPU samples, the dashboard's history charts
    progress_keep_days: float = 1.0  # training samples, a job page's curves
    max_sessions_per_token: int = 20  # a person's browsers and devices; past it a login ends the oldest

    # /metrics (server/metrics_scrape.py): read at most this often, the totals without a token.
    metrics_refresh_s: float = 5.0
    public_metrics: bool = False

    # HTTPS: both files or neither.
    certfile: str | None = None
    keyfile: str | None = None

    db_threads: int | None = None  # worker threads for database calls (default: 8 on
    # SQLite, where writes take turns and more threads
    # only fight over the GIL; 16 on PostgreSQL)
    access_log: bool = False
    log_level: str = "info"
    bootstrap_default_workspace: bool = True

    def __post_init__(self) -> None:
        if not 0 <= self.port <= 65535:
            raise ValueError(f"{_option('port')} must be a TCP port, 1 to 65535 (0: any free one), not {self.port}")
        for name in (
            "heartbeat_interval_s",
            "poll_timeout_s",
            "stale_after_s",
            "remove_after_s",
            "command_ttl_s",
            "sweep_interval_s",
            "device_write_interval_s",
            "reservation_ttl_s",
            "beat_flush_interval_s",
            "sse_keepalive_s",
            "request_timeout_s",
            "body_timeout_s",
            "db_lock_timeout_s",
        ):
            value = getattr(self, name)
            if not value > 0 or value == float("inf"):
                raise ValueError(f"{_option(name)} must be a positive number of seconds, not {value}")
        if self.stale_after_s <= self.device_write_interval_s:
            # A host's GPU report is stored at most every device_write_interval_s: a stale limit
            # at or below it makes GPUs that report on time look silent (refused as targets).
            raise ValueError(
                f"{_option('stale_after_s')} ({self.stale_after_s:g} s) must be longer than "
                f"{_option('device_write_interval_s')} ({self.device_write_interval_s:g} s), "
                "how often a host's GPU report is stored; else fresh GPUs look silent"
            )
        for name in (
            "max_connections",
            "max_connections_per_client",
            "max_requests",
            "max_requests_per_client",
            "max_streams_per_token",
            "max_processes",
            "max_tokens",
            "max_payload_bytes",
            "max_gpus_per_host",
            "max_hosts",
            "max_sessions_per_token",
        ):
            if getattr(self, name) < 1:
                raise ValueError(f"{_option(name)} must be at least 1, not {getattr(self, name)}")
        for name, least, why in (
            ("max_header_bytes", MIN_HEADER_BYTES, "bytes"),
            ("max_header_lines", MIN_HEADER_LINES, "lines"),
        ):
            if getattr(self, name) < least:
                raise ValueError(
                    f"{_option(name)} must be at least {least} {why}, not {getattr(self, name)}: "
                    "below it a browser's ordinary requests could be refused"
                )
        for name in ("audit_access_keep_days", "audit_change_keep_days", "history_keep_days", "progress_keep_days"):
            value = getattr(self, name)
            if not 0 < value < float("inf"):
                raise ValueError(f"{_option(name)} must be a positive number of days, not {value}")
        if not 0 <= self.job_request_share < 1:
            raise ValueError(
                f"{_option('job_request_share')} must be at least 0 and below 1 (a share of "
                f"{_option('max_requests')}), not {self.job_request_share}"
            )
        if (self.certfile is None) != (self.keyfile is None):
            given, missing = ("--certfile", "--keyfile") if self.certfile else ("--keyfile", "--certfile")
            raise ValueError(f"{given} needs {missing} too: HTTPS takes the certificate and its private key")
        for name in ("certfile", "keyfile"):
            path = getattr(self, name)
            if path is not None and not os.access(path, os.R_OK):
                raise ValueError(f"--{name} {path}: {_unreadable(path)}")
        if not 0 <= self.backfill_patience_s < float("inf"):
            raise ValueError(
                f"{_option('backfill_patience_s')} must be 0 or more seconds (0: no job passes an "
                f"earlier one of its priority), not {self.backfill_patience_s}"
            )
        if not 0 <= self.metrics_refresh_s < float("inf"):
            raise ValueError(f"{_option('metrics_refresh_s')} must be 0 or more seconds, not {self.metrics_refresh_s}")
        if self.remove_after_s < self.stale_after_s:
            raise ValueError(
                f"{_option('remove_after_s')} ({self.remove_after_s:g} s) must not be shorter "
                f"than {_option('stale_after_s')} ({self.stale_after_s:g} s)"
            )

    @property
    def threads(self) -> int:
        return self.db_threads or (8 if self.is_sqlite else 16)

    @property
    def is_sqlite(self) -> bool:
        return self.database_url.startswith("sqlite")

    @property
    def scheme(self) -> str:
        return "https" if self.certfile else "http"

    @property
    def link_base(self) -> str:
        if self.public_url:
            return self.public_url.rstrip("/")
        host = self.host
        if host in ("0.0.0.0", "::", ""):
            host = "127.0.0.1"
        if ":" in host:
            host = f"[{host}]"
        return f"{self.scheme}://{host}:{self.port}"

    def with_(self, **changes: Any) -> Settings:
        return replace(self, **changes)


def _option(name: str) -> str:
    """The command-line spelling of a setting, for error messages."""
    return "--" + name.removesuffix("_s").replace("_", "-")


def option_and_env(name: str) -> str:
    """How a person sets ``name``: its option, and its variable where it has one (for messages
    that name the limit someone ran into)."""
    env = next((var for var, (field_name, _kind) in _ENV_SETTINGS.items() if field_name == name), None)
    return f"{_option(name)}" + (f" or {env}" if env else "")


def _unreadable(path: str) -> str:
    if not os.path.exists(path):
        return "no such file"
    return "not readable by this user" if os.path.isfile(path) else "not a file"


# Settings also read from the environment (an option given on the command line wins).
_ENV_SETTINGS: dict[str, tuple[str, type]] = {
    "FLEXIUM_REQUEST_TIMEOUT": ("request_timeout_s", float),
    "FLEXIUM_MAX_CONNECTIONS": ("max_connections", int),
    "FLEXIUM_BODY_TIMEOUT": ("body_timeout_s", float),
    "FLEXIUM_MAX_HEADER_BYTES": ("max_header_bytes", int),
    "FLEXIUM_MAX_HEADER_LINES": ("max_header_lines", int),
    "FLEXIUM_MAX_CONNECTIONS_PER_CLIENT": ("max_connections_per_client", int),
    "FLEXIUM_MAX_REQUESTS": ("max_requests", int),
    "FLEXIUM_JOB_REQUEST_SHARE": ("job_request_share", float),
    "FLEXIUM_MAX_REQUESTS_PER_CLIENT": ("max_requests_per_client", int),
    "FLEXIUM_MAX_STREAMS_PER_TOKEN": ("max_streams_per_token", int),
    "FLEXIUM_DB_LOCK_TIMEOUT": ("db_lock_timeout_s", float),
    "FLEXIUM_MAX_PROCESSES": ("max_processes", int),
    "FLEXIUM_MAX_TOKENS": ("max_tokens", int),
    "FLEXIUM_MAX_PAYLOAD_BYTES": ("max_payload_bytes", int),
    "FLEXIUM_MAX_GPUS_PER_HOST": ("max_gpus_per_host", int),
    "FLEXIUM_MAX_HOSTS": ("max_hosts", int),
    "FLEXIUM_AUDIT_ACCESS_KEEP_DAYS": ("audit_access_keep_days", float),
    "FLEXIUM_AUDIT_CHANGE_KEEP_DAYS": ("audit_change_keep_days", float),
    "FLEXIUM_HISTORY_KEEP_DAYS": ("history_keep_days", float),
    "FLEXIUM_PROGRESS_KEEP_DAYS": ("progress_keep_days", float),
    "FLEXIUM_MAX_SESSIONS_PER_TOKEN": ("max_sessions_per_token", int),
    "FLEXIUM_CERTFILE": ("certfile", str),
    "FLEXIUM_KEYFILE": ("keyfile", str),
    "FLEXIUM_BACKFILL_PATIENCE": ("backfill_patience_s", float),
}


def sqlite_file(url: str) -> str | None:
    """The absolute path of a SQLite database URL's file; None for PostgreSQL or in memory."""
    if not url.startswith("sqlite"):
        return None
    path = url.split(":///", 1)[1] if ":///" in url else ""
    return None if path in ("", ":memory:") else os.path.abspath(path)


def normalize_database_url(url: str) -> str:
    """Accept what people type (``postgresql://``, ``postgres://``, a plain file path) and name
    the driver SQLAlchemy must use (psycopg 3 for PostgreSQL). A SQLite database in memory is refused:
    what a server keeps there is gone when it stops (an unset variable in ``sqlite:///$DIR`` makes one)."""
    url = url.strip()
    if not url:
        raise ValueError("the database URL is empty: give sqlite:///PATH or postgresql://USER@HOST/DB")
    if url.startswith("sqlite:") and sqlite_file(url) is None:
        raise ValueError(
            f"database URL {url!r} names no file: SQLite in memory keeps nothing once the server stops (an "
            "unset variable in the URL?); give sqlite:///PATH"
        )
    if url.startswith("postgres://"):
        url = "postgresql://" + url[len("postgres://") :]
    if url.startswith("postgresql://"):
        return "postgresql+psycopg://" + url[len("postgresql://") :]
    if url.startswith(("postgresql+", "sqlite:")):
        return url
    if "://" not in url:  # a file path
        return f"sqlite:///{Path(url).expanduser().resolve()}"
    raise ValueError(f"unsupported database URL {url!r}: use sqlite:///PATH or postgresql://USER@HOST/DB")


def load_settings(**overrides: Any) -> Settings:
    """Explicit values (None means 'not given') win over FLEXIUM_* variables, which win over
    defaults."""
    values: dict[str, Any] = {}
    env_url = os.environ.get(protocol.DATABASE_ENV)
    if env_url:
        values["database_url"] = env_url
    env_public = os.environ.get("FLEXIUM_PUBLIC_URL")
    if env_public:
        values["public_url"] = env_public
    for var, (name, kind) in _ENV_SETTINGS.items():
        raw = os.environ.get(var)
        if raw:
            try:
                values[name] = kind(raw)
            except ValueError:
                raise ValueError(f"{var}={raw!r} is not a valid {kind.__name__}") from None
    for key, value in overrides.items():
        if value is not None:
            values[key] = value
    if "database_url" in values:
        values["database_url"] = normalize_database_url(values["database_url"])
    if values.get("public_url"):
        check_public_url(values["public_url"])
    return Settings(**values)


def check_public_url(url: str) -> None:
    """--public-url / FLEXIUM_PUBLIC_URL: the links printed and shown start with it, so a browser must
    open it (ValueError otherwise)."""
    scheme, _, rest = url.strip().partition("://")
    if scheme.lower() not in ("http", "https") or not rest.strip("/"):
        raise ValueError(
            f"public URL {url!r} is not one a browser opens: give it whole, e.g. https://flexium.example.com"
        )
