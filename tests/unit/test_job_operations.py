"""A whole-job pause, resume and migration (engine/distributed/job_operation.py) on real
2-rank gloo jobs under the fake driver: every rank stops at the same optimizer step, the
protocol's meetings, and what every failure on any rank does to every rank."""

from __future__ import annotations

import json
import time
from typing import Any

import pytest

from flexium.engine.distributed.rendezvous import OK, Gathered, JobAborted, Rendezvous
from support.engine import DictStore, Script, script_env

STEPS = 40
CUDA_ERROR_UNKNOWN = 999
CUDA_ERROR_INVALID_VALUE = 1  # a restore refused for its arguments: the one failure that leaves it restorable

RANK_SCRIPT = """
import torch
from support import fake_driver
import torch.distributed as dist
import flexium
from flexium.api import runtime
from flexium.engine.distributed import job_operation, nccl, rendezvous
from flexium.engine.distributed.job_operation import Deadlines, JobOperation
from flexium.engine.operations import OperationKind
from flexium.errors import FlexiumError

rank = int(os.environ["TEST_RANK"])
plan = json.loads(os.environ["TEST_PLAN"])
fake = fake_driver.FakeDriver(os.environ["FLEXIUM_LIBCUDA"])
flexium.init()
engine = runtime.current().engine
fake.set_process_memory(0, 1 << 30)
# Memory the driver cannot restore (fact `cumem-host-memory-unrestorable`).
if os.environ.get("TEST_HOST_CUMEM_RANK") == str(rank):
    free_host_cumem = fake.cumem_mapping(2 << 20)
dist.init_process_group("gloo", init_method=os.environ["TEST_RENDEZVOUS"], rank=rank, world_size=2)

if os.environ.get("TEST_CLAIM_NCCL"):  # a job on NCCL, as the engine sees it
    from flexium.engine.distributed import cuda_graphs, membership
    membership.DistributedJob.uses_nccl = property(lambda self: True)
    nccl.suspend_problem = lambda *args, **kwargs: None
    cuda_graphs.problem = lambda *args, **kwargs: None
    if os.environ.get("TEST_GRAPH_RANK") == str(rank):  # this rank holds a CUDA graph of NCCL calls
        cuda_graphs.problem = lambda *args, **kwargs: "this rank holds a CUDA graph (test)"

comm_calls = []
class RecordingComm:
    name = "recording"
    suspended = False
    def suspend(self):
        comm_calls.append("suspend")
        if os.environ.get("TEST_FAIL_SUSPEND") == str(rank):
            raise nccl.NcclError("ncclCommSuspend failed: unhandled cuda error (ncclResult_t 1)")
        self.suspended = True
    def resume(self):
        comm_calls.append("resume")
        self.suspended = False
    def is_suspended(self):
        return self.suspended
comm = RecordingComm()
nccl.communicators = lambda: [comm]

die_at = os.environ.get("TEST_DIE_AT", "") if os.environ.get("TEST_DIE_RANK") == str(rank) else ""
if die_at:
    real_gather = rendezvous.Rendezvous.gather
    def gather(self, stage, word, **kw):
        if stage == die_at:
            os._exit(3)
        return real_gather(self, stage, word, **kw)
    rendezvous.Rendezvous.gather = gather

steps_done = 0
results = []
def control():
    for op in plan:
        while steps_done < op["after_step"]:
            time.sleep(0.002)
        if rank not in op.get("ranks", [0, 1]):
            continue
        time.sleep(op.get("delay", 0))
        index = op.get("targets", {}).get(str(rank))
        job = JobOperation(op["id"], OperationKind(op["kind"]), rank, 2,
                           target=None if index is None else engine.gpus[index].uuid)
        try:
            r = engine.run_job_operation(job, deadlines=Deadlines(**op.get("deadlines", {})))
            results.append({"ok": True, "path": r.path, "steps": [s.step for s in r.steps], "stop": steps_done})
        except FlexiumError as exc:
            r = getattr(exc, "result", None)
            results.append({"ok": False, "type": type(exc).__name__, "error": str(exc),
                            "failed_step": getattr(exc, "step", None), "stop": steps_done})
thread = threading.Thread(target=control, daemon=True)
thread.start()

torch.manual_seed(0)
model = torch.nn.Linear(16, 16)
opt = torch.optim.SGD(model.parameters(), lr=0.05)
data = torch.Generator().manual_seed(10 + rank)
losses, broken = [], None
for step in range(int(os.environ["TEST_STEPS"])):
    x = torch.randn(8, 16, generator=data)
    loss = model(x).square().mean()
    opt.zero_grad()
    loss.backward()
    try:
        for p in model.parameters():
            dist.all_reduce(p.grad)
    except RuntimeError as exc:  # a peer died
        broken = str(exc)
        break
    opt.step()
    losses.append(loss.item())
    steps_done += 1
    time.sleep(0.01)
thread.join(timeout=60)
if broken is None:
    dist.destroy_process_group()
out(rank=rank, losses=losses, results=results, state=engine.state.value, placement=fake.placement(),
    calls=fake.checkpoint_calls(), comm=comm_calls, broken=broken)
"""


