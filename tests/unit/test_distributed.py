"""One rank of a multi-process job is never paused or migrated alone (fact `nccl-buffers-not-restorable`):
engine/distributed.py describes the job, the engine refuses before anything is touched, and the
process reports itself as not movable."""

from __future__ import annotations

import sys
from collections.abc import Callable, Iterator
from types import SimpleNamespace
from typing import Any

import pytest

from support.engine import Script, driver, fake, make_engine, script_env  # noqa: F401
from support.fake_driver import FakeDriver

TORCHRUN_ENV = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "GROUP_RANK")


@pytest.fixture(autouse=True)
def no_torchrun_env(monkeypatch: pytest.MonkeyPatch) -> None:
    for name in TORCHRUN_ENV:
        monkeypatch.delenv(name, raising=False)


def _torchrun(monkeypatch: pytest.MonkeyPatch, **values: int) -> None:
    for name, value in values.items():
        monkeypatch.setenv(name, str(value))


# --------------------------------------------------------------------------------- describe()


def test_a_plain_process_is_a_single_process_job(monkeypatch: pytest.MonkeyPatch) -> None:
    from flexium.engine.distributed import membership as distributed

    monkeypatch.setitem(sys.modules, "torch", None)  # a job that never imported torch
    job = distributed.describe()
    assert job == distributed.DistributedJob(
        available=False,
        initialized=False,
        backend=None,
        rank=None,
        world_size=None,
        local_rank=None,
        local_world_size=None,
        group_rank=None,
    )
    assert not job.multi_process and not job.multi_node and job.refusal() is None


