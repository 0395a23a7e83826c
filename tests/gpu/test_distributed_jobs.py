"""Whole torchrun jobs (2 ranks, NCCL) paused, resumed and swapped on 2 GPUs, bit-identical to
undisturbed runs, each rank after each operation on the GPU it was sent to, and every GPU no rank
is on (all of them while paused) back to its idle reading; and the refusals, each job training
on unaffected, of a job whose NCCL cannot suspend its communicators and of a job whose ranks share
a GPU (fact `nccl-ranks-sharing-gpu-fail`). On one GPU: those refusals, and torchrun jobs of one rank, which
pause and resume as one process.

The NCCL with suspend/resume (2.29.7+) comes from FLEXIUM_TEST_NCCL_LIB (ci/gpu-tests.sh builds
it from FLEXIUM_NCCL_SOURCE, or takes FLEXIUM_NCCL_LIB, and sets it): torch 2.11's own NCCL 2.28.9
lacks it."""

from __future__ import annotations

import os
from typing import Any

import pytest

from support.fresh_process import run_in_fresh_process
from support.gpu import assert_back_to_idle, idle_used, nccl_with_suspend, need_gpus, torch_nccl_version
from support.served_job import ServedJob
from support.torchrun import (
    TorchrunJob,
    check_left_idle,
    check_ops,
    check_placements,
    check_traces,
    steps_at_ops,
    torchrun,
    torchrun_argv,
)

# The NCCL watchdog's heartbeat monitor kills a rank whose watchdog is stuck this long; a paused
# job's must not be (issue: a pause may last hours).
SHORT_HEARTBEAT_S = 8
# The monitor on with that timeout, for pauses held three times as long; torch's flight recorder
# on, so that a paused rank can say which collectives its watchdog still lists (rank_job.py); NCCL's
# and torch's own word on a failure (with the monitor's C++ stacks) in the job's kept stderr.
SHORT_HEARTBEAT = {
    "TORCH_NCCL_ENABLE_MONITORING": "1",
    "TORCH_NCCL_HEARTBEAT_TIMEOUT_SEC": str(SHORT_HEARTBEAT_S),
    "TORCH_NCCL_TRACE_BUFFER_SIZE": "64",
    "NCCL_DEBUG": "WARN",
    "TORCH_CPP_LOG_LEVEL": "INFO",
}
LONG_HOLD = ("--hold", str(SHORT_HEARTBEAT_S * 3))


# NCCL's transport between the ranks' GPUs: peer access (P2P over NVLink, the H200 machines'), or its shared-memory
# transport as on GPUs without peer access (host memory both ranks map, made as /dev/shm files registered with the
# driver under flexium's NCCL_CUMEM_HOST_ENABLE=0, fact `cumem-host-memory-unrestorable`).
TRANSPORTS = {"p2p": {}, "shm": {"NCCL_P2P_DISABLE": "1"}}


@pytest.mark.parametrize(("model", "transport"), [("ddp", "p2p"), ("fsdp2", "p2p"), ("ddp", "shm")])
def test_a_whole_job_pauses_resumes_and_swaps_bit_identical(two_gpus: list[Any], model: str, transport: str) -> None:
    nccl = nccl_with_suspend()
    # Steps enough for the pause's host staging, prepared while the ranks train on, to come before
    # the last operation's agreed step (every operation waits for its step; a job that ended first
    # would leave it waiting out its deadline).
    common = ("--model", model, "--steps", "120")
    reference = torchrun(*common, nccl=nccl, env=TRANSPORTS[transport])
    assert reference.returncode == 0, reference.stderr[-4000:]
    idle = idle_used()
    plan = ("--plan", "10:pause", "--plan", "10:resume", "--plan", "25:migrate:0=1,1=0", "--plan", "40:migrate:0=0,1=1")
    moved = torchrun(*common, *plan, *LONG_HOLD, nccl=nccl, env={**SHORT_HEARTBEAT, **TRANSPORTS[transport]})
    check_ops(moved, ["pause", "resume", "migrate", "migrate"])
    for rank in (0, 1):
        assert moved.losses(rank) == reference.losses(rank), f"rank {rank}'s loss trace differs"
        pause, resume, swap, back = moved.of(rank, "op")
        paused = moved.of(rank, "paused")[0]
        assert sum(paused["held"].values()) == 0, f"rank {rank} held {paused['held']} while paused"
        assert paused["unretired"] and not any(paused["unretired"].values()), paused  # the watchdog is not stuck
        start = moved.of(rank, "done")[0]
        # torch's cached properties keep the GPU of the start (fact `remap-keeps-old-identity`)
        assert start["uuid"] == reference.of(rank, "done")[0]["uuid"]
        for op in (swap, back):
            assert "suspend_nccl" in op["steps"] and "resume_nccl" in op["steps"]
    # Rank by rank, after each operation: paused (nowhere), resumed in place, swapped, swapped back.
    where: dict[int, list[int | None]] = {0: [None, 0, 1, 0], 1: [None, 1, 0, 1]}
    uuids = [gpu.uuid for gpu in two_gpus]
    check_placements(moved, uuids, where)
    check_left_idle(moved, uuids, where, idle)
    # every rank stopped at the same step for each operation
    zero, one = steps_at_ops(moved)
    assert zero == one


