"""Which path a move takes: the driver path when asked, without a safe point, or for memory on
another GPU (the pool's on two devices, PyTorch's own allocator's elsewhere); a job on two GPUs
resumed where each has room for its share."""

from __future__ import annotations

import pytest

torch = pytest.importorskip("torch")

from flexium import _C  # noqa: E402
from flexium.engine import EngineState  # noqa: E402
from flexium.errors import (  # noqa: E402
    CapabilityError,
    TargetRefusedError,
)
from support.engine import (  # noqa: E402,F401  (fixtures)
    H200_BYTES,
    GiB,
    MiB,
    checkpoint_ops,
    driver,
    fake,
    make_engine,
    nvml_in_parent,
)
from support.fake_driver import FakeDriver  # noqa: E402
from support.fast_path import (  # noqa: E402,F401  (fixtures)
    Job,
    failure,
    job,
    locking_threads,
    names,
)

# ----------------------------------------------------------------------------- which path


def test_the_driver_path_when_asked_or_without_a_safe_point(job: Job) -> None:
    fake = job.fake
    job.segments([2 * MiB, 4 * MiB])
    engine = job.engine()

    # No optimizer step has been seen: "auto" takes the driver path and says why.
    result = engine.migrate(engine.gpus[1])
    assert result.ok and result.path == "driver"
    assert result.notes == ("driver path: no optimizer step has run yet (training has not started)",)
    assert names(result) == ["prepare", "lock", "checkpoint", "room", "restore", "unlock"]
    assert job.fast is not None and job.fast.staged == [] and job.pool.asked == []
    job.assert_home(physical=1)  # the checkpoint carried the segments

    # "fast" refuses without a safe point, before anything is touched.
    fake.clear_log()
    error = failure(lambda: engine.migrate(engine.gpus[0], path="fast"), CapabilityError)
    assert str(error) == "the fast path cannot run: no optimizer step has run yet (training has not started)"
    assert engine.state == EngineState.RUNNING and checkpoint_ops(fake) == [] and fake.placement() == [1, 0]

    # At a safe point, "driver" still takes the driver path when asked for.
    trainer = job.train()
    fake.clear_log()
    result = engine.migrate(engine.gpus[0], path="driver")
    assert locking_threads(fake) == {trainer.tid}
    assert result.ok and result.path == "driver" and result.notes == ("driver path: asked for",)
    assert job.fast.staged == [] and fake.placement() == [0, 1]
    job.assert_home(physical=0)


def test_memory_on_two_devices_takes_the_driver_path(job: Job) -> None:
    fake = job.fake
    job.segments([2 * MiB, 2 * MiB], device=0)
    job.segments([4 * MiB], device=1)
    engine = job.engine()
    job.train()
    blocker = "the job also holds memory on cuda:1; the fast path moves one GPU's memory"
    assert engine.fast_path_blocker() == blocker

    error = failure(lambda: engine.migrate(engine.gpus[1], path="fast"), CapabilityError)
    assert str(error) == f"the fast path cannot run: {blocker}"
    assert fake.placement() == [0, 1] and engine.state == EngineState.RUNNING

    result = engine.migrate(engine.gpus[1])
    assert result.ok and result.path == "driver" and result.notes == (f"driver path: {blocker}",)
    assert job.fast is not None and job.fast.staged == []
    assert fake.placement() == [1, 0]
    assert fake.vmm_bytes_on(1) == 4 * MiB and fake.vmm_bytes_on(0) == 4 * MiB  # swapped by the checkpoint
    assert sorted(s.device for s in _C.vmm_segments()) == [0, 0, 1]
    job.assert_contents()
    assert_reachable_from_both(fake)

    paused = engine.pause()
    assert paused.ok and paused.path == "driver"
    assert fake.vmm_bytes_on(0) == fake.vmm_bytes_on(1) == 0
    assert engine.resume().ok and fake.placement() == [1, 0]
    job.assert_contents()
    assert_reachable_from_both(fake)


def test_memory_of_pytorchs_own_allocator_on_another_gpu_takes_the_driver_path(job: Job) -> None:
    """The pool is on the job's own GPU only: a model split over devices or DataParallel holds
    memory on the other GPU through PyTorch's allocator, which NVML sees and the pool does not."""
    fake = job.fake
    job.segments([2 * MiB, 2 * MiB], device=0)
    engine = job.engine()
    job.train()
    assert engine.fast_path_blocker() is None
    fake.set_process_memory(1, 512 * MiB)
    blocker = "the job also holds memory on cuda:1; the fast path moves one GPU's memory"
    assert engine.fast_path_blocker() == blocker
    result = engine.pause()
    assert result.ok and result.path == "driver" and result.notes == (f"driver path: {blocker}",)
    assert job.fast is not None and job.fast.staged == []
    assert engine.resume().ok
    job.assert_contents()


def test_a_job_on_two_gpus_resumes_where_each_gpu_has_room_for_its_share(job: Job) -> None:
    """A process on two GPUs that holds 100 GiB on each comes back to them: each GPU needs its
    own share, not the 200 GiB of both. A GPU that filled up meanwhile keeps it paused, named."""
    fake = job.fake
    job.segments([2 * MiB], device=0)
    job.segments([2 * MiB], device=1)
    engine = job.engine()
    job.train()
    share = 100 * (1 << 30)
    fake.set_process_memory(0, share)
    fake.set_process_memory(1, share)
    assert engine.pause().ok
    fake.set_other_memory(1, H200_BYTES - share)  # another job took GPU 1 meanwhile
    with pytest.raises(TargetRefusedError, match=r"^cuda:1 has .* free; the paused job held 100\.00 GiB there"):
        engine.resume()
    assert engine.state == EngineState.PAUSED
    fake.set_other_memory(1, 0)
    resumed = engine.resume()
    assert resumed.ok and resumed.path == "driver" and fake.placement() == [0, 1]
    job.assert_contents()
    assert_reachable_from_both(fake)
    fake.set_process_memory(0, 0)
    fake.set_process_memory(1, 0)


def assert_reachable_from_both(fake: FakeDriver) -> None:
    """A process using two GPUs copies between their memory (DataParallel's scatter and gather)."""
    on = {s.device: s.address for s in _C.vmm_segments()}
    for device in (0, 1):
        other = on[1 - device]  # read and written in place: the contents stay
        assert fake.copy_on(device, other, other, MiB) == 0, f"cuda:{device} cannot reach cuda:{1 - device}"
