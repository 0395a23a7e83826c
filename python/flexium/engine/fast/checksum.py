"""Every fast move proves itself: the checksum of each segment's live bytes is computed on the GPU
before they move and again where they landed, and the two are compared before the job goes on
(docs/fast-path.md, "Every move proves itself"). A migration compares before the source's memory
is released, so a mismatch leaves the job where it was; a pause's bytes are compared at its
resume, after the copy back, and a mismatch sends them back to host staging, which still holds
them, for a second copy or, failing that, a job paused again.

The function (csrc/move_checksum.h; the PTX kernel and the simulated driver compute it too):
over the bytes read as little-endian 64-bit words w[k] (a last partial word padded with zero
bytes), the first numbered `first_word`, the sum mod 2**64 of mix(w[k], first_word + k), where
x = w ^ (i * 0x9E3779B97F4A7C15), z = (x ^ (x >> 31)) * 0xBF58476D1CE4E5B9, mix = z ^ (z >> 29).
mix is a bijection of w for each i, so any one changed word changes the sum; its position makes
words that trade places count. A segment's checksum is the sum over its live ranges, each
numbered from its offset in the segment (offset // 8)."""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass, replace

from flexium import _C
from flexium.config import switch_from_env
from flexium.engine.fast.steps import RelocationError, timed
from flexium.engine.operations import StepTiming

DISABLE_ENV = "FLEXIUM_MOVE_CHECKSUM"
POSITION_MULTIPLIER = 0x9E3779B97F4A7C15
MIX_MULTIPLIER = 0xBF58476D1CE4E5B9
WORD_MASK = (1 << 64) - 1

LiveRanges = Mapping[int, list[tuple[int, int]]]
# What to do after a mismatch, said with every one.
ADVICE = (
    "Try again: a copy that went wrong once usually goes right the next time; if it happens again, the GPU, the "
    "link between GPUs or the host's memory may be faulty (nvidia-smi -q -d ECC, dmesg)"
)


def checksum_enabled() -> bool:
    return switch_from_env(DISABLE_ENV, True, "move checksum switch")


def reference(data: bytes, first_word: int = 0) -> int:
    """The function in plain Python, the definition the kernel and the simulated driver are
    tested against (slow: for tests of a few MiB)."""
    total = 0
    for k in range(0, len(data), 8):
        word = int.from_bytes(data[k : k + 8], "little")
        x = word ^ (((first_word + k // 8) * POSITION_MULTIPLIER) & WORD_MASK)
        z = ((x ^ (x >> 31)) * MIX_MULTIPLIER) & WORD_MASK
        total += z ^ (z >> 29)
    return total & WORD_MASK


@dataclass(frozen=True)
class Before:
    """The checksum of each segment's live bytes before they moved, and those live ranges: the
    copies cover exactly them, and where they landed is summed over them again."""

    live: dict[int, list[tuple[int, int]]]
    sums: dict[int, int]


@dataclass(frozen=True)
class Mismatch:
    address: int
    expected: int
    found: int | None  # None: the segment is gone from where it landed


def of_present(before: Before, segments: set[int]) -> Before:
    """`before` for the segments at these addresses only (a resume leaves out those freed while the job
    was paused, whose free waited for the restore)."""
    return Before(
        {a: r for a, r in before.live.items() if a in segments},
        {a: v for a, v in before.sums.items() if a in segments},
    )


def compare(expected: Mapping[int, int], found: Mapping[int, int]) -> list[Mismatch]:
    """The segments whose checksum where they landed is not the one they left with."""
    return [
        Mismatch(address, want, found.get(address))
        for address, want in sorted(expected.items())
        if found.get(address) != want
    ]


def describe(mismatches: list[Mismatch]) -> str:
    first = mismatches[0]
    got = "is missing" if first.found is None else f"summed {first.found:#018x}"
    more = f" (and {len(mismatches) - 1} more)" if len(mismatches) > 1 else ""
    return (
        f"the moved bytes do not match: segment {first.address:#x} {got} where it landed, "
        f"{first.expected:#018x} before it moved{more}"
    )


def of_segments(logical: int, live: LiveRanges) -> dict[int, int]:
    """The checksum of each of `logical`'s backed segments over its live ranges, on its GPU."""
    return {int(address): int(value) for address, value in _C.segment_checksums(logical, dict(live)).items()}


def before_the_move(logical: int, live: LiveRanges) -> tuple[Before | None, StepTiming | None, str | None]:
    """The `checksum` step: `logical`'s segments summed on their GPU before anything is copied.
    Where moves cannot be checked (switched off, a driver without the kernel's functions, a
    kernel that did not run) the move goes on unchecked: no Before, and the note that says why."""
    why = unavailable()
    if why is not None:
        return None, None, why
    ranges = {address: list(pieces) for address, pieces in live.items()}
    try:
        before, timing = timed("checksum", lambda: Before(ranges, of_segments(logical, ranges)))
    except RelocationError as exc:
        return None, None, f"this move is not checksummed: {exc}"
    return before, timing, None


def verify(before: Before, landed: Callable[[], Mapping[int, int]], summed_s: float = 0.0) -> StepTiming:
    """The `verify` step: the checksums of what landed (`landed` sums them, or hands over those
    already summed in `summed_s` seconds) against those of what left. A mismatch raises a
    RelocationError of step `verify` that names the first segment."""

    def work() -> None:
        mismatches = compare(before.sums, landed())
        if mismatches:
            raise ChecksumMismatch(describe(mismatches))

    _, timing = timed("verify", work)
    return replace(timing, seconds=timing.seconds + summed_s)


class ChecksumMismatch(Exception):
    """Bytes that landed differ from those that left (a copy, a link or memory at fault)."""


def mismatched(exc: RelocationError) -> bool:
    """Whether a failed `verify` found different bytes (rather than failing to sum them)."""
    return isinstance(exc.__cause__, ChecksumMismatch)


def unavailable() -> str | None:
    """Why moves cannot be checked here (None: they can, and are unless switched off)."""
    if not checksum_enabled():
        return f"moves are not checksummed: {DISABLE_ENV}=0"
    if not _C.driver_status().checksum_api:
        return "moves are not checksummed: the driver lacks the functions that load and launch a kernel"
    return None
