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
