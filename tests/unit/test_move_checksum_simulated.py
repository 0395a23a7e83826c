"""The moves' checksum over the fake driver: the simulated driver's kernel and the extension's host
part (tails, unaligned ranges) agree bit for bit with the Python definition, segment checksums
follow the live ranges, a copy to another GPU carries the checksum of what landed, and a driver
without the kernel's functions says so."""

from __future__ import annotations

import json
import os
import random
import subprocess
import sys

import pytest

from flexium import _C
from flexium.engine.fast import checksum
from support import fake_driver
from support.fake_driver import FakeDriver
from support.vmm import Allocator, MiB, allocator, driver, fake, fill, make_segments  # noqa: F401  (fixtures)


def test_the_reference_is_the_documented_function() -> None:
    assert checksum.reference(b"") == 0
    # One word 1 numbered 0: x = 1, z = (1 ^ 0) * M, mix = z ^ (z >> 29).
    z = checksum.MIX_MULTIPLIER
    assert checksum.reference((1).to_bytes(8, "little")) == (z ^ (z >> 29)) & checksum.WORD_MASK
    # A partial word is padded with zero bytes; the numbering makes position count.
    assert checksum.reference(b"\x01") == checksum.reference((1).to_bytes(8, "little"))
    data = random.Random(1).randbytes(64)
    swapped = data[8:16] + data[0:8] + data[16:]
    assert checksum.reference(data) != checksum.reference(swapped)
    assert (
        checksum.reference(data, first_word=5)
        == (checksum.reference(data[:24], first_word=5) + checksum.reference(data[24:], first_word=8))
        & checksum.WORD_MASK
    )


@pytest.mark.parametrize(
    ("offset", "length"),
    [(0, 4 * MiB), (0, 16), (0, 24), (0, 13), (16, 1000), (8, 4096), (3, 777), (0, 0)],
)
def test_the_simulated_kernel_and_the_host_part_agree_with_the_reference(
    fake: FakeDriver, allocator: Allocator, offset: int, length: int
) -> None:
    address = allocator.must_alloc(8 * MiB)
    data = fill(address, 8 * MiB, seed=offset + length)
    (total,) = _C.checksum_ranges(0, [_C.ChecksumRange(address + offset, length, 7)])
    assert total == checksum.reference(data[offset : offset + length], first_word=7)
    # Aligned ranges go to the kernel, the rest through the host.
    launched = fake.call_count("cuLaunchKernel")
    assert launched == (1 if offset % 16 == 0 and length >= 16 else 0)


def test_segment_checksums_follow_the_live_ranges(fake: FakeDriver, allocator: Allocator) -> None:
    contents = make_segments(allocator, [2 * MiB, 4 * MiB])
    small, large = sorted(contents)
    live = {small: [(0, 4096), (8192, 100)], large: []}
    sums = checksum.of_segments(0, live)
    assert sums == {
        small: (checksum.reference(contents[small][:4096]) + checksum.reference(contents[small][8192:8292], 1024))
        & checksum.WORD_MASK,
        large: 0,
    }
    # A segment not listed counts whole.
    assert checksum.of_segments(0, {})[large] == checksum.reference(contents[large])


def test_a_copy_to_another_gpu_carries_the_checksum_of_what_landed(fake: FakeDriver, allocator: Allocator) -> None:
    contents = make_segments(allocator, [2 * MiB, 2 * MiB])
    live = {address: [(0, MiB)] for address in contents}
    before = checksum.of_segments(0, live)
    staged = _C.stage_segments_to_device(1, 0, live, checksum_copies=True)
    assert {entry.address: entry.checksum for entry in staged} == before
    for entry in staged:
        os.close(entry.fd)
    # A bit flipped on the way shows in the copy's checksum, and only in that segment's.
    fake.corrupt_copy("cuMemcpyDtoDAsync", 2)
    staged = _C.stage_segments_to_device(1, 0, live, checksum_copies=True)
    after = {entry.address: entry.checksum for entry in staged}
    mismatches = checksum.compare(before, after)
    assert [m.address for m in mismatches] == [sorted(contents)[1]]
    assert checksum.describe(mismatches).startswith(f"the moved bytes do not match: segment {sorted(contents)[1]:#x}")
    for entry in staged:
        os.close(entry.fd)


def test_a_driver_without_the_kernel_functions() -> None:
    code = (
        "import json; from flexium import _C; from flexium.engine.fast import checksum; "
        "print(json.dumps({'api': _C.driver_status().checksum_api, 'why': checksum.unavailable()}))"
    )
    env = fake_driver.subprocess_env(FAKE_CUDA_NO_CHECKSUM="1")
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, check=True)
    assert json.loads(out.stdout) == {
        "api": False,
        "why": "moves are not checksummed: the driver lacks the functions that load and launch a kernel",
    }
    env = {**fake_driver.subprocess_env(), "FLEXIUM_MOVE_CHECKSUM": "0"}
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, check=True)
    assert json.loads(out.stdout) == {"api": True, "why": "moves are not checksummed: FLEXIUM_MOVE_CHECKSUM=0"}
