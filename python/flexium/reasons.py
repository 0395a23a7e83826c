"""Why a process cannot be moved, in a few words: the dashboard shows them beside a greyed
button and the command line says them first when the server refuses a command; the full
reason (every problem the process reports) stays in the tooltip, the job page, `--verbose`
and `--json`."""

from __future__ import annotations

from collections.abc import Sequence

from flexium.protocol import MIGRATION_MIN_DRIVER, PAUSE_RESUME_MIN_DRIVER

# Known reasons a process cannot be moved, as a few words. First match wins; order: the reason
# that matters most first (a CPU-only torch has no GPU memory to move, whatever the driver).
_SHORT_REASONS = (
    ("needs a token with role", "read-only login: an admin token can"),
    ("CPU-only build", "CPU-only torch: no GPU memory to move"),
    ("no usable GPU", "torch sees no usable GPU"),
    ("engine is not running", "flexium's engine is off in this job"),
    ("install the NVIDIA driver", "no NVIDIA driver"),
    ("no NVIDIA driver", "no NVIDIA driver"),
    ("failed to initialise", "the NVIDIA driver failed to start"),
    ("is too old", f"NVIDIA driver too old ({PAUSE_RESUME_MIN_DRIVER}+ / {MIGRATION_MIN_DRIVER}+)"),
    ("lacks the checkpoint API", f"driver lacks the checkpoint API ({MIGRATION_MIN_DRIVER}+)"),
    (
        f"migration to another GPU needs {MIGRATION_MIN_DRIVER}+",
        f"this driver pauses only; moving needs {MIGRATION_MIN_DRIVER}+",
    ),
    ("cannot be paused or moved as a whole", "its job cannot be moved as a whole"),
    ("cannot take part in a job operation", "a rank cannot take part"),
    ("GPU remapping on restore", "mixed driver versions"),
)
SHORT_REASON_MAX = 60


def known_reason(full: str) -> str | None:
    """The few words of the reason in ``full`` that matters most, or None when none is known."""
    for needle, short in _SHORT_REASONS:
        if needle in full:
            return short
    return None


def most_important_first(problems: Sequence[str]) -> list[str]:
    """``problems`` with the one whose reason matters most first (the others keep their order)."""
    order = [needle for needle, _ in _SHORT_REASONS]

    def rank(problem: str) -> int:
        return next((i for i, needle in enumerate(order) if needle in problem), len(order))

    return sorted(problems, key=rank)


def short_reason(full: str) -> str:
    """A refusal in at most ``SHORT_REASON_MAX`` characters, for beside a greyed button."""
    known = known_reason(full)
    if known is not None:
        return known
    first = full.split(";")[0].split(": ")[0].strip()
    return first if len(first) <= SHORT_REASON_MAX else first[: SHORT_REASON_MAX - 1].rstrip() + "…"
