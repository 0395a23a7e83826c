"""What makes a rank's NCCL suspendable (engine/distributed/nccl.py), and how the ranks agree on
the step they stop at (job_operation.StepAgreement), without GPUs."""

from __future__ import annotations

import os

import pytest

from flexium.engine.distributed import nccl
from flexium.engine.distributed.job_operation import STOP_MARGIN_STEPS, StepAgreement
from flexium.engine.distributed.rendezvous import JobAborted, Rendezvous
from support.engine import DictStore


@pytest.fixture(autouse=True)
def fresh_library(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(nccl, "_library", None)
    monkeypatch.setenv(nccl.NVLS_ENV, "0")
    monkeypatch.setenv(nccl.CUMEM_HOST_ENV, "0")
    monkeypatch.delenv(nccl.REGISTER_HOOK_ENV, raising=False)


def _library(version: int, can_suspend: bool) -> nccl.NcclLibrary:
    return nccl.NcclLibrary(path="/opt/nccl/libnccl.so.2", version=version, can_suspend=can_suspend, handle=None)


def test_version_codes_read_as_nccl_prints_them() -> None:
    assert nccl.version_text(22809) == "2.28.9" and nccl.version_text(23007) == "2.30.7"


def test_an_nccl_without_suspend_is_refused_by_version_and_path(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(nccl, "loaded_library", lambda: _library(22809, False))
    problem = nccl.suspend_problem()
    assert problem is not None
    assert problem.startswith("this job's NCCL is 2.28.9 (/opt/nccl/libnccl.so.2), which cannot suspend")
    assert "NCCL 2.29.7 or newer" in problem and "torch 2.12 or newer" in problem


def test_nvls_left_on_and_buffer_registration_are_refused(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(nccl, "loaded_library", lambda: _library(23007, True))
    assert nccl.suspend_problem() is None
    monkeypatch.setenv(nccl.NVLS_ENV, "1")
    assert "NCCL_NVLS_ENABLE is not 0" in str(nccl.suspend_problem())
    monkeypatch.delenv(nccl.NVLS_ENV)
    assert "NCCL_NVLS_ENABLE is not 0" in str(nccl.suspend_problem())  # unset: NCCL's default uses NVLS
    monkeypatch.setenv(nccl.NVLS_ENV, "0")
    monkeypatch.setenv(nccl.REGISTER_HOOK_ENV, "1")
    assert "user-buffer registrations" in str(nccl.suspend_problem())


def test_nccl_host_memory_the_driver_cannot_restore_is_refused(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(nccl, "loaded_library", lambda: _library(23007, True))
    for unsafe in ("1", None):  # unset: NCCL's default on driver 580 is on
        if unsafe is None:
            monkeypatch.delenv(nccl.CUMEM_HOST_ENV)
        else:
            monkeypatch.setenv(nccl.CUMEM_HOST_ENV, unsafe)
        problem = str(nccl.suspend_problem())
        assert problem.startswith("NCCL_CUMEM_HOST_ENABLE is not 0 in this job: NCCL would make the host memory")
        assert "start the job with NCCL_CUMEM_HOST_ENABLE=0" in problem
    monkeypatch.setenv(nccl.CUMEM_HOST_ENV, "0")
    assert nccl.suspend_problem() is None


class StandInGraph:
    """What flexium wraps of torch.cuda.CUDAGraph, which CPU torch cannot make."""

    def capture_begin(self, pool: object = None) -> None:
        pass


def test_a_cuda_graph_captured_while_nccl_was_live_refuses_whole_job_operations(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    import gc

    from flexium.engine.distributed import cuda_graphs, job_operation, membership

    monkeypatch.setattr(nccl, "loaded_library", lambda: _library(23007, True))
    monkeypatch.setattr(cuda_graphs, "_alive", type(cuda_graphs._alive)())
    job = membership.DistributedJob(True, True, "nccl", 0, 2, 0, 2, 0)
    nccl_live = [False]
    cuda_graphs.install(StandInGraph, nccl_live=lambda: nccl_live[0])
    try:
        cuda_graphs.install(StandInGraph)  # once: the wrapper is not wrapped again
        before = StandInGraph()
        before.capture_begin()  # before the process group: no communicator to call
        assert job_operation.job_problem(job) is None
        nccl_live[0] = True
        graphs = [StandInGraph(), StandInGraph()]
        for index in range(2):
            graphs[index].capture_begin(pool=None)
        problem = job_operation.job_problem(job)
        assert problem is not None and problem.startswith(
            "this rank holds 2 CUDA graphs captured while its NCCL process group existed: a graph holding NCCL "
            "calls would replay into NCCL buffers that a pause gives back"
        )
        assert "torch._dynamo.reset()" in problem
        assert job_operation.job_problem(membership.DistributedJob(True, True, "gloo", 0, 2, 0, 2, 0)) is None
        del graphs[0]
        gc.collect()
        assert str(job_operation.job_problem(job)).startswith("this rank holds a CUDA graph captured")
        graphs.clear()
        gc.collect()
        assert job_operation.job_problem(job) is None  # the graphs are gone: the job moves again
    finally:
        cuda_graphs.uninstall(StandInGraph)
    assert StandInGraph.capture_begin is not None and not hasattr(StandInGraph.capture_begin, "__wrapped_by_flexium__")


def test_the_environment_is_prepared_only_where_the_user_said_nothing(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv(nccl.NVLS_ENV)
    monkeypatch.delenv(nccl.CUMEM_HOST_ENV)
    assert nccl.prepare_environment() == ["NCCL_NVLS_ENABLE=0", "NCCL_CUMEM_HOST_ENABLE=0"]
    assert os.environ[nccl.NVLS_ENV] == "0" and os.environ[nccl.CUMEM_HOST_ENV] == "0"
    monkeypatch.setenv(nccl.NVLS_ENV, "1")
    monkeypatch.setenv(nccl.CUMEM_HOST_ENV, "1")
    assert nccl.prepare_environment() == [] and os.environ[nccl.NVLS_ENV] == "1"
    assert os.environ[nccl.CUMEM_HOST_ENV] == "1"


def test_a_process_without_nccl_finds_no_library() -> None:
    assert nccl._global_symbol_path("ncclGetVersion") is None  # CPU torch: no libnccl at all
    assert nccl._global_symbol_path("malloc") is not None  # dladdr finds what the global scope defines


def test_ranks_stop_at_the_same_step_after_the_last_one_joined() -> None:
    store = DictStore()
    zero = StepAgreement(Rendezvous(store, 1, rank=0, world_size=2), deadline_s=60)
    one = StepAgreement(Rendezvous(store, 1, rank=1, world_size=2), deadline_s=60)
    assert not zero.ready(10)  # joined at step 10; rank 1 has not
    assert not zero.ready(11)
    assert not one.ready(11)  # joined at 11: both have, stop at 11 + margin
    assert zero.stop_at is None and one.stop_at == 11 + STOP_MARGIN_STEPS
    assert not zero.ready(12) and zero.stop_at == one.stop_at
    stop = one.stop_at
    assert zero.ready(stop) and one.ready(stop)


def test_a_rank_already_past_the_stop_step_gives_up_for_all() -> None:
    store = DictStore()
    zero = StepAgreement(Rendezvous(store, 2, rank=0, world_size=2), deadline_s=60)
    one = StepAgreement(Rendezvous(store, 2, rank=1, world_size=2), deadline_s=60)
    assert not zero.ready(10)
    assert not one.ready(10)
    with pytest.raises(JobAborted, match="past the agreed step"):
        zero.ready(10 + STOP_MARGIN_STEPS + 1)
    with pytest.raises(JobAborted, match="past the agreed step"):
        one.ready(11)  # the other rank's abort reaches it at its next step