def test_torchrun_environment_before_the_process_group_is_a_multi_process_job(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    from flexium.engine.distributed import membership as distributed

    _torchrun(monkeypatch, RANK=1, WORLD_SIZE=2, LOCAL_RANK=1, LOCAL_WORLD_SIZE=2, GROUP_RANK=0)
    job = distributed.describe()
    assert (job.initialized, job.rank, job.world_size, job.local_rank, job.local_world_size, job.group_rank) == (
        False,
        1,
        2,
        1,
        2,
        0,
    )
    assert job.multi_process and not job.multi_node
    reason = job.refusal()
    assert reason is not None
    assert reason.startswith("this process is rank 1 of 2 of a torch.distributed job (launched by torchrun")
    assert "would break the whole job" in reason and "`flexium pause PROCESS` acts on every rank" in reason


def test_a_multi_node_job_says_which_node(monkeypatch: pytest.MonkeyPatch) -> None:
    from flexium.engine.distributed import membership as distributed

    _torchrun(monkeypatch, RANK=5, WORLD_SIZE=8, LOCAL_RANK=1, LOCAL_WORLD_SIZE=4, GROUP_RANK=1)
    job = distributed.describe()
    assert job.multi_node
    assert "rank 5 of 8" in str(job.refusal()) and "node 1 of a multi-node job" in str(job.refusal())


def test_a_torchrun_job_of_one_process_is_movable(monkeypatch: pytest.MonkeyPatch) -> None:
    from flexium.engine.distributed import membership as distributed

    _torchrun(monkeypatch, RANK=0, WORLD_SIZE=1, LOCAL_RANK=0, LOCAL_WORLD_SIZE=1, GROUP_RANK=0)
    assert distributed.describe().refusal() is None


@pytest.fixture
def gloo_group_of_one(tmp_path: Any) -> Iterator[None]:
    import torch.distributed as dist

    dist.init_process_group("gloo", init_method=f"file://{tmp_path / 'rendezvous'}", rank=0, world_size=1)
    try:
        yield
    finally:
        dist.destroy_process_group()


def test_a_process_group_of_one_is_movable(
    gloo_group_of_one: None, fake: FakeDriver, make_engine: Callable[..., Any]
) -> None:
    from flexium.engine.distributed import membership as distributed

    job = distributed.describe()
    assert (job.available, job.initialized, job.backend, job.rank, job.world_size) == (True, True, "gloo", 0, 1)
    assert job.refusal() is None
    engine = make_engine()
    assert engine.pause().ok and engine.resume().ok


# --------------------------------------------------------------------------------- the engine


def test_one_rank_is_refused_before_anything_is_touched(
    fake: FakeDriver, make_engine: Callable[..., Any], monkeypatch: pytest.MonkeyPatch
) -> None:
    from flexium.errors import CapabilityError

    engine = make_engine()
    _torchrun(monkeypatch, RANK=0, WORLD_SIZE=2)
    with pytest.raises(CapabilityError, match=r"^cannot pause: this process is rank 0 of 2 "):
        engine.pause()
    with pytest.raises(CapabilityError, match=r"^cannot migrate: this process is rank 0 of 2 "):
        engine.migrate(engine.gpus[1])
    assert fake.checkpoint_calls() == [] and fake.placement() == [0, 1]
    assert engine.state.value == "RUNNING"


def test_a_job_paused_before_is_always_resumable(
    fake: FakeDriver, make_engine: Callable[..., Any], monkeypatch: pytest.MonkeyPatch
) -> None:
    engine = make_engine()
    assert engine.pause().ok
    _torchrun(monkeypatch, RANK=0, WORLD_SIZE=2)
    assert engine.resume().ok and engine.state.value == "RUNNING"


# --------------------------------------------------------------------------------- the report


def _reporter(state: Any) -> Any:
    from flexium.client.reports import ProcessReporter
    from flexium.engine.capabilities import Capabilities

    caps = Capabilities("580.159.04", 580, 13000, True, True, 2, True, True, ())
    engine = SimpleNamespace(state=state)
    pool = SimpleNamespace(active=True, reason_off=None)
    return ProcessReporter(
        SimpleNamespace(engine=engine, logical_device="cuda:0", capabilities=caps, memory_pool=pool)  # type: ignore[arg-type]
    )


def test_a_rank_before_its_process_group_reports_itself_not_movable(monkeypatch: pytest.MonkeyPatch) -> None:
    from flexium.engine.operations import EngineState

    reporter = _reporter(EngineState.RUNNING)
    alone = reporter.capabilities()
    assert alone.pause_resume and alone.migration and alone.problems == [] and alone.job_operations is None
    _torchrun(monkeypatch, RANK=1, WORLD_SIZE=2)  # read when the report is built, not at init
    rank = reporter.capabilities()
    assert not rank.pause_resume and not rank.migration and rank.job_operations is False
    assert rank.nccl is None  # not known before the process group exists
    assert rank.problems == [
        "this process is rank 1 of 2 of a torch.distributed job (launched by torchrun, process group not "
        "initialized yet), and the job cannot be paused or moved as a whole: the job has not started its "
        "process group yet (init_process_group): wait until it trains"
    ]


def test_a_paused_rank_keeps_what_lets_it_resume(monkeypatch: pytest.MonkeyPatch) -> None:
    from flexium.engine.operations import EngineState

    _torchrun(monkeypatch, RANK=1, WORLD_SIZE=2)
    paused = _reporter(EngineState.PAUSED).capabilities()
    assert paused.pause_resume and paused.migration and paused.problems == []


# --------------------------------------------------------------------------------- a real 2-rank job

RANK_SCRIPT = """
import torch
from support import fake_driver
import torch.distributed as dist
import flexium
from flexium.api import runtime
from flexium.client.reports import ProcessReporter
from flexium.errors import CapabilityError

fake = fake_driver.FakeDriver(os.environ["FLEXIUM_LIBCUDA"])
rank = int(os.environ["TEST_RANK"])
flexium.init()  # before the process group, as many scripts do
nccl_settings = {name: os.environ.get(name) for name in ("NCCL_NVLS_ENABLE", "NCCL_CUMEM_HOST_ENABLE")}
current = runtime.current()
engine = current.engine
fake.set_process_memory(0, 1 << 30)
before = ProcessReporter(current).capabilities()
dist.init_process_group("gloo", init_method=os.environ["TEST_RENDEZVOUS"], rank=rank, world_size=2)
refusals = {}
if rank == 0:
    fake.clear_log()
    for name, call in (("pause", engine.pause), ("migrate", lambda: engine.migrate(engine.gpus[1]))):
        try:
            call()
            refusals[name] = None
        except CapabilityError as exc:
            refusals[name] = str(exc)
after = ProcessReporter(current).capabilities()
total = 0.0
for step in range(20):
    value = torch.tensor([float(rank + step)])
    dist.all_reduce(value)
    total += value.item()
dist.barrier()
dist.destroy_process_group()
out(rank=rank, refusals=refusals, calls=fake.checkpoint_calls(), state=engine.state.value,
    placement=fake.placement(), total=total, before=before.model_dump(), after=after.model_dump(),
    nccl_settings=nccl_settings)
"""


def test_rank_0_of_a_gloo_job_is_refused_and_both_ranks_train_on(tmp_path: Any) -> None:
    rendezvous = f"file://{tmp_path / 'rendezvous'}"
    env = {k: v for k, v in script_env().items() if k not in ("NCCL_NVLS_ENABLE", "NCCL_CUMEM_HOST_ENABLE")}
    ranks = [
        Script(RANK_SCRIPT, {**env, "TEST_RANK": str(rank), "TEST_RENDEZVOUS": rendezvous}, torch=True)
        for rank in (0, 1)
    ]
    try:
        outs = [script.wait().result for script in ranks]
    finally:
        for script in ranks:
            script.kill()
    zero, one = outs
    for what in ("pause", "migrate"):
        assert zero["refusals"][what].startswith(
            f"cannot {what}: this process is rank 0 of 2 of a torch.distributed job (backend gloo): "
            "pausing or migrating one rank alone would break the whole job"
        )
    assert zero["calls"] == []  # not even the lock
    assert zero["state"] == "RUNNING" and zero["placement"] == [0, 1]
    assert zero["total"] == one["total"] == sum(2 * step + 1 for step in range(20))
    for rank in outs:
        assert rank["before"]["pause_resume"] and rank["before"]["migration"]
        # as a rank of a gloo job it moves with its job (test_job_operations.py)
        assert rank["before"]["job_operations"] is None and rank["after"]["job_operations"] is True
        assert rank["before"]["nccl"] is None and rank["after"]["nccl"] is False  # gloo: its ranks may share a GPU
        assert rank["after"]["pause_resume"] and rank["after"]["migration"]
        assert rank["after"]["problems"] == rank["before"]["problems"]
        # launched without torchrun's environment, as PyTorch Lightning's ranks: NCCL would start movable
        assert rank["nccl_settings"] == {"NCCL_NVLS_ENABLE": "0", "NCCL_CUMEM_HOST_ENABLE": "0"}


# Rank 0 is the user's process and starts rank 1 itself, as PyTorch Lightning's launcher does:
# the ranks have different parents, so the launch environment alone cannot name their job.
SELF_LAUNCHING_RANK = """
import json, os, subprocess, sys
import torch.distributed as dist
from flexium.engine.distributed import membership

rank = int(os.environ.get("RANK", "0"))
child = None
if rank == 0:
    child = subprocess.Popen([sys.executable, sys.argv[0]], env={**os.environ, "RANK": "1"})
before = membership.job_key()
dist.init_process_group("gloo", init_method="env://", rank=rank, world_size=2)
after = membership.job_key()
dist.barrier()
line = json.dumps({"rank": rank, "before": before, "after": after, "again": membership.job_key()})
os.write(1, (line + "\\n").encode())  # one write: the ranks share stdout
dist.destroy_process_group()
sys.exit(child.wait() if child is not None else 0)
"""


def test_ranks_launched_by_rank_0_agree_on_their_job_through_the_store(tmp_path: Any) -> None:
    import json
    import os
    import socket
    import subprocess

    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    script = tmp_path / "rank.py"
    script.write_text(SELF_LAUNCHING_RANK)
    env = {**os.environ, "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port), "WORLD_SIZE": "2"}
    env.pop("RANK", None)
    done = subprocess.run([sys.executable, str(script)], env=env, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr[-3000:]
    ranks = {entry["rank"]: entry for entry in map(json.loads, done.stdout.splitlines())}
    assert ranks[0]["before"] != ranks[1]["before"]  # different parents
    assert ranks[0]["after"] == ranks[1]["after"] == ranks[0]["again"] == ranks[1]["again"]
    assert ranks[0]["after"].startswith(f"{socket.gethostname()}:")

    second = subprocess.run([sys.executable, str(script)], env=env, capture_output=True, text=True, timeout=120)
    assert second.returncode == 0, second.stderr[-3000:]
    rerun = {entry["rank"]: entry for entry in map(json.loads, second.stdout.splitlines())}
    assert rerun[0]["after"] == rerun[1]["after"] != ranks[0]["after"]  # another run, another job


def test_the_engine_counts_cuda_graphs_while_it_runs(fake: FakeDriver, make_engine: Callable[..., Any]) -> None:
    """The refusal of a job holding CUDA graphs (test_nccl_and_agreement.py) needs every capture seen."""
    import torch

    engine = make_engine()
    assert hasattr(torch.cuda.CUDAGraph.capture_begin, "__wrapped_by_flexium__")
    engine.stop()
    assert not hasattr(torch.cuda.CUDAGraph.capture_begin, "__wrapped_by_flexium__")
