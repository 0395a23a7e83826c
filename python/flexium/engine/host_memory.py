"""This machine's host memory as /proc/meminfo tells it."""

from __future__ import annotations


def meminfo_bytes(field: str) -> int | None:
    """A /proc/meminfo field ("MemTotal", "MemAvailable", ...) in bytes; None where it cannot be read."""
    try:
        with open("/proc/meminfo") as meminfo:
            for line in meminfo:
                if line.startswith(f"{field}:"):
                    return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        pass
    return None


def host_memory_available() -> int | None:
    return meminfo_bytes("MemAvailable")


def host_memory_total() -> int | None:
    return meminfo_bytes("MemTotal")
