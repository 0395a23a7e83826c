"""Every fast move proves itself, on a real GPU: the PTX kernel flexium loads through the driver
computes the function of python/flexium/engine/fast/checksum.py bit for bit, within the 10 ms per
16 GiB that keeps it on by default; a job paused and resumed (and migrated, with two GPUs) trains on
bit for bit with every move checked; a byte of the host staging changed while the job is paused is
caught at its resume, which pauses it again, and once the byte is right again it resumes intact.
Each check runs in a fresh process (support/fresh_process.py, or the training job)."""

from __future__ import annotations

import os
import sys
import threading
import time
from typing import Any

from support.fresh_process import run_in_fresh_process
from support.gpu import JOB_TIMEOUT, ok_run, reference, run_job, summary

# What the checksum may cost per 16 GiB to be on by default (issue 39 item 6).
GOAL_S_PER_16_GIB = 0.010
COMMON = ("--ballast-gb", "2", "--steps", "40", "--step-sleep", "0.1", "--pause-seconds", "0.5")


def kernel_checks() -> dict[str, Any]:
    """The kernel against the Python definition on random bytes (aligned and unaligned ranges,
    tails, numbering), one flipped bit, and the time of one pass over 16 GiB."""
    import torch

    from flexium import _C
    from flexium.engine.fast import checksum

    generator = torch.Generator(device="cuda:0").manual_seed(39)
    data = torch.randint(0, 256, (4 << 20,), dtype=torch.uint8, device="cuda:0", generator=generator)
    host = data.cpu().numpy().tobytes()
    base = data.data_ptr()
    cases = [(0, 4 << 20, 0), (0, 16, 0), (16, 1000, 3), (0, 24, 9), (8, 4096, 1), (3, 777, 5), (0, 13, 0), (0, 0, 0)]
    sums = _C.checksum_ranges(0, [_C.ChecksumRange(base + offset, length, first) for offset, length, first in cases])
    expected = [checksum.reference(host[offset : offset + length], first) for offset, length, first in cases]
    data[12345] ^= 4
    (flipped,) = _C.checksum_ranges(0, [_C.ChecksumRange(base, 4 << 20, 0)])

    big = torch.empty(16 << 30, dtype=torch.uint8, device="cuda:0")
    big.fill_(7)
    torch.cuda.synchronize()
    whole = [_C.ChecksumRange(big.data_ptr(), big.numel(), 0)]
    first = _C.checksum_ranges(0, whole)  # loads (JIT-compiles) the kernel in this context
    seconds = []
    for _ in range(5):
        started = time.perf_counter()
        again = _C.checksum_ranges(0, whole)
        seconds.append(time.perf_counter() - started)
    return {
        "sums": sums,
        "expected": expected,
        "flipped_differs": flipped != sums[0],
        "big_stable": again == first,
        "seconds_16gib": seconds,
    }


def test_the_kernel_agrees_with_the_python_definition_and_keeps_within_its_cost() -> None:
    out = run_in_fresh_process(kernel_checks, timeout=300)
    assert out["sums"] == out["expected"]
    assert out["flipped_differs"] and out["big_stable"]
    best = min(out["seconds_16gib"])
    print(f"checksum of 16 GiB: {[round(s * 1e3, 2) for s in out['seconds_16gib']]} ms", file=sys.stderr)
    assert best <= GOAL_S_PER_16_GIB, (
        f"one checksum pass over 16 GiB took {best * 1e3:.1f} ms, over the {GOAL_S_PER_16_GIB * 1e3:.0f} ms that keep "
        "it on by default (FLEXIUM_MOVE_CHECKSUM)"
    )


def checked_steps(op: dict[str, Any]) -> list[str]:
    return [s["step"] for s in op["result"]["steps"] if s["step"] in ("checksum", "verify") and s["ok"]]