def _run_job(tmp_path: Any, plan: list[dict[str, Any]], **per_rank_env: dict[int, str]) -> list[dict[str, Any]]:
    rendezvous = f"file://{tmp_path / 'rendezvous'}"
    scripts = []
    for rank in (0, 1):
        env = {
            **script_env(),
            "TEST_RANK": str(rank),
            "TEST_RENDEZVOUS": rendezvous,
            "TEST_PLAN": json.dumps(plan),
            "TEST_STEPS": str(STEPS),
        }
        for name, values in per_rank_env.items():
            if rank in values:
                env[name] = values[rank]
        scripts.append(Script(RANK_SCRIPT, env, torch=True, timeout=120))
    try:
        return [script.wait().result for script in scripts]
    finally:
        for script in scripts:
            script.kill()


@pytest.fixture(scope="module")
def reference(tmp_path_factory: pytest.TempPathFactory) -> list[list[float]]:
    """Each rank's losses in an undisturbed run."""
    outs = _run_job(tmp_path_factory.mktemp("reference"), [])
    assert all(len(out["losses"]) == STEPS for out in outs)
    return [out["losses"] for out in outs]


def _fail(function: str, code: int = CUDA_ERROR_UNKNOWN) -> str:
    return f"{function}:{code}:1"


def test_a_whole_job_pause_and_resume_stop_every_rank_at_one_step(tmp_path: Any, reference: Any) -> None:
    plan = [{"id": 1, "kind": "pause", "after_step": 5}, {"id": 2, "kind": "resume", "after_step": 0, "delay": 0.3}]
    outs = _run_job(tmp_path, plan)
    for out in outs:
        pause, resume = out["results"]
        assert pause["ok"] and resume["ok"], out["results"]
        # the rank locks (checkpoint) only after torch's NCCL watchdog has looked at its collectives
        assert pause["steps"][:3] == ["meet", "suspend_nccl", "watchdog"] and "checkpoint" in pause["steps"]
        assert resume["steps"][0] == "meet" and resume["steps"][-3:] == ["meet_again", "resume_nccl", "check_nccl"]
        assert out["comm"] == ["suspend", "resume"]
        assert [c for c in out["calls"] if c in ("Checkpoint", "Restore")] == ["Checkpoint", "Restore"]
        assert out["state"] == "RUNNING" and out["placement"] == [0, 1]
        assert out["losses"] == reference[out["rank"]]  # the same numbers as an undisturbed run
    assert outs[0]["results"][0]["stop"] == outs[1]["results"][0]["stop"]  # one step for both


# Each rank's fake driver models a machine of its own, where the rank starts on GPU 0: a "swap"
# here moves both ranks to GPU 1, each in its own machine.
BOTH_MOVE = {"0": 1, "1": 1}


def test_both_ranks_move_and_one_rank_can_move_alone(tmp_path: Any, reference: Any) -> None:
    plan = [
        {"id": 1, "kind": "migrate", "after_step": 5, "targets": BOTH_MOVE},
        {"id": 2, "kind": "migrate", "after_step": 15, "targets": {"1": 0}},
    ]
    outs = _run_job(tmp_path, plan)
    zero, one = outs
    assert [r["ok"] for r in zero["results"] + one["results"]] == [True] * 4
    assert zero["placement"] == [1, 0]  # swapped, stayed
    assert one["placement"] == [0, 1]  # swapped, then back alone
    assert zero["results"][1]["path"] == "stayed" and one["results"][1]["path"] == "driver"
    assert "watchdog" not in zero["results"][1]["steps"]  # a rank that stays never locks
    assert one["results"][1]["steps"][:3] == ["meet", "suspend_nccl", "watchdog"]
    for out in outs:
        assert out["comm"] == ["suspend", "resume"] * 2
        assert out["losses"] == reference[out["rank"]]


