"""A fast resume's copy back made by the copier while the driver restores the job (fast/resume_overlap.py),
over the fake driver: the copier's memory mapped at the segments' addresses and made the job's own at the
next steps; a failure at each step of it, in the copier or in the job, falls back to the copy back after
the restore with a note that says why, and a restore that fails leaves the job paused and resumable with
nothing of the copier's left on the GPU."""

from __future__ import annotations

import json
import os
import signal
import sys
import threading
from pathlib import Path

import pytest

torch = pytest.importorskip("torch")

from flexium import _C  # noqa: E402
from flexium.engine import EngineState  # noqa: E402
from flexium.engine.fast import kept_staging, pinned_budget  # noqa: E402
from flexium.engine.fast.resume_overlap import Overlap  # noqa: E402
from support.engine import (  # noqa: E402,F401  (fixtures)
    MiB,
    driver,
    fake,
    make_engine,
    nvml_in_parent,
    wait_until,
)
from support.fake_driver import ProcessState  # noqa: E402
from support.fast_path import (  # noqa: E402,F401  (fixtures)
    CUDA_ERROR_INVALID_VALUE,
    CUDA_ERROR_UNKNOWN,
    FAST_PAUSE,
    FAST_RESUME,
    Job,
    copier_processes,
    failure,
    job,
    names,
    open_fds,
)

SIZES = [2 * MiB, 4 * MiB, 6 * MiB]
BESIDE = "copied back beside the restore: the copier made and filled "
AFTER = "copied back after the restore: the copier could not make the memory beside it ("
IN_THIS_PROCESS = "the copies to and from host memory ran in this process: "


def overlap_note(result: object) -> str:
    (note,) = [n for n in result.notes if n.startswith((BESIDE, AFTER))]  # type: ignore[attr-defined]
    return note


def owned_again(job: Job) -> None:
    """The copier's memory, imported, is made the job's own at the next optimizer steps. Read the driver's
    counts after it: while a segment is being made its own, its new memory and its imported memory both
    count on the GPU (``own_imported``), so a count read meanwhile finds one segment too many."""
    wait_until(lambda: _C.vmm_segments_to_own() == 0, what="the copier's memory to become the job's own")


def test_the_copier_fills_the_pool_while_the_job_restores(job: Job) -> None:
    engine = job.training(SIZES)
    assert engine.pause().ok
    (copier,) = copier_processes()

    resumed = engine.resume(target=engine.gpus[1])
    assert resumed.ok and resumed.path == "fast" and names(resumed) == FAST_RESUME
    note = overlap_note(resumed)
    assert note.startswith(BESIDE + "0.01 GiB of new memory"), note
    assert "beside the job's restore" in note and "the job waited" in note
    assert not any(n.startswith(IN_THIS_PROCESS) for n in resumed.notes), resumed.notes
    # The job made no memory for the copy back: the copier did, and the job imported it (how much
    # of it is still imported depends on the training thread's steps since: the next test stops it).
    assert job.fake.call_count("cuMemImportFromShareableHandle") == len(SIZES)
    owned_again(job)
    job.assert_home(physical=1)
    assert copier_processes() == [copier]
    # The next pause finds the pool exportable again: the copier copies it, and fills it again.
    paused = engine.pause()
    assert paused.ok and names(paused) == FAST_PAUSE
    assert not any(n.startswith(IN_THIS_PROCESS) for n in paused.notes), paused.notes
    again = engine.resume(target=engine.gpus[0])
    assert again.ok and overlap_note(again).startswith(BESIDE)
    owned_again(job)
    job.assert_home(physical=0)


def test_a_pause_before_the_copier_memory_is_owned_copies_in_this_process(job: Job) -> None:
    engine = job.training(SIZES)
    assert engine.pause().ok
    job.trainers[0].stopping.set()  # it leaves at the resume, before any optimizer step owns the memory
    resumed = engine.resume()
    assert resumed.ok and overlap_note(resumed).startswith(BESIDE)
    job.trainers[0].join(5)
    assert _C.vmm_segments_to_own() == len(SIZES)
    engine._safe_points.between_operations(None)  # the slices wait, as if the pause came first
    trainer = job.train()
    # Memory imported from the copier cannot be exported to it again: this pause copies here.
    paused = engine.pause()
    assert paused.ok and paused.path == "fast"
    assert any("from the copier process at a resume" in n for n in paused.notes), paused.notes
    assert engine.resume().ok and trainer.error is None
    owned_again(job)
    job.assert_home(physical=0)