# Long enough (30 steps) for the keeper of a kept-ready pause to look twice (every 2 s).
KEEPER_LOOKS = ("--step-sleep", "0.15")


def _refused_and_trained_on(job: TorchrunJob, problem: str, error: str) -> None:
    """Every rank reported itself not movable for `problem`, each planned operation was refused
    with `error` after "cannot KIND the job: ", kept no host memory pinned for a pause it would
    refuse, and trained to the end, its ballast intact."""
    assert job.returncode == 0, job.stderr[-4000:]
    for rank in (0, 1):
        caps = job.of(rank, "capabilities")[0]
        assert caps["job_operations"] is False
        assert any(problem in p for p in caps["problems"]), caps
        ops = job.of(rank, "op")
        assert len(ops) == 2, ops
        for op in ops:
            assert not op["ok"] and op["error"].startswith(f"cannot {op['kind']} the job: {error}")
        done = job.of(rank, "done")[0]
        assert len(job.losses(rank)) == 30 and done["ballast_intact"]
        assert done["kept_pinned"] == 0, done
        assert done["keeper_note"].startswith("nothing is kept pinned between pauses: a pause of this job is refused")
        assert problem in done["keeper_note"], done


@pytest.fixture
def refused_plan(host_gpus: list[Any]) -> tuple[str, ...]:
    """A refusal needs no second GPU: a pause and a swap with each rank on a GPU of its own where
    there are two; with both on cuda:0 (rank_job.py --ranks-share-gpu) where there is one, a pause
    and a migration to cuda:0 (refused for the job's NCCL before its target is looked at)."""
    if len(host_gpus) >= 2:
        return ("--plan", "5:pause", "--plan", "8:migrate:0=1,1=0")
    return ("--ranks-share-gpu", "sockets", "--plan", "5:pause", "--plan", "8:migrate:0=0,1=0")


def test_a_job_whose_nccl_cannot_suspend_is_refused_and_trains_on(refused_plan: tuple[str, ...]) -> None:
    job = torchrun("--model", "ddp", "--steps", "30", *KEEPER_LOOKS, *refused_plan, nccl=None)
    _refused_and_trained_on(job, "which cannot suspend its communicators", f"this job's NCCL is {torch_nccl_version()}")


def test_a_job_holding_a_cuda_graph_of_an_all_reduce_is_refused_and_trains_on(
    two_gpus: list[Any], refused_plan: tuple[str, ...]
) -> None:
    # Not with both ranks on one GPU: that job did not end in 350 s (fact `nccl-ranks-sharing-gpu-fail`).
    args = ("--model", "ddp", "--steps", "30", *KEEPER_LOOKS, "--graph-all-reduce", *refused_plan)
    job = torchrun(*args, nccl=nccl_with_suspend(), timeout=150)
    _refused_and_trained_on(
        job, "a CUDA graph captured while its NCCL process group existed", "this rank holds a CUDA graph"
    )


# ------------------------------------------------------------------ what one GPU can show