def test_a_job_paused_and_resumed_with_checked_moves_trains_bit_identical() -> None:
    expected = reference(*COMMON)
    run = ok_run(run_job(*COMMON, "--plan", "10:pause", "--plan", "10:resume", timeout=JOB_TIMEOUT))
    assert [(op["op"], op["ok"], op["result"]["path"]) for op in run.ops] == [
        ("pause", True, "fast"),
        ("resume", True, "fast"),
    ], summary(run.ops)
    pause, resume = run.ops
    assert checked_steps(pause) == ["checksum"] and checked_steps(resume) == ["verify"], summary(run.ops)
    assert tuple(run.one("done")["losses"]) == expected


def test_a_job_migrated_with_checked_moves_trains_bit_identical(two_gpus: list[Any]) -> None:
    expected = reference(*COMMON)
    run = ok_run(run_job(*COMMON, "--plan", "10:migrate:cuda:1", timeout=JOB_TIMEOUT))
    (migrate,) = run.ops
    assert migrate["ok"] and migrate["result"]["path"] == "fast", summary(run.ops)
    assert checked_steps(migrate) == ["checksum", "verify"], summary(run.ops)
    assert tuple(run.one("done")["losses"]) == expected


def corrupted_staging() -> dict[str, Any]:
    """A job trains on a thread; another pauses it, flips one bit of its host staging, resumes it
    (caught: paused again), puts the bit back and resumes it again. Its tensors are compared."""
    import torch

    import flexium
    from flexium import _C
    from flexium.api import runtime
    from flexium.errors import OperationFailedError

    flexium.init()
    device = flexium.auto.get_device()
    current = runtime.current()
    assert current is not None and current.engine is not None
    engine = current.engine
    model = torch.nn.Linear(2048, 2048).to(device)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    data = torch.randn(256, 2048, device=device)
    ballast = torch.randint(0, 1 << 30, (128 << 20,), dtype=torch.int64, device=device)  # 1 GiB
    for _ in range(3):
        model(data).pow(2).mean().backward()
        optimizer.step()
    torch.cuda.synchronize(device)
    expected = [p.detach().clone() for p in model.parameters()]
    ballast_sum = int(ballast.sum().item())
    outcome: dict[str, Any] = {}

    def control() -> None:
        try:
            outcome["pause"] = engine.pause().path
            fd, _size = _C.host_staging_layout().extents[0]
            original = os.pread(fd, 1, 4096)
            os.pwrite(fd, bytes([original[0] ^ 1]), 4096)
            try:
                engine.resume()
                outcome["first"] = "resumed on a changed staging"
            except OperationFailedError as exc:
                outcome["first"] = {"step": exc.step, "error": str(exc), "state": engine.state.name}
            os.pwrite(fd, original, 4096)
            second = engine.resume()
            outcome["second"] = {"ok": second.ok, "steps": [s.step for s in second.steps]}
        except Exception as exc:
            outcome["error"] = f"{type(exc).__name__}: {exc}"

    optimizer.zero_grad(set_to_none=True)  # steps without gradients leave the parameters as they are
    thread = threading.Thread(target=control)
    thread.start()
    while thread.is_alive():
        optimizer.step()  # a safe point
        torch.cuda.synchronize(device)
        time.sleep(0.01)
    thread.join()
    outcome["intact"] = all(torch.equal(a, b) for a, b in zip(expected, model.parameters(), strict=True))
    outcome["ballast_intact"] = int(ballast.sum().item()) == ballast_sum
    flexium.shutdown()
    return outcome


def test_a_changed_staging_is_caught_at_the_resume_and_the_job_stays_paused() -> None:
    out = run_in_fresh_process(corrupted_staging, timeout=300)
    assert "error" not in out, out
    assert out["pause"] == "fast"
    first = out["first"]
    assert isinstance(first, dict) and first["step"] == "verify" and first["state"] == "PAUSED", first
    assert "the moved bytes do not match" in first["error"] and "paused again" in first["error"], first
    assert out["second"] == {"ok": True, "steps": ["restore", "unlock", "copy_back", "verify"]}, out
    assert out["intact"] and out["ballast_intact"]