def test_an_nccl_job_is_refused_any_operation_that_restores_a_rank_on_a_gpu_it_shares(
    tmp_path: Any, reference: Any
) -> None:
    # Both ranks start on the same GPU (the fake driver's GPU 0 has one UUID in every rank).
    plan = [
        {"id": 1, "kind": "pause", "after_step": 5},
        {"id": 2, "kind": "migrate", "after_step": 10, "targets": BOTH_MOVE},
        {"id": 3, "kind": "migrate", "after_step": 15, "targets": {"1": 1}},  # rank 1 alone: allowed
    ]
    outs = _run_job(tmp_path, plan, TEST_CLAIM_NCCL={0: "1", 1: "1"})
    zero, one = outs
    for out in outs:
        pause, swap, alone = out["results"]
        for refused, kind in ((pause, "pause"), (swap, "migrate")):
            assert not refused["ok"] and refused["type"] == "CapabilityError", refused
            assert refused["error"].startswith(
                f"cannot {kind} the job: ranks 0 and 1 of this NCCL job would be on one GPU"
            )
            assert "give each rank a GPU of its own" in refused["error"]
        assert alone["ok"], alone
        assert out["comm"] == ["suspend", "resume"]  # NCCL was never touched by the refused ones
        assert out["losses"] == reference[out["rank"]]
    assert zero["results"][2]["path"] == "stayed" and zero["placement"] == [0, 1] and "Checkpoint" not in zero["calls"]
    assert one["placement"] == [1, 0] and [c for c in one["calls"] if c == "Checkpoint"] == ["Checkpoint"]


def test_a_failed_checkpoint_on_one_rank_resumes_the_rank_that_paused(tmp_path: Any, reference: Any) -> None:
    plan = [{"id": 1, "kind": "pause", "after_step": 5}]
    outs = _run_job(tmp_path, plan, FAKE_CUDA_FAIL={1: _fail("cuCheckpointProcessCheckpoint")})
    zero, one = outs
    assert "rank 1: checkpoint" in zero["results"][0]["error"] and "resumed where it was" in zero["results"][0]["error"]
    assert one["results"][0]["failed_step"] == "pause"
    for out in outs:
        assert not out["results"][0]["ok"] and out["state"] == "RUNNING" and out["placement"] == [0, 1]
        assert out["comm"] == ["suspend", "resume"]
        assert out["losses"] == reference[out["rank"]]


def test_a_failed_restore_on_one_moving_rank_brings_both_back(tmp_path: Any, reference: Any) -> None:
    plan = [{"id": 1, "kind": "migrate", "after_step": 5, "targets": BOTH_MOVE}]
    outs = _run_job(tmp_path, plan, FAKE_CUDA_FAIL={1: _fail("cuCheckpointProcessRestore", CUDA_ERROR_INVALID_VALUE)})
    zero, one = outs
    assert "every rank is back on the GPU it was on" in zero["results"][0]["error"]
    for out in outs:
        assert not out["results"][0]["ok"] and out["results"][0]["failed_step"] == "move"
        assert out["state"] == "RUNNING" and out["placement"] == [0, 1]
        assert out["losses"] == reference[out["rank"]]
    assert zero["calls"].count("Restore") == 2  # there, and back


def test_a_failed_resume_on_one_rank_leaves_the_whole_job_paused_and_resumable(tmp_path: Any, reference: Any) -> None:
    plan = [
        {"id": 1, "kind": "pause", "after_step": 5},
        {"id": 2, "kind": "resume", "after_step": 0},
        {"id": 3, "kind": "resume", "after_step": 0, "delay": 0.2},
    ]
    # rank 1's first restore (its first resume) fails and leaves it paused
    outs = _run_job(tmp_path, plan, FAKE_CUDA_FAIL={1: _fail("cuCheckpointProcessRestore", CUDA_ERROR_INVALID_VALUE)})
    zero, one = outs
    assert [r["ok"] for r in zero["results"]] == [True, False, True]
    assert [r["ok"] for r in one["results"]] == [True, False, True]
    assert "paused again" in zero["results"][1]["error"]
    for out in outs:
        assert out["state"] == "RUNNING" and out["comm"] == ["suspend", "resume"]
        assert out["losses"] == reference[out["rank"]]