def nccl_suspended_around_a_pause() -> dict[str, Any]:
    """A one-rank NCCL job that suspends its communicator around a flexium pause, as a whole-job
    pause does on every rank (run in a fresh process, with and without an LD_PRELOADed NCCL that
    has ncclCommSuspend): what it saw."""
    import tempfile

    import torch
    import torch.distributed as dist

    import flexium
    from flexium.api import runtime
    from flexium.engine import nvml
    from flexium.engine.distributed import nccl

    def held() -> int:
        return sum(gpu.used_by(os.getpid()) or 0 for gpu in nvml.host_gpus())

    flexium.init()
    current = runtime.current()
    assert current is not None and current.engine is not None
    engine = current.engine
    rendezvous = os.path.join(tempfile.mkdtemp(), "rendezvous")
    dist.init_process_group("nccl", init_method=f"file://{rendezvous}", rank=0, world_size=1)
    probe = torch.ones(1, device="cuda")
    dist.all_reduce(probe)
    library = nccl.loaded_library()
    seen: dict[str, Any] = {
        "library": None if library is None else library.path,
        "version": None if library is None else library.version_name,
        "can_suspend": None if library is None else library.can_suspend,
        "problem": nccl.suspend_problem(),
    }
    if library is not None and library.can_suspend:
        comms = nccl.communicators()
        seen["communicators"] = [type(c).__name__ for c in comms]
        torch.cuda.synchronize()
        for comm in comms:
            comm.suspend()
        seen["suspended"] = all(comm.is_suspended() for comm in comms)
        pause = engine.pause()
        seen["pause_path"] = pause.path
        seen["held_while_paused"] = held()
        engine.resume()
        for comm in comms:
            comm.resume()
        seen["resumed"] = not any(comm.is_suspended() for comm in comms)
        after = torch.full((1,), 3.0, device="cuda")
        dist.all_reduce(after)
        seen["all_reduce_after"] = float(after.item())
    dist.destroy_process_group()
    flexium.shutdown()
    return seen


def test_an_nccl_communicator_is_suspended_around_a_pause_and_works_after() -> None:
    nccl = nccl_with_suspend()
    # One rank outside torchrun: flexium.init() leaves its NCCL settings alone, so the job makes them.
    movable = {"NCCL_NVLS_ENABLE": "0", "NCCL_CUMEM_HOST_ENABLE": "0"}
    env = {"LD_PRELOAD": nccl, **movable}
    seen = run_in_fresh_process(nccl_suspended_around_a_pause, env=env)
    assert seen["library"] == os.path.realpath(nccl) and seen["can_suspend"] and seen["problem"] is None, seen
    assert seen["communicators"] == ["RawCommunicator"] and seen["suspended"] and seen["resumed"]
    assert seen["held_while_paused"] == 0 and seen["all_reduce_after"] == 3.0
    seen = run_in_fresh_process(nccl_suspended_around_a_pause, env={"LD_PRELOAD": "", **movable})
    bundled = torch_nccl_version()  # torch's own (2.28.9 in torch 2.11), without ncclCommSuspend
    assert seen["can_suspend"] is False and seen["version"] == bundled
    assert seen["problem"].startswith(f"this job's NCCL is {bundled} (") and "torch 2.12 or newer" in seen["problem"]


# A torchrun job of one rank (--nproc-per-node 1) is one process to flexium and to the server: its
# pause is the one-process pause, with its NCCL communicator of one rank in the driver's checkpoint.
# Each case: (NCCL preloaded, environment, job arguments).
ONE_RANK_CASES: dict[str, tuple[str | None, dict[str, str], tuple[str, ...]]] = {
    "bundled-nccl-fast": (None, {}, ("--model", "ddp")),
    "bundled-nccl-driver": (None, {"FLEXIUM_FAST_PATH": "0"}, ("--model", "ddp")),
    "nccl-with-suspend": ("suspend", {}, ("--model", "ddp")),
    "graph-of-an-all-reduce": (None, {}, ("--model", "ddp", "--graph-all-reduce")),
    "fsdp2-fast": (None, {}, ("--model", "fsdp2")),
    "fsdp2-driver": (None, {"FLEXIUM_FAST_PATH": "0"}, ("--model", "fsdp2")),
}


