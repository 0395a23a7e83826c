"""The server's one settings object. Built once by ``load_settings`` from command-line values,
then environment variables, then defaults; everything else receives it, nothing reads the
environment on its own."""

from __future__ import annotations

import os
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any, Optional

from flexium import protocol

DEFAULT_HOST = "127.0.0.1"
SWEEP_INTERVAL_S = 2.0  # stale marking, removal, expiry


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
    public_url: Optional[str] = None  # what links printed on start point at

    heartbeat_interval_s: float = protocol.HEARTBEAT_INTERVAL_S
    poll_timeout_s: float = protocol.POLL_TIMEOUT_S
    stale_after_s: float = protocol.STALE_AFTER_S
    remove_after_s: float = protocol.REMOVE_AFTER_S
    command_ttl_s: float = protocol.COMMAND_TTL_S
    sweep_interval_s: float = SWEEP_INTERVAL_S
    device_write_interval_s: float = 5.0  # one host's GPU report is written at most this often
    beat_flush_interval_s: float = 0.5  # plain heartbeats are written in batches this often
    token_cache_s: float = 5.0  # a token revoked outside this server stops working within this
    max_body_bytes: int = protocol.MAX_BODY_BYTES
    sse_keepalive_s: float = 15.0
    sse_queue_size: int = 1000
    sse_queue_bytes: int = 4 << 20  # what one event stream may have queued before it resyncs
    event_history: int = 2000  # events kept for Last-Event-ID replay, per workspace
    event_history_bytes: int = 4 << 20  # and at most this much of them (events carry whole results)

    db_threads: Optional[int] = None  # worker threads for database calls (default: 8 on
    # SQLite, where writes take turns and more threads
    # only fight over the GIL; 16 on PostgreSQL)
    access_log: bool = False
    log_level: str = "info"
    bootstrap_default_workspace: bool = True

    def __post_init__(self) -> None:
        for name in (
            "heartbeat_interval_s",
            "poll_timeout_s",
            "stale_after_s",
            "remove_after_s",
            "command_ttl_s",
            "sweep_interval_s",
            "device_write_interval_s",
            "beat_flush_interval_s",
            "sse_keepalive_s",
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
    def link_base(self) -> str:
        if self.public_url:
            return self.public_url.rstrip("/")
        host = self.host
        if host in ("0.0.0.0", "::", ""):
            host = "127.0.0.1"
        if ":" in host:
            host = f"[{host}]"
        return f"http://{host}:{self.port}"

    def with_(self, **changes: Any) -> "Settings":
        return replace(self, **changes)


def _option(name: str) -> str:
    """The command-line spelling of a timing setting, for error messages."""
    return "--" + name.removesuffix("_s").replace("_", "-")


def normalize_database_url(url: str) -> str:
    """Accept what people type (``postgresql://``, ``postgres://``, a plain file path) and name
    the driver SQLAlchemy must use (psycopg 3 for PostgreSQL)."""
    url = url.strip()
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
    for key, value in overrides.items():
        if value is not None:
            values[key] = value
    if "database_url" in values:
        values["database_url"] = normalize_database_url(values["database_url"])
    return Settings(**values)