def test_a_failed_nccl_suspend_on_one_rank_moves_nothing(tmp_path: Any, reference: Any) -> None:
    plan = [{"id": 1, "kind": "migrate", "after_step": 5, "targets": BOTH_MOVE}]
    outs = _run_job(tmp_path, plan, TEST_FAIL_SUSPEND={0: "1", 1: "1"})
    zero, one = outs
    assert zero["comm"] == ["suspend", "resume"] and one["comm"] == ["suspend"]
    for out in outs:
        assert not out["results"][0]["ok"] and out["results"][0]["failed_step"] == "suspend_nccl"
        assert "rank 1: could not suspend NCCL" in out["results"][0]["error"]
        assert out["calls"] == [] and out["placement"] == [0, 1]
        assert out["losses"] == reference[out["rank"]]


@pytest.mark.parametrize(
    "backend, stage, late",
    [
        ("gloo", "agree", "take the operation up"),
        ("nccl", "placement", "say which GPU it will be on"),  # NCCL jobs meet first to check the placement
    ],
)
def test_a_rank_that_never_takes_the_operation_up_changes_nothing(
    tmp_path: Any, reference: Any, backend: str, stage: str, late: str
) -> None:
    plan = [{"id": 1, "kind": "pause", "after_step": 5, "ranks": [0], "deadlines": {"agree_s": 0.1}}]
    claim = {"TEST_CLAIM_NCCL": {0: "1", 1: "1"}} if backend == "nccl" else {}
    outs = _run_job(tmp_path, plan, **claim)
    zero, one = outs
    assert zero["results"][0]["failed_step"] == stage
    assert f"rank(s) 1 did not {late} within 0.1 s" in zero["results"][0]["error"]
    assert one["results"] == []
    for out in outs:
        assert out["calls"] == [] and out["comm"] == [] and out["state"] == "RUNNING"
        assert out["losses"] == reference[out["rank"]]


def test_a_rank_that_refuses_its_part_at_once_lets_the_others_go_at_once(tmp_path: Any, reference: Any) -> None:
    """A rank whose own state refuses the operation (a CUDA graph of an NCCL job, on that rank
    alone) gives it up for every rank: the others are not left waiting out their deadline (60 s)
    for a rank that will never come, and are told why."""
    plan = [{"id": 1, "kind": "pause", "after_step": 5, "deadlines": {"agree_s": 60}}]
    zero, one = _run_job(tmp_path, plan, TEST_CLAIM_NCCL={0: "1", 1: "1"}, TEST_GRAPH_RANK={0: "1", 1: "1"})
    assert one["results"][0]["error"] == "cannot pause the job: this rank holds a CUDA graph (test)"
    waited = zero["results"][0]
    assert not waited["ok"] and waited["failed_step"] == "placement", waited
    assert "rank 1: refused: this rank holds a CUDA graph (test)" in waited["error"], waited
    for out in (zero, one):
        assert out["calls"] == [] and out["comm"] == [] and out["state"] == "RUNNING"
        assert out["losses"] == reference[out["rank"]]


def test_a_rank_holding_memory_the_driver_cannot_restore_refuses_for_the_job_and_may_only_stay(
    tmp_path: Any, reference: Any
) -> None:
    plan = [
        {"id": 1, "kind": "pause", "after_step": 5, "deadlines": {"agree_s": 60}},
        {"id": 2, "kind": "migrate", "after_step": 10, "targets": {"0": 1}},  # rank 1 stays: allowed
        {"id": 3, "kind": "migrate", "after_step": 15, "targets": {"1": 1}, "deadlines": {"agree_s": 60}},
    ]
    zero, one = _run_job(tmp_path, plan, TEST_HOST_CUMEM_RANK={1: "1"})
    holds = "this process holds cuMem memory located on the host (1 mapping, 2.0 MiB, the first at 0x"
    for index, kind in ((0, "pause"), (2, "migrate")):
        own, waited = one["results"][index], zero["results"][index]
        assert not own["ok"] and own["type"] == "CapabilityError", own
        assert own["error"].startswith(f"cannot {kind}: {holds}"), own
        # Given up for every rank at once: the other did not wait out its 60 s agreement.
        assert not waited["ok"] and f"rank 1: refused: cannot {kind}: {holds}" in waited["error"], waited
        assert waited["stop"] < plan[index]["after_step"] + 5, waited
    assert zero["results"][1]["ok"] and one["results"][1]["ok"], (zero["results"][1], one["results"][1])
    assert one["results"][1]["path"] == "stayed"
    assert zero["placement"] == [1, 0] and one["placement"] == [0, 1]
    assert "Lock" not in one["calls"]  # the rank holding it was never checkpointed
    for out in (zero, one):
        assert out["state"] == "RUNNING" and out["losses"] == reference[out["rank"]]