@pytest.mark.parametrize("case", ONE_RANK_CASES)
def test_a_one_rank_nccl_job_pauses_and_resumes_like_one_process(case: str) -> None:
    preload, env, job = ONE_RANK_CASES[case]
    nccl = nccl_with_suspend() if preload else None
    common = (*job, "--steps", "40")
    reference = torchrun(*common, nccl=nccl, env=env, ranks=1)
    assert reference.returncode == 0, reference.stderr[-4000:]
    paused = torchrun(*common, "--plan", "10:pause", "--plan", "10:resume", "--hold", "2", nccl=nccl, env=env, ranks=1)
    check_ops(paused, ["pause", "resume"])
    assert paused.of(0, "capabilities")[0]["job_operations"] is None  # no ranks to agree with
    assert paused.losses(0) == reference.losses(0), "the loss trace differs"
    assert sum(paused.of(0, "paused")[0]["held"].values()) == 0, paused.of(0, "paused")
    pause = paused.of(0, "op")[0]
    assert pause["path"] == ("driver" if env else "fast"), pause


@pytest.mark.parametrize("nccl_kind", ["bundled", "with-suspend"])
def test_a_one_rank_nccl_job_moves_to_another_gpu_and_back(two_gpus: list[Any], nccl_kind: str) -> None:
    nccl = nccl_with_suspend() if nccl_kind == "with-suspend" else None
    common = ("--model", "ddp", "--steps", "40")
    reference = torchrun(*common, nccl=nccl, ranks=1)
    assert reference.returncode == 0, reference.stderr[-4000:]
    idle = idle_used()
    moved = torchrun(*common, "--plan", "10:migrate:0=1", "--plan", "20:migrate:0=0", nccl=nccl, ranks=1)
    check_ops(moved, ["migrate", "migrate"])
    assert moved.losses(0) == reference.losses(0), "the loss trace differs"
    uuids = [gpu.uuid for gpu in two_gpus]
    check_placements(moved, uuids, {0: [1, 0]})
    check_left_idle(moved, uuids, {0: [1, 0]}, idle)


SHARED_GPU_REFUSAL = "ranks 0 and 1 of this NCCL job would be on one GPU"


@pytest.mark.parametrize("transport", ["sockets", "ipc"])
def test_a_two_rank_nccl_job_sharing_one_gpu_is_refused_and_trains_on(transport: str) -> None:
    # Both ranks on cuda:0 (rank_job.py --ranks-share-gpu): NCCL's next collective fails in a rank
    # the driver restored on a GPU it shares with another rank (fact `nccl-ranks-sharing-gpu-fail`), so every
    # rank refuses the pause and an in-place migration before anything changes, and trains on.
    plan = ("--plan", "5:pause", "--plan", "8:migrate:0=0,1=0")
    job = torchrun("--model", "ddp", "--steps", "30", "--ranks-share-gpu", transport, *plan, nccl=nccl_with_suspend())
    assert job.returncode == 0, job.stderr[-4000:]
    for rank in (0, 1):
        assert job.of(rank, "capabilities")[0]["job_operations"] is True  # movable, given GPUs of their own
        ops = job.of(rank, "op")
        assert len(ops) == 2, ops
        for op in ops:
            assert not op["ok"] and op["error"].startswith(f"cannot {op['kind']} the job: {SHARED_GPU_REFUSAL}"), op
        assert len(job.losses(rank)) == 30 and job.of(rank, "done")[0]["ballast_intact"]


def test_a_two_rank_gloo_job_on_one_gpu_pauses_and_resumes_as_a_whole() -> None:
    # Both ranks on cuda:0 (gloo allows it, NCCL does not): the protocol with the real driver
    # and the memory pool, on any machine with one GPU.
    one_gpu = {"GPU_DEVICE": "cuda:0"}
    common = ("--model", "ddp", "--backend", "gloo", "--steps", "40", "--ballast-gb", "0.5")
    reference = torchrun(*common, nccl=None, env=one_gpu)
    assert reference.returncode == 0, reference.stderr[-4000:]
    paused = torchrun(*common, "--plan", "10:pause", "--plan", "10:resume", "--hold", "2", nccl=None, env=one_gpu)
    check_ops(paused, ["pause", "resume"])
    for rank in (0, 1):
        assert paused.losses(rank) == reference.losses(rank), f"rank {rank}'s loss trace differs"
        assert sum(paused.of(rank, "paused")[0]["held"].values()) == 0
        pause = paused.of(rank, "op")[0]
        assert pause["path"] == "fast" and "meet" in pause["steps"]
    zero, one = steps_at_ops(paused)
    assert zero == one