# Where the copier's fill fails (its fake driver armed through the environment it starts with, counting
# its calls from its start: the pause's copy imports and maps each segment once before) -> the nth call.
FILL_FAILURES = {
    "cuMemCreate": 1,
    "cuMemAddressReserve": len(SIZES) + 1,
    "cuMemMap": len(SIZES) + 2,
    "cuMemSetAccess": len(SIZES) + 1,
    "cuMemcpyHtoDAsync": 1,
    "cuMemExportToShareableHandle": 2,
}


@pytest.mark.parametrize("call", FILL_FAILURES)
def test_a_fill_that_fails_in_the_copier_is_copied_back_after_the_restore(
    job: Job, monkeypatch: pytest.MonkeyPatch, call: str
) -> None:
    monkeypatch.setenv("FAKE_CUDA_FAIL", f"{call}:{CUDA_ERROR_UNKNOWN}:{FILL_FAILURES[call]}")
    engine = job.training(SIZES)
    fds = open_fds()
    assert engine.pause().ok
    (copier,) = copier_processes()

    resumed = engine.resume(target=engine.gpus[1])
    assert resumed.ok and resumed.path == "fast" and names(resumed) == FAST_RESUME
    note = overlap_note(resumed)
    assert note.startswith(AFTER) and call in note, note
    # The copier said no and stays: it copied back after the restore, as before the overlap.
    assert not any(n.startswith(IN_THIS_PROCESS) for n in resumed.notes), resumed.notes
    assert copier_processes() == [copier]
    assert _C.vmm_imported_count() == 0
    job.assert_home(physical=1)
    wait_until(lambda: open_fds() == fds, what="the staging to be kept or given back")


def test_a_wake_that_fails_in_the_copier_copies_back_after_the_restore(
    job: Job, monkeypatch: pytest.MonkeyPatch
) -> None:
    # The copier's first context is the pause's (it pins the staging); the second, the resume's, fails.
    monkeypatch.setenv("FAKE_CUDA_FAIL", f"cuDevicePrimaryCtxRetain:{CUDA_ERROR_UNKNOWN}:2")
    engine = job.training(SIZES)
    monkeypatch.delenv("FAKE_CUDA_FAIL")  # the copier has it; this process's fake reads it again at a reset
    assert engine.pause().ok
    resumed = engine.resume()
    assert resumed.ok and names(resumed) == FAST_RESUME
    note = overlap_note(resumed)
    assert note.startswith(AFTER) and "'wake'" in note and "cuDevicePrimaryCtxRetain" in note, note
    job.assert_home(physical=0)


