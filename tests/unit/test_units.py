"""Durations as people write them (``flexium token issue --expires-in``) and moments in UTC."""

from __future__ import annotations

import pytest

from flexium.units import read_duration, utc_time


@pytest.mark.parametrize(
    ("text", "seconds"),
    [
        ("45", 45.0),
        ("45s", 45.0),
        ("30m", 1800.0),
        ("30min", 1800.0),
        ("12h", 43200.0),
        ("90d", 7776000.0),
        ("2w", 1209600.0),
        (" 1.5h ", 5400.0),
        ("3D", 259200.0),
    ],
)
def test_a_duration_reads_as_seconds(text: str, seconds: float) -> None:
    assert read_duration(text) == seconds


@pytest.mark.parametrize("text", ["", "d", "-5s", "3 fortnights", "1e3s", "5y", "12 h m"])
def test_what_is_not_a_duration_is_refused_naming_what_would_be(text: str) -> None:
    with pytest.raises(ValueError, match="is not a duration such as 90d, 12h, 30m or 45s"):
        read_duration(text)


def test_a_moment_reads_the_same_in_every_time_zone(monkeypatch: pytest.MonkeyPatch) -> None:
    import time

    monkeypatch.setenv("TZ", "Asia/Tokyo")
    time.tzset()
    try:
        assert utc_time(0.0) == "1970-01-01 00:00 UTC"
        assert utc_time(1_796_600_000.0) == "2026-12-06 23:33 UTC"
    finally:
        monkeypatch.delenv("TZ")
        time.tzset()