# ------------------------------------------------------------------ through the server and the CLI


def _server_case(case: str, host_gpus: list[Any]) -> tuple[tuple[str, ...], dict[str, str], str | None, int]:
    """(job arguments, environment, LD_PRELOAD, ranks) of a case."""
    if case == "gloo-one-gpu":
        return ("--backend", "gloo", "--ballast-gb", "0.5"), {"GPU_DEVICE": "cuda:0"}, None, 2
    warnings = {"NCCL_DEBUG": "WARN"}  # NCCL's own word on a failure, in the job's output
    if case == "nccl-one-rank":  # one process to the server; torch's own NCCL
        return ("--backend", "nccl", "--ballast-gb", "2"), warnings, None, 1
    if case == "nccl-one-gpu":
        return (
            ("--backend", "nccl", "--ballast-gb", "2", "--ranks-share-gpu", "sockets"),
            warnings,
            nccl_with_suspend(),
            2,
        )
    need_gpus(host_gpus, 2)
    return ("--backend", "nccl", "--ballast-gb", "2"), warnings, nccl_with_suspend(), 2


@pytest.mark.parametrize("case", ["gloo-one-gpu", "nccl-one-rank", "nccl-one-gpu", "nccl-two-gpus"])
def test_the_server_and_cli_move_a_whole_torchrun_job_or_refuse_it(
    host_gpus: list[Any], tmp_path: Any, case: str
) -> None:
    pytest.importorskip("fastapi", reason="the server extra is not installed (ci/gpu-tests.sh installs .whl)")
    job_args, job_env, preload, ranks = _server_case(case, host_gpus)
    # Long enough for every command to land while the job trains (two more, the migrations, on two GPUs).
    count = 1500 if case == "nccl-two-gpus" else 600
    steps = ("--model", "ddp", "--steps", str(count), "--step-sleep", "0.03")
    reference = torchrun(*job_args, *steps[:4], "--step-sleep", "0", nccl=preload, env=job_env, ranks=ranks)
    assert reference.returncode == 0, reference.stderr[-4000:]
    idle = idle_used()
    with ServedJob(tmp_path, torchrun_argv(ranks, *job_args, *steps), ranks, env=job_env, nccl=preload) as job:
        if case == "nccl-one-gpu":  # its ranks share the GPU: refused, and the job trains on
            refused = job.cli("pause", job.process_id, "--json")
            assert refused.returncode != 0 and SHARED_GPU_REFUSAL in refused.stdout + refused.stderr, refused
            check_traces(job.finish(), reference, count)
            return
        start = job.held()  # each rank on a GPU of its own, or all on cuda:0
        assert all(len(on) == 1 for on in start), start
        paused = job.command("pause", job.process_id)
        assert {result["path"] for result in paused} == {"fast"}, paused
        assert job.held() == [[]] * ranks, "a rank holds GPU memory while paused"
        assert_back_to_idle(idle, (), "the pause")
        job.command("resume", job.process_id)
        assert job.held() == start, "resumed elsewhere than where it paused"
        assert_back_to_idle(idle, {uuid for on in start for uuid in on}, "the resume")
        if case == "nccl-two-gpus":
            uuid = [gpu.uuid for gpu in host_gpus]
            assert start == [[uuid[0]], [uuid[1]]], start
            job.command("migrate", job.process_id, "--ranks", "0=cuda:1,1=cuda:0")
            assert job.held() == [[uuid[1]], [uuid[0]]], "after the swap"
            job.command("migrate", job.process_id, "--ranks", "0=cuda:0,1=cuda:1")
            assert job.held() == start, "after the swap back"
        check_traces(job.finish(), reference, count)