def test_the_switch_off_makes_the_copier_refuse_and_the_copy_back_wait(
    job: Job, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("FLEXIUM_RESUME_OVERLAP", "0")  # read by the copier, started with this environment
    engine = job.training(SIZES)
    assert engine.pause().ok
    resumed = engine.resume()
    assert resumed.ok and names(resumed) == FAST_RESUME
    note = overlap_note(resumed)
    assert note.startswith(AFTER) and "FLEXIUM_RESUME_OVERLAP=0" in note, note
    job.assert_home(physical=0)


@pytest.mark.parametrize("call", ["cuMemImportFromShareableHandle", "cuMemMap", "cuMemSetAccess"])
@pytest.mark.parametrize("nth", [1, 2])
def test_a_failure_mapping_the_copier_memory_copies_the_rest_back(job: Job, call: str, nth: int) -> None:
    engine = job.training(SIZES)
    fds = open_fds()
    assert engine.pause().ok
    job.fake.fail(call, CUDA_ERROR_UNKNOWN, nth)  # in this process: its nth call of it is the fill's

    resumed = engine.resume(target=engine.gpus[1])
    assert resumed.ok and names(resumed) == FAST_RESUME
    note = overlap_note(resumed)
    assert note.startswith(AFTER + "mapping the copier's memory failed: DriverError") and call in note, note
    # The segments mapped before the failure stay (the training thread's steps may have owned them
    # already); the rest came back from the staging.
    assert _C.vmm_imported_count() <= nth - 1
    assert job.fake.pending_failures() == 0
    owned_again(job)
    job.assert_home(physical=1)
    wait_until(lambda: open_fds() == fds, what="every fd of the copier's memory to be closed")


def test_a_copier_killed_during_the_fill_loses_nothing(job: Job) -> None:
    engine = job.training(SIZES)
    assert engine.pause().ok
    (copier,) = copier_processes()
    # Stopped, it takes the wake and the fill into its socket and serves neither; killed while the job restores.
    os.kill(copier, signal.SIGSTOP)
    job.fake.set_delay_ms("cuCheckpointProcessRestore", 300)
    threading.Timer(0.1, lambda: os.kill(copier, signal.SIGKILL)).start()

    resumed = engine.resume()
    assert resumed.ok and names(resumed) == FAST_RESUME
    assert overlap_note(resumed).startswith(AFTER)
    assert any(n.startswith(IN_THIS_PROCESS) for n in resumed.notes), resumed.notes
    job.assert_home(physical=0)
    assert engine.pause().ok and engine.resume().ok  # a new copier serves the next pause
    owned_again(job)
    job.assert_home(physical=0)


def test_a_restore_that_fails_leaves_the_job_paused_and_nothing_of_the_fill(job: Job) -> None:
    engine = job.training(SIZES)
    assert engine.pause().ok
    fds = open_fds()
    (copier,) = copier_processes()
    job.fake.fail("cuCheckpointProcessRestore", CUDA_ERROR_INVALID_VALUE)

    resumed = failure(lambda: engine.resume(target=engine.gpus[1])).result
    assert not resumed.ok and resumed.failed_step == "restore"
    assert engine.state == EngineState.PAUSED and job.fake.state() == ProcessState.CHECKPOINTED
    assert _C.host_staged_segments() == len(SIZES)
    # The fill's fds were received and closed, and the copier let go of the GPU: nothing is left there.
    assert open_fds() == fds
    assert copier_processes() == [copier]
    assert job.fast is not None and job.fast._copier is not None and job.fast._copier.awake_on is None
    assert job.fake.vmm_bytes_on(0) == job.fake.vmm_bytes_on(1) == 0

    again = engine.resume(target=engine.gpus[1])
    assert again.ok and overlap_note(again).startswith(BESIDE)
    owned_again(job)
    job.assert_home(physical=1)


def test_bytes_the_fill_got_wrong_are_copied_back_again(job: Job, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("FAKE_CUDA_CORRUPT", "cuMemcpyHtoDAsync:2")  # the copier's second copy of the fill
    engine = job.training(SIZES)
    assert engine.pause().ok
    resumed = engine.resume()
    assert resumed.ok, resumed.error
    assert names(resumed) == ["restore", "unlock", "copy_back", "verify", "release", "copy_back", "verify"]
    assert overlap_note(resumed).startswith(BESIDE)
    owned_again(job)
    job.assert_home(physical=0)


def test_a_fill_mapped_in_part_then_short_of_room_leaves_the_job_paused_and_resumable(job: Job) -> None:
    """The job maps the copier's memory for one segment, fails on the next, and the copy back of the rest
    finds no room: what came back goes back to the staging (imported memory could not ride the
    checkpoint), and the job, paused again, resumes whole."""
    engine = job.training(SIZES)
    assert engine.pause().ok
    job.fake.fail("cuMemMap", CUDA_ERROR_UNKNOWN, 2)  # the job maps the copier's first segment, not the second
    job.fake.fail("cuMemCreate", "CUDA_ERROR_OUT_OF_MEMORY", 0)  # and the copy back of the rest finds no room
    resumed = failure(lambda: engine.resume(target=engine.gpus[1])).result
    assert not resumed.ok and "another process took memory on" in str(resumed.error), resumed.error
    assert engine.state == EngineState.PAUSED and job.fake.state() == ProcessState.CHECKPOINTED
    assert _C.vmm_imported_count() == 0 and _C.host_staged_segments() == len(SIZES)
    job.fake.clear_failures()
    again = engine.resume()
    assert again.ok, again.error
    owned_again(job)
    job.assert_home(physical=1)


def test_a_job_paused_again_leaves_no_copier_awake_on_its_gpu(job: Job, monkeypatch: pytest.MonkeyPatch) -> None:
    """Bytes that do not check out twice pause the job again: a copier that stayed awake to keep the staging
    (the budget keeps it) is put to sleep, as after any pause."""
    monkeypatch.setenv(pinned_budget.ENV, "1GiB")
    monkeypatch.setattr(kept_staging, "CHECK_S", 3600)  # no keeper look: the resume alone keeps the staging
    # The copier's second copy to the GPU (the fill's) and its fifth (the copy back after the first mismatch).
    monkeypatch.setenv("FAKE_CUDA_CORRUPT", "cuMemcpyHtoDAsync:2,cuMemcpyHtoDAsync:5")
    engine = job.training(SIZES)
    assert engine.pause().ok
    resumed = failure(lambda: engine.resume()).result
    assert not resumed.ok and resumed.failed_step == "verify", resumed.error
    assert engine.state == EngineState.PAUSED and job.fake.state() == ProcessState.CHECKPOINTED
    copier = job.fast._copier if job.fast is not None else None
    assert copier is None or copier.awake_on is None
    assert _C.gpu_memory_yielder() == 0  # nothing of the paused job's on any GPU
    monkeypatch.delenv("FAKE_CUDA_CORRUPT")
    assert engine.resume().ok
    owned_again(job)
    job.assert_home(physical=0)


def test_a_copier_whose_sleep_after_a_fill_fails_is_stopped(job: Job, monkeypatch: pytest.MonkeyPatch) -> None:
    """After a restore that failed, the copier's sleep after its fill is read: one that failed (its context
    still on the GPU) gets the copier stopped, so that the paused job holds nothing on any GPU."""
    # The copier's first cuStreamDestroy is its sleep after the pause's copy, the second its sleep after the fill,
    # where its staging is touched: writing it, its threads (one a file, as many as the cores) destroy streams too.
    monkeypatch.setenv("FLEXIUM_WRITTEN_STAGING", "0")
    monkeypatch.setenv("FAKE_CUDA_FAIL", f"cuStreamDestroy:{CUDA_ERROR_UNKNOWN}:2")
    engine = job.training(SIZES)
    monkeypatch.delenv("FAKE_CUDA_FAIL")
    assert engine.pause().ok
    (first,) = copier_processes()
    job.fake.fail("cuCheckpointProcessRestore", CUDA_ERROR_INVALID_VALUE)
    resumed = failure(lambda: engine.resume(target=engine.gpus[1])).result
    assert not resumed.ok and engine.state == EngineState.PAUSED
    assert first not in copier_processes()  # stopped: its context went with it
    job.fake.clear_failures()
    assert engine.resume(target=engine.gpus[1]).ok
    owned_again(job)
    job.assert_home(physical=1)


def test_a_segment_freed_while_the_job_was_paused_is_not_checked_at_its_resume(job: Job) -> None:
    """Its free waited for the restore and came while the copy back ran: the rest checks out and the job
    goes on."""
    engine = job.training(SIZES)
    assert engine.pause().ok
    victim = min(job.contents)
    job.fake.set_delay_ms("cuMemImportFromShareableHandle", 300)  # the free (after the unlock) lands first
    said: list[str] = []

    def free() -> None:
        job._free(victim, 0, 0, None)
        said.append(_C.vmm_last_error())  # this thread's: "" unless its free failed

    freer = threading.Thread(target=free)
    freer.start()
    resumed = engine.resume()
    freer.join(10)
    assert said == [""], f"the free failed or did not return within 10 s of the resume: {said}"
    del job.contents[victim]
    assert resumed.ok, resumed.error
    owned_again(job)
    job.assert_home(physical=0)


# In a fresh process (the kernel is loaded once per context, and this one's may have it already): the
# pause's preparation, made while the job trains, loads it; the checksum at the safe point then loads nothing.
KERNEL_AHEAD = """
import ctypes, json, os
os.environ["FLEXIUM_HOST_COPIER"] = "0"
from flexium import _C
from flexium.engine.fast.path import FastPath

fake = ctypes.CDLL(os.environ["FLEXIUM_LIBCUDA"])
loads = lambda: fake.fake_call_count(b"cuModuleLoadData")
alloc = ctypes.CDLL(_C.__file__).flexium_vmm_alloc
alloc.restype, alloc.argtypes = ctypes.c_void_p, [ctypes.c_size_t, ctypes.c_int, ctypes.c_void_p]
assert alloc(2 << 20, 0, None)

class Pool:
    active = True
    def live_ranges(self, device):
        return {}

fast = FastPath(Pool())
before = loads()
fast.reserve_host(0, 4 << 20, _C.list_devices()[0].uuid)
ahead = loads()
_C.segment_checksums(0, {})
print(json.dumps({"before": before, "ahead": ahead, "at_the_safe_point": loads() - ahead}))
"""


def test_the_checksum_kernel_is_loaded_while_the_job_trains(fake: object) -> None:
    run = fake.run_python(KERNEL_AHEAD)  # type: ignore[attr-defined]
    assert run.returncode == 0, run.stderr
    counts = json.loads(run.stdout.strip().splitlines()[-1])
    assert counts == {"before": 0, "ahead": 1, "at_the_safe_point": 0}


def test_the_benchmark_reads_the_overlap_from_the_note() -> None:
    sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "bench"))
    import migrate

    beside = Overlap(16 << 30, fill_s=0.58, pin_s=0.2, beside_s=0.42, restore_s=0.45, waited_s=0.13, map_s=0.01)
    assert migrate.beside_restore({"notes": [beside.note()]}) == "0.58/0.42"
    apart = Overlap(16 << 30, fill_s=0.58, pin_s=0.2, beside_s=0.0, restore_s=0.45, waited_s=0.6, map_s=0.01)
    assert not apart.overlapped and migrate.beside_restore({"notes": [apart.note()]}) == "0"
    assert migrate.beside_restore({"notes": [AFTER + "the copier failed at 'fill': ...)"]}) == "after"
