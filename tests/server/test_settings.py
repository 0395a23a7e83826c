"""The server's settings are checked when they are built: a bad combination stops the start
with a message naming the options, instead of a server that misjudges its jobs."""

from __future__ import annotations

from typing import Any

import pytest

from flexium.cli.main import main
from flexium.server.settings import Settings, load_settings


@pytest.mark.parametrize(
    "values,message",
    [
        ({"stale_after_s": 5.0}, r"--stale-after \(5 s\) must be longer than --device-write-interval \(5 s\)"),
        ({"stale_after_s": 2.0, "device_write_interval_s": 3.0}, "fresh GPUs look silent"),
        ({"heartbeat_interval_s": 0.0}, "--heartbeat-interval must be a positive"),
        ({"remove_after_s": 10.0}, "--remove-after"),
        ({"backfill_patience_s": -1.0}, "--backfill-patience must be 0 or more seconds"),
    ],
)
def test_bad_timings_refused(values: dict[str, Any], message: str) -> None:
    with pytest.raises(ValueError, match=message):
        Settings(database_url="sqlite:///x.db", **values)


def test_short_stale_limit_with_a_shorter_device_interval() -> None:
    s = load_settings(database_url="sqlite:///x.db", stale_after_s=5.0, device_write_interval_s=1.0)
    assert s.stale_after_s == 5.0 and s.device_write_interval_s == 1.0


def test_command_line_says_what_is_wrong(capsys: pytest.CaptureFixture[str], tmp_path: Any) -> None:
    assert main(["server", "--database", str(tmp_path / "s.db"), "--stale-after", "4"]) == 2
    err = capsys.readouterr().err
    assert "flexium server: --stale-after (4 s) must be longer than --device-write-interval (5 s)" in err


def test_bounds_and_quotas_come_from_options_then_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("FLEXIUM_MAX_PROCESSES", "7")
    monkeypatch.setenv("FLEXIUM_REQUEST_TIMEOUT", "2.5")
    monkeypatch.setenv("FLEXIUM_BACKFILL_PATIENCE", "0")
    s = load_settings(database_url="sqlite:///x.db", max_processes=None, max_tokens=3)
    assert (s.max_processes, s.request_timeout_s, s.max_tokens, s.backfill_patience_s) == (7, 2.5, 3, 0.0)
    assert load_settings(database_url="sqlite:///x.db", max_processes=9).max_processes == 9
    monkeypatch.setenv("FLEXIUM_MAX_TOKENS", "many")
    with pytest.raises(ValueError, match=r"FLEXIUM_MAX_TOKENS='many' is not a valid int"):
        load_settings(database_url="sqlite:///x.db")


@pytest.mark.parametrize(
    "values,message",
    [
        ({"max_processes": 0}, "--max-processes must be at least 1"),
        ({"request_timeout_s": 0.0}, "--request-timeout must be a positive number of seconds"),
        ({"certfile": "c.pem"}, "--certfile needs --keyfile too"),
        ({"keyfile": "k.pem"}, "--keyfile needs --certfile too"),
        (
            {"certfile": "/nonexistent/c.pem", "keyfile": "/nonexistent/k.pem"},
            "--certfile /nonexistent/c.pem: no such file",
        ),
    ],
)
def test_bad_bounds_and_tls_settings_refused(values: dict[str, Any], message: str) -> None:
    with pytest.raises(ValueError, match=message):
        Settings(database_url="sqlite:///x.db", **values)


def test_https_links(tmp_path: Any) -> None:
    for name in ("c.pem", "k.pem"):
        (tmp_path / name).write_text("-")
    s = Settings(database_url="sqlite:///x.db", certfile=str(tmp_path / "c.pem"), keyfile=str(tmp_path / "k.pem"))
    assert s.link_base == f"https://127.0.0.1:{s.port}"


@pytest.mark.parametrize(
    "url,message",
    [
        ("", "the database URL is empty"),
        ("sqlite://", "names no file: SQLite in memory keeps nothing"),
        ("sqlite:///", "names no file"),
        ("sqlite:///:memory:", "names no file"),
    ],
)
def test_a_database_url_that_names_no_file_is_refused(url: str, message: str) -> None:
    """An unset variable in sqlite:///$DIR/server.db gives sqlite:///: a server in memory would lose its
    workspaces and tokens when it stops."""
    with pytest.raises(ValueError, match=message):
        load_settings(database_url=url)


def test_a_sqlite_file_in_a_folder_that_is_not_there_is_refused_and_nothing_is_made(
    capsys: pytest.CaptureFixture[str], tmp_path: Any
) -> None:
    missing = tmp_path / "typo" / "server.db"
    assert main(["server", "--port", "0", "--database", f"sqlite:///{missing}"]) == 1
    assert f"no folder {missing.parent} for the SQLite database" in capsys.readouterr().err
    assert not missing.parent.exists()


@pytest.mark.parametrize("url", ["flexium.example.com", "ftp://x", "https://"])
def test_a_public_url_a_browser_cannot_open_is_refused(url: str, tmp_path: Any) -> None:
    with pytest.raises(ValueError, match="is not one a browser opens: give it whole"):
        load_settings(database_url=str(tmp_path / "s.db"), public_url=url)
    assert load_settings(database_url=str(tmp_path / "s.db"), public_url="https://f.example.com/").link_base == (
        "https://f.example.com"
    )


def test_a_host_that_is_not_this_machines_is_said_so_not_a_port_in_use(
    capsys: pytest.CaptureFixture[str], tmp_path: Any
) -> None:
    assert main(["server", "--port", "0", "--host", "nosuchhost.invalid", "--database", str(tmp_path / "s.db")]) == 1
    assert "that is not an address of this machine: check --host" in capsys.readouterr().err