def test_a_rank_that_dies_while_paused_never_leaves_the_other_checkpointed(tmp_path: Any) -> None:
    plan = [{"id": 1, "kind": "pause", "after_step": 5, "deadlines": {"move_s": 2.0}}]
    rendezvous = f"file://{tmp_path / 'rendezvous'}"
    env = {**script_env(), "TEST_RENDEZVOUS": rendezvous, "TEST_PLAN": json.dumps(plan), "TEST_STEPS": str(STEPS)}
    zero = Script(RANK_SCRIPT, {**env, "TEST_RANK": "0"}, torch=True, timeout=120)
    one = Script(RANK_SCRIPT, {**env, "TEST_RANK": "1", "TEST_DIE_RANK": "1", "TEST_DIE_AT": "paused"}, torch=True)
    try:
        dead, alive = one.wait(), zero.wait().result
    finally:
        zero.kill()
        one.kill()
    assert dead.returncode == 3
    result = alive["results"][0]
    assert not result["ok"] and "rank(s) 1 did not pause within 2 s" in result["error"]
    assert "resumed where it was" in result["error"] and alive["state"] == "RUNNING"
    assert [c for c in alive["calls"] if c != "GetState"][-2:] == ["Restore", "Unlock"]  # not left checkpointed


# ----------------------------------------------------------------------- the meetings alone


def test_a_gather_that_times_out_gives_up_for_every_rank() -> None:
    store = DictStore()
    now = [0.0]

    def clock() -> float:
        now[0] += 0.5
        return now[0]

    zero = Rendezvous(store, 7, rank=0, world_size=3, clock=clock)
    Rendezvous(store, 7, rank=2, world_size=3).post("at")
    with pytest.raises(JobAborted, match=r"rank 0: rank\(s\) 1 did not meet within 2 s"):
        zero.gather("at", OK, deadline_s=2.0, what="meet")
    two = Rendezvous(store, 7, rank=2, world_size=3)
    with pytest.raises(JobAborted, match="rank 0: rank"):
        two.gather("next", OK, deadline_s=60, what="meet")
    late: Gathered | None = Rendezvous(store, 7, rank=1, world_size=3).gather(
        "at", "late", deadline_s=1, what="meet", abortable=False
    )
    assert late is not None and late.failures() == {1: "late"}


def test_a_rank_locks_no_sooner_than_two_nccl_watchdog_looks_after_the_drain() -> None:
    from flexium.engine.distributed import job_operation

    drained = time.monotonic()
    job_operation._let_watchdog_look(drained)
    assert time.monotonic() - drained >= job_operation.WATCHDOG_LOOKS_S
    # a suspend that took longer than that already gave the watchdog its looks: no wait
    long_ago = time.monotonic() - 1.0
    before = time.monotonic()
    job_operation._let_watchdog_look(long_ago)
    assert time.monotonic() - before < 0.05


def test_only_a_rank_restored_onto_a_gpu_it_shares_makes_the_placement_refused() -> None:
    from flexium import protocol

    apart = {0: "GPU-a", 1: "GPU-b", 2: "GPU-b"}
    # ranks 1 and 2 share GPU-b, but only rank 0 moves (to its own GPU): nobody restored there
    assert protocol.nccl_ranks_on_one_gpu(apart, restored={0}) is None
    refusal = protocol.nccl_ranks_on_one_gpu(apart, restored={2})
    assert refusal is not None and refusal.startswith("ranks 1 and 2 of this NCCL job would be on one GPU (GPU-b)")
    three = protocol.nccl_ranks_on_one_gpu({0: "GPU-a", 1: "GPU-a", 2: "GPU-a"}, restored={0, 1, 2})
    assert three is not None and three.startswith("ranks 0, 1 and 2 of this NCCL job")
    assert protocol.nccl_ranks_on_one_gpu({0: "GPU-a", 1: None}, restored={0, 1}) is None  # a rank on no GPU
