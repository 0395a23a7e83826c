"""A pause kept ready between pauses (flexium.engine.fast.kept_staging, pinned_budget, and the allocator
giving way: csrc/gpu_memory_yield.cpp), over the fake driver with the real copier process.

The budget is this machine's for all flexium jobs: a ledger of one file per process (here in a
test folder). Within it the staging stays after a resume, pinned by the copier, and the keeper
prepares it before the first pause; outside it a pause prepares its own and gives it back. The job's
memory comes first: an allocation short of GPU memory kills the copier, and the keeper stops
pinning ahead on that GPU."""

from __future__ import annotations

import ctypes
import json
import os
import re
import signal
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from typing import Any

import pytest

torch = pytest.importorskip("torch")

from flexium import _C  # noqa: E402
from flexium.engine import EngineState, host_memory  # noqa: E402
from flexium.engine.fast import kept_staging, path, pinned_budget  # noqa: E402
from flexium.engine.fast.host_copier import Copier  # noqa: E402
from flexium.engine.fast.host_staging import DRIVER_MEMORY_ENV  # noqa: E402
from flexium.errors import ConfigError  # noqa: E402
from support.engine import H200_BYTES, MiB, driver, fake, make_engine, nvml_in_parent, wait_until  # noqa: E402,F401
from support.fake_driver import FakeDriver  # noqa: E402
from support.fast_path import Job, copier_processes, job, zombie  # noqa: E402,F401  (fixture)

GiB = 1 << 30


@pytest.fixture(autouse=True)
def no_yielder_left() -> Iterator[None]:
    yield
    _C.set_gpu_memory_yielder(0)


@pytest.fixture
def budget(monkeypatch: pytest.MonkeyPatch) -> Callable[[str], None]:
    def set_to(setting: str) -> None:
        monkeypatch.setenv(pinned_budget.ENV, setting)

    monkeypatch.setattr(kept_staging, "CHECK_S", 0.05)
    return set_to


def ledger() -> dict[int, dict[str, Any]]:
    return {int(p.name): json.loads(p.read_text()) for p in pinned_budget.LEDGER_DIR.glob("[0-9]*")}


def a_live_process() -> subprocess.Popen[bytes]:
    return subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])


# ----------------------------------------------------------------------------- the budget


def test_the_budget_reads_shares_sizes_and_zero(monkeypatch: pytest.MonkeyPatch) -> None:
    total = host_memory.host_memory_total()
    assert total is not None
    assert pinned_budget.parse("25%", where="test") == total // 4
    assert pinned_budget.parse("32GiB", where="test") == 32 * GiB
    assert pinned_budget.parse("512 MiB", where="test") == 512 * MiB
    assert pinned_budget.parse("2GB", where="test") == 2 * 10**9
    assert pinned_budget.parse("0", where="test") == pinned_budget.parse("off", where="test") == 0
    monkeypatch.delenv(pinned_budget.ENV)
    assert pinned_budget.budget().setting == "25%" and pinned_budget.budget().source == "the default"
    monkeypatch.setenv(pinned_budget.ENV, "8GiB")
    assert pinned_budget.budget().bytes == 8 * GiB and pinned_budget.budget().source == "from the environment"


@pytest.mark.parametrize("setting", ["lots", "12 parsecs", "-1GiB", "150%"])
def test_a_setting_that_is_not_an_amount_says_what_to_give(setting: str) -> None:
    with pytest.raises(ConfigError) as caught:
        pinned_budget.parse(setting, where="from the environment")
    message = str(caught.value)
    assert f"FLEXIUM_PINNED_HOST_MEMORY={setting!r} (from the environment)" in message
    assert "100%" in message or ("25%" in message and "32GiB" in message and "0 to keep nothing" in message)


def test_claims_share_the_budget_and_a_finished_process_no_longer_counts(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(pinned_budget.ENV, "10GiB")
    other = a_live_process()
    try:
        pinned_budget.LEDGER_DIR.mkdir(mode=0o1777)
        start = pinned_budget._start_time(other.pid)
        (pinned_budget.LEDGER_DIR / str(other.pid)).write_text(json.dumps({"bytes": 6 * GiB, "start": start}))
        assert pinned_budget.claim(3 * GiB, "GPU-a") is None
        assert ledger()[os.getpid()]["bytes"] == 3 * GiB
        assert pinned_budget.claim(5 * GiB, "GPU-a") == (
            "its 5.0 GiB do not fit in the 4.0 GiB left of flexium's pinned host memory budget of 10.0 GiB "
            f"(FLEXIUM_PINNED_HOST_MEMORY=10GiB, from the environment); processes {other.pid} keep 6.0 GiB"
        )
        assert ledger()[os.getpid()]["bytes"] == 3 * GiB  # a refused claim changes nothing
        assert "exceed flexium's pinned host memory budget of 10.0 GiB" in str(pinned_budget.claim(11 * GiB, "GPU-a"))
        assert {h.pid for h in pinned_budget.holders()} == {other.pid, os.getpid()}
    finally:
        other.kill()
        other.wait()
    assert pinned_budget.claim(7 * GiB, "GPU-a") is None  # the other process is gone: its entry does not count
    assert [h.pid for h in pinned_budget.holders()] == [os.getpid()]
    pinned_budget.release()
    assert pinned_budget.holders() == []


def test_a_claim_up_to_takes_what_is_left_in_whole_steps_or_nothing(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(pinned_budget.ENV, "10GiB")
    other = a_live_process()
    try:
        pinned_budget.LEDGER_DIR.mkdir(mode=0o1777)
        start = pinned_budget._start_time(other.pid)
        (pinned_budget.LEDGER_DIR / str(other.pid)).write_text(json.dumps({"bytes": 6 * GiB, "start": start}))
        assert pinned_budget.claim_up_to(2 * GiB, "GPU-a", at_least=GiB) == (2 * GiB, "")
        assert ledger()[os.getpid()]["bytes"] == 2 * GiB
        share, why = pinned_budget.claim_up_to(8 * GiB, "GPU-a", at_least=2 * GiB, step=3 * GiB)
        assert share == 3 * GiB and ledger()[os.getpid()]["bytes"] == 3 * GiB  # 4 GiB left: one whole step
        assert why.startswith("its 8.0 GiB do not fit in the 4.0 GiB left of flexium's pinned host memory budget")
        assert pinned_budget.claim_up_to(8 * GiB, "GPU-a", at_least=5 * GiB)[0] == 0
        assert ledger()[os.getpid()]["bytes"] == 3 * GiB  # a share refused changes nothing
        share, why = pinned_budget.claim_up_to(12 * GiB, "GPU-a", at_least=GiB)
        assert share == 4 * GiB and "exceed flexium's pinned host memory budget of 10.0 GiB" in why
    finally:
        other.kill()
        other.wait()
        pinned_budget.release()


# ----------------------------------------------------------------------------- the engine


def pinned_ahead(job: Job, engine: Any) -> None:
    """Waits until the copier has pinned all of the kept staging in the background."""
    fast, uuid = job.fast, engine.gpus[0].uuid

    def complete() -> bool:
        ahead = fast.kept_pinning(uuid) if fast is not None else None
        return ahead is not None and ahead.complete

    wait_until(complete, what="the kept staging to be pinned ahead")


def pauses_on_the_kept_staging(job: Job, engine: Any) -> None:
    """Once the keeper has pinned it all, the next pause finds its staging kept (nothing newly
    touched or pinned), and the job comes back home whole."""
    pinned_ahead(job, engine)
    paused = engine.pause()
    assert paused.ok and "(0.00 GiB of it newly mapped and touched, 0.00 GiB newly pinned; " in paused.notes[0]
    assert engine.resume().ok
    job.assert_home(physical=0)


def given_back(keeper: Any, said: Callable[[str], bool]) -> None:
    """Waits until the keeper has given its staging back and said so (in that order: the note
    comes after)."""
    wait_until(
        lambda: _C.host_staging_pool_bytes() == 0 and said(keeper.note or ""), what="the kept staging to be given back"
    )


def test_a_resumed_job_keeps_its_staging_pinned_for_the_next_pause(
    job: Job, budget: Callable[[str], None], monkeypatch: pytest.MonkeyPatch
) -> None:
    """Memfds (driver-made host memory off): the staging the pause made stays, pinned by the copier."""
    budget("1GiB")
    monkeypatch.setenv(DRIVER_MEMORY_ENV, "0")
    engine = job.training([2 * MiB, 4 * MiB, 6 * MiB])
    gpu0 = engine.gpus[0].uuid
    assert engine.pause().ok
    resumed = engine.resume()
    assert resumed.ok and resumed.path == "fast"
    job.assert_home(physical=0)
    assert job.fast is not None and job.fast.keeping
    assert _C.host_staging_pool_bytes() == 14 * MiB  # kept, not given back
    assert ledger()[os.getpid()]["bytes"] == 14 * MiB
    (copier,) = copier_processes()
    assert job.fast._copier is not None and job.fast._copier.awake_on == gpu0  # stayed awake, pinned
    assert _C.gpu_memory_yielder() == copier

    pinned_ahead(job, engine)  # the copier pins what the copy back did not use in the background
    again = engine.pause()
    assert again.ok and again.path == "fast"
    assert again.notes[0].startswith("pinned 0.01 GiB of host staging by the copier process")
    assert re.search(
        r"\(0\.00 GiB of it newly mapped and touched, 0\.00 GiB newly pinned; "
        r"files \d+\.\d\d s, attach \d+\.\d\d s, touching and pinning \d+\.\d\d s; its pinning ahead: pinned "
        r"\d+ chunks \(\d+\.\d\d GiB\) in \d+\.\d\d s \(the slowest \d+ ms\), all pinned\)$",
        again.notes[0],
    ), again.notes[0]
    assert _C.gpu_memory_yielder() == 0  # asleep while the job is paused: nothing of it on any GPU
    assert engine.resume().ok
    job.assert_home(physical=0)
    engine.stop()
    assert os.getpid() not in ledger()


def test_memfds_a_pause_made_at_its_safe_point_are_made_anew_as_driver_memory_after_its_resume(
    job: Job, budget: Callable[[str], None], monkeypatch: pytest.MonkeyPatch
) -> None:
    """A pause that came before the keeper made anything made memfds at its safe point; kept, every later
    resume would pin them again: they go after the resume, and the keeper makes the staging anew as host
    memory the driver makes, which the next resume maps."""
    budget("1GiB")
    monkeypatch.setattr(kept_staging, "CHECK_S", 3600)  # no keeper look before the first pause
    engine = job.training([2 * MiB, 4 * MiB, 6 * MiB])
    assert engine.pause().ok
    assert not any(_C.host_staging_layout().driver_made)  # made at the safe point
    assert engine.resume().ok
    assert job.fast is not None
    job.fast._wait_for_release()
    assert _C.host_staging_pool_bytes() == 0 and claimed() == 0
    note = job.fast.keep_ready(0, engine.gpus[0].uuid)  # the keeper's next look
    assert note is not None and note.startswith("pins "), note
    layout = _C.host_staging_layout()
    assert layout.driver_made and all(layout.driver_made) and claimed() == _C.host_staging_pool_bytes()
    pinned_ahead(job, engine)
    assert engine.pause().ok and engine.resume().ok
    job.assert_home(physical=0)


def test_a_pool_that_grew_after_a_kept_resume_pins_only_what_is_new(
    job: Job, budget: Callable[[str], None], monkeypatch: pytest.MonkeyPatch
) -> None:
    """The staging grows by extents added after those the copier maps: the copier maps the new
    ones and keeps the old ones pinned (pinning them all again took 9.6 s for 68 GiB on an H200). The
    pause streams what is new at its safe point, or finds it pinned already by the keeper, which
    pinned the new part alone. Memfds (driver-made host memory off), which a resume keeps."""
    budget("1GiB")
    monkeypatch.setenv(DRIVER_MEMORY_ENV, "0")
    engine = job.training([64 * MiB, 64 * MiB])
    assert engine.pause().ok and engine.resume().ok
    assert job.fast is not None and job.fast.keeping
    wait_until(lambda: _C.host_staging_pool_bytes() == 144 * MiB, what="the staging kept after the resume")
    (copier,) = copier_processes()
    job.segments([16 * MiB])
    again = engine.pause()
    assert again.ok and again.path == "fast"
    if again.notes[0].startswith("pinned "):
        # The keeper grew the kept staging and pinned it all before the pause came: it pinned the new part alone.
        assert "before the safe point" in again.notes[0], again.notes
        # What the copier's pinning ahead pinned, as the pause found it (the keeper says it only at its next look).
        ahead = re.search(r"its pinning ahead: pinned \d+ chunks \((\d+\.\d+) GiB\)", again.notes[0])
        assert ahead is not None and float(ahead.group(1)) <= 0.02, again.notes  # 16 MiB, not 144 MiB
    else:
        # Short of the grown pool, or grown by the keeper since and still being pinned ahead: streamed either way.
        assert again.notes[0].startswith("the staging kept for pauses "), again.notes
        found = re.search(r"(\d+\.\d+) GiB found pinned", again.notes[1])
        streamed = re.search(r"then pinned (\d+\.\d+) GiB in \d+\.\d\d s as the copies reached it", again.notes[1])
        assert found is not None and float(found.group(1)) >= 0.14, again.notes[1]  # the old part stayed pinned
        assert streamed is not None and float(streamed.group(1)) <= 0.02, again.notes[1]  # 16 MiB, not 144 MiB
    assert copier_processes() == [copier]
    assert engine.resume().ok
    job.assert_home(physical=0)


def test_the_keeper_prepares_the_first_pause_ahead(job: Job, budget: Callable[[str], None]) -> None:
    budget("1GiB")
    engine = job.training([2 * MiB, 4 * MiB, 6 * MiB])
    keeper = engine._keeper
    assert keeper is not None
    wait_until(lambda: (keeper.note or "").startswith("keeps "), what="the keeper to say it has pinned it all")
    assert keeper.note is not None and re.fullmatch(
        r"keeps 0\.01 GiB of host staging pinned by the copier process for a pause \(its pinning ahead: pinned "
        r"\d+ chunks \(0\.01 GiB\) in \d+\.\d\d s \(the slowest \d+ ms\), all pinned\)",
        keeper.note,
    ), keeper.note
    assert job.fast is not None and job.fast.keeping
    assert _C.host_staging_pool_bytes() == 14 * MiB and ledger()[os.getpid()]["gpu"] == engine.gpus[0].uuid
    pauses_on_the_kept_staging(job, engine)


def test_a_staging_larger_than_the_budget_keeps_the_part_it_has_room_for(
    job: Job, budget: Callable[[str], None]
) -> None:
    """A pause copies the part kept (host memory the driver made, pinned ahead) at once and streams the
    rest at its safe point; after the resume what it streamed goes back, and the part stays, claimed, for
    the keeper to keep ready again without making it anew."""
    budget("8MiB")  # of the 14 MiB a pause needs: more than a quarter
    engine = job.training([2 * MiB, 4 * MiB, 6 * MiB])
    keeper = engine._keeper
    assert keeper is not None
    wait_until(lambda: (keeper.note or "").startswith("keeps "), what="the keeper to keep part of the staging")
    assert keeper.note is not None and keeper.note.endswith(
        "; only part of what a pause needs, as its 14 MiB exceed flexium's pinned host memory budget of 8 MiB "
        "(FLEXIUM_PINNED_HOST_MEMORY=8MiB, from the environment)"
    ), keeper.note
    assert job.fast is not None and job.fast.keeping and job.fast.kept_in_part
    assert _C.host_staging_pool_bytes() == 8 * MiB and ledger()[os.getpid()]["bytes"] == 8 * MiB
    part = _C.host_staging_layout()
    assert all(part.driver_made)
    pinned_ahead(job, engine)
    paused = engine.pause()
    assert paused.ok and paused.path == "fast", paused.error
    assert paused.notes[0] == (
        "the staging kept for pauses holds 8 MiB, pinned, of the 14 MiB the pool needs (only that part is kept, as "
        "its 14 MiB exceed flexium's pinned host memory budget of 8 MiB (FLEXIUM_PINNED_HOST_MEMORY=8MiB, from the "
        "environment)): it is copied at once, and the rest mapped and written as the copies reach it, at the safe point"
    ), paused.notes
    assert "0.01 GiB found pinned (its pinning ahead: " in paused.notes[1], paused.notes[1]
    assert ", 0.01 GiB streamed; " in paused.notes[1], paused.notes[1]
    made = _C.host_staging_layout().driver_made
    assert made[0] and not made[-1], made  # the kept part driver-made, the rest memfds made at the safe point
    assert job.fake.pinned_at_last_checkpoint() == 0 and job.fake.vmm_mappings() == 0
    assert _C.gpu_memory_yielder() == 0  # the copier asleep: nothing of the paused job on any GPU
    resumed = engine.resume()
    assert resumed.ok and resumed.path == "fast", resumed.error
    job.assert_home(physical=0)
    wait_until(
        lambda: job.fast is not None and job.fast.keeping and _C.host_staging_pool_bytes() == 8 * MiB,
        what="the keeper to keep the part again",
    )
    assert _C.host_staging_layout().extents == part.extents  # the same memory, its fds kept through the resume
    assert ledger()[os.getpid()]["bytes"] == 8 * MiB
    pinned_ahead(job, engine)
    assert engine.pause().ok and engine.resume().ok
    job.assert_home(physical=0)


@pytest.fixture
def part_kept(
    job: Job, budget: Callable[[str], None], monkeypatch: pytest.MonkeyPatch
) -> Callable[[], tuple[Any, Any]]:
    """A job whose keeper keeps 8 of the 14 MiB a pause needs, then stops looking (the tests call keep_ready
    themselves); the engine, and the staging's layout as kept."""

    def start() -> tuple[Any, Any]:
        budget("8MiB")
        engine = job.training([2 * MiB, 4 * MiB, 6 * MiB])
        keeper = engine._keeper
        assert keeper is not None
        wait_until(lambda: (keeper.note or "").startswith("keeps "), what="the keeper to keep part of the staging")
        keeper.stop()
        return engine, _C.host_staging_layout()

    return start


def claimed() -> int:
    return int(ledger().get(os.getpid(), {}).get("bytes", 0))


def test_a_copier_that_dies_while_the_keeper_makes_leaves_what_it_made_claimed(
    job: Job, budget: Callable[[str], None], monkeypatch: pytest.MonkeyPatch
) -> None:
    budget("1GiB")
    monkeypatch.setattr(kept_staging, "CHECK_S", 3600)  # the keeper never looks: keep_ready is called here
    monkeypatch.setattr(path, "DRIVER_MADE_PIECE", 2 * MiB)
    make = Copier.make_host
    calls: list[int] = []

    def dies_at_the_second(self: Copier, nbytes: int, piece: int) -> Any:
        calls.append(nbytes)
        if len(calls) == 2:
            os.kill(self.pid, signal.SIGKILL)  # as the allocator kills it for the job's GPU memory
            time.sleep(0.2)
        return make(self, nbytes, piece)

    monkeypatch.setattr(Copier, "make_host", dies_at_the_second)
    engine = job.training([2 * MiB, 4 * MiB, 6 * MiB])
    assert job.fast is not None
    note = job.fast.keep_ready(0, engine.gpus[0].uuid)
    assert note is not None and note.startswith("the copier process failed making host memory for a pause"), note
    assert _C.host_staging_pool_bytes() == 2 * MiB and claimed() == 2 * MiB  # the piece made is held, and claimed
    assert engine.pause().ok and engine.resume().ok
    job.assert_home(physical=0)


def test_a_keeper_look_while_a_resume_gives_back_what_it_made_keeps_the_part(
    job: Job, part_kept: Callable[[], tuple[Any, Any]], monkeypatch: pytest.MonkeyPatch
) -> None:
    engine, part = part_kept()
    pinned_ahead(job, engine)
    assert engine.pause().ok
    detach = Copier.detach

    def slow_detach(self: Copier) -> None:
        time.sleep(1.0)  # as the copier unmaps tens of GiB
        detach(self)

    monkeypatch.setattr(Copier, "detach", slow_detach)
    assert engine.resume().ok
    assert job.fast is not None
    note = job.fast.keep_ready(0, engine.gpus[0].uuid)  # the keeper's next look, the release still under way
    assert note is not None and note.startswith("pins "), note
    assert _C.host_staging_layout().extents == part.extents and claimed() == 8 * MiB


def test_a_part_of_memfds_kept_through_a_resume_is_not_claimed_when_it_goes(
    job: Job, part_kept: Callable[[], tuple[Any, Any]], monkeypatch: pytest.MonkeyPatch
) -> None:
    """Kept memfds (driver-made memory off) are given back with what the pause made, and the claim goes too."""
    monkeypatch.setenv(DRIVER_MEMORY_ENV, "0")
    engine, part = part_kept()
    assert not any(part.driver_made)
    assert engine.pause().ok and engine.resume().ok
    assert job.fast is not None
    job.fast._wait_for_release()
    assert _C.host_staging_pool_bytes() == 0 and claimed() == 0
    job.assert_home(physical=0)


def test_a_crowded_gpu_gives_back_the_part_kept_through_a_resume(
    job: Job, part_kept: Callable[[], tuple[Any, Any]], monkeypatch: pytest.MonkeyPatch
) -> None:
    engine, part = part_kept()
    pinned_ahead(job, engine)
    assert engine.pause().ok and engine.resume().ok
    assert job.fast is not None
    job.fast._wait_for_release()
    assert _C.host_staging_layout().extents == part.extents and claimed() == 8 * MiB
    monkeypatch.setattr(path, "copier_room_problem", lambda uuid, coming=0: "the GPU has 300 MiB free")
    note = job.fast.keep_ready(0, engine.gpus[0].uuid)
    assert note == "nothing is kept pinned for a pause for now: the GPU has 300 MiB free"
    job.fast._wait_for_release()
    assert _C.host_staging_pool_bytes() == 0 and claimed() == 0


def test_a_pause_called_off_keeps_the_staging_kept_in_part(job: Job, part_kept: Callable[[], tuple[Any, Any]]) -> None:
    engine, part = part_kept()
    assert job.fast is not None
    job.fast.done_with_host()  # as after a pause called off before its safe point (its ranks did not agree)
    assert job.fast.kept_in_part and claimed() == 8 * MiB
    pinned_ahead(job, engine)
    assert engine.pause().ok and engine.resume().ok
    job.fast._wait_for_release()
    assert _C.host_staging_layout().extents == part.extents  # the part stayed through the resume


def test_a_job_whose_pause_would_be_refused_keeps_nothing_pinned_until_it_could_pause(
    job: Job, budget: Callable[[str], None], monkeypatch: pytest.MonkeyPatch
) -> None:
    """Every rank of a job whose pause is refused (in the field: its NCCL cannot suspend, a CUDA
    graph holds NCCL calls; here: a rank whose process group has not started) would pin its staging
    for nothing: the keeper keeps none, gives back what it kept when such a refusal comes, and keeps
    it again when the refusal goes."""
    budget("1GiB")
    monkeypatch.setenv("RANK", "1")
    monkeypatch.setenv("WORLD_SIZE", "2")
    engine = job.training([2 * MiB, 4 * MiB])
    keeper = engine._keeper
    assert keeper is not None and job.fast is not None
    refused = (
        "nothing is kept pinned between pauses: a pause of this job is refused now: the job has not started "
        "its process group yet (init_process_group): wait until it trains"
    )
    wait_until(lambda: keeper.note is not None, what="the keeper to look")
    assert keeper.note == refused
    time.sleep(0.3)  # six looks more
    assert not job.fast.keeping and _C.host_staging_pool_bytes() == 0 and ledger() == {}

    monkeypatch.delenv("RANK")
    monkeypatch.delenv("WORLD_SIZE")
    wait_until(lambda: job.fast is not None and job.fast.keeping, what="the keeper to keep the staging")
    kept = _C.host_staging_pool_bytes()
    assert kept >= 6 * MiB and ledger()[os.getpid()]["bytes"] >= 6 * MiB

    monkeypatch.setenv("RANK", "1")
    monkeypatch.setenv("WORLD_SIZE", "2")
    given_back(keeper, lambda note: note == refused)
    assert not job.fast.keeping and ledger() == {}
    assert copier_processes() != []  # the copier stays, asleep, for a pause once the job can take one

    monkeypatch.delenv("RANK")
    monkeypatch.delenv("WORLD_SIZE")
    wait_until(lambda: job.fast is not None and job.fast.keeping, what="the keeper to keep the staging again")
    pauses_on_the_kept_staging(job, engine)


def test_a_process_holding_memory_the_driver_cannot_checkpoint_keeps_nothing_pinned_until_it_frees_it(
    job: Job, budget: Callable[[str], None]
) -> None:
    """Its pause would be refused (engine/guards/uncheckpointable_memory.py; here managed memory, as
    bitsandbytes' paged optimizers make it), so the keeper gives back what it kept and keeps it
    again once the memory is freed."""
    budget("1GiB")
    engine = job.training([2 * MiB, 4 * MiB])
    keeper = engine._keeper
    assert keeper is not None and job.fast is not None
    wait_until(lambda: job.fast is not None and job.fast.keeping, what="the keeper to keep the staging")

    free = job.fake.managed_memory(4 * MiB)
    try:
        given_back(keeper, lambda note: note.startswith("nothing is kept"))
        assert keeper.note == (
            "nothing is kept pinned between pauses: a pause of this job is refused now: this process holds "
            f"managed memory (1 mapping, 4.0 MiB, the first at {free.address:#x}): "  # type: ignore[attr-defined]
            "the driver's checkpoint refuses it (fact `managed-memory-refused` in docs/facts.md), so the job cannot be "
            "paused or moved while it holds it. It is made by cudaMallocManaged, e.g. bitsandbytes' paged optimizers: "
            "use one without paging (adamw_8bit for paged_adamw_8bit), or free it first"
        )
        assert not job.fast.keeping and ledger() == {}
    finally:
        free()
    wait_until(lambda: job.fast is not None and job.fast.keeping, what="the keeper to keep the staging again")
    pauses_on_the_kept_staging(job, engine)


def test_a_pause_that_does_not_fit_the_budget_prepares_its_own_and_gives_it_back(
    job: Job, budget: Callable[[str], None]
) -> None:
    budget("2MiB")  # less than a quarter of the 14 MiB a pause needs: no part of it is kept either
    engine = job.training([2 * MiB, 4 * MiB, 6 * MiB])
    keeper = engine._keeper
    assert keeper is not None
    wait_until(lambda: keeper.note is not None, what="the keeper to look")
    assert keeper.note == (
        "the staging for a pause is prepared when one is asked for: its 14 MiB exceed flexium's pinned host "
        "memory budget of 2 MiB (FLEXIUM_PINNED_HOST_MEMORY=2MiB, from the environment)"
    )
    assert _C.host_staging_pool_bytes() == 0 and ledger() == {}
    paused = engine.pause()  # made at its safe point, written by the copier's copies
    assert paused.ok and re.match(
        r"made the host staging by the copier process \d+ at the safe point in \d+\.\d\d s \(0\.01 GiB of it newly "
        r"mapped and written, 0\.00 GiB found pinned, 0\.01 GiB streamed; files \d+\.\d\d s, attach \d+\.\d\d s\), "
        r"then wrote \d+\.\d\d GiB through 1 MiB buffers as the copies came, nothing of it pinned",
        paused.notes[0],
    ), paused.notes
    assert engine.resume().ok
    wait_until(lambda: _C.host_staging_pool_bytes() == 0, what="the staging to be given back")
    assert ledger() == {} and job.fast is not None and not job.fast.keeping


def test_a_migration_first_puts_the_copier_to_sleep_and_the_keeper_wakes_it_on_the_new_gpu(
    job: Job, budget: Callable[[str], None]
) -> None:
    budget("1GiB")
    engine = job.training([2 * MiB, 4 * MiB])
    wait_until(lambda: job.fast is not None and job.fast.keeping, what="the keeper to keep the staging")
    assert job.fast is not None and job.fast._copier is not None
    assert job.fast._copier.awake_on == engine.gpus[0].uuid
    moved = engine.migrate(engine.gpus[1])
    assert moved.ok and moved.path == "fast"
    job.assert_home(physical=1)
    gpu1 = engine.gpus[1].uuid
    wait_until(
        lambda: job.fast is not None and job.fast._copier is not None and job.fast._copier.awake_on == gpu1,
        what="the keeper to pin on the new GPU",
    )
    assert ledger()[os.getpid()]["gpu"] == engine.gpus[1].uuid


def test_the_job_running_out_of_gpu_memory_kills_the_copier_and_the_keeper_gives_way(
    job: Job, budget: Callable[[str], None]
) -> None:
    budget("1GiB")
    engine = job.training([2 * MiB, 4 * MiB])
    keeper = engine._keeper
    assert keeper is not None
    wait_until(lambda: job.fast is not None and job.fast.keeping, what="the keeper to keep the staging")
    (copier,) = copier_processes()
    assert _C.gpu_memory_yielder() == copier
    yields = _C.gpu_memory_yields()
    job.fake.set_other_memory(0, H200_BYTES - 16 * MiB)
    try:
        assert job._alloc(32 * MiB, 0, None) is None  # the fake's memory stays taken: still short after the kill
    finally:
        job.fake.set_other_memory(0, 0)
    assert _C.gpu_memory_yields() == yields + 1 and _C.gpu_memory_yielder() == 0
    assert zombie(copier) or copier not in copier_processes()
    wait_until(
        lambda: keeper.note is not None and "needed the GPU memory" in keeper.note, what="the keeper to give way"
    )
    time.sleep(0.3)  # several looks: it does not start a copier to pin on this GPU again
    assert [p for p in copier_processes() if not zombie(p)] == []
    assert engine.state == EngineState.RUNNING
    paused = engine.pause()  # prepares its own, as without a budget
    assert paused.ok and paused.path == "fast"
    assert engine.resume().ok
    job.assert_home(physical=0)


def test_a_gpu_without_room_for_the_copiers_context_gets_none(job: Job, budget: Callable[[str], None]) -> None:
    budget("1GiB")
    job.fake.set_other_memory(0, H200_BYTES - 800 * MiB)  # the job's 6 MiB fit, a context beside them does not
    try:
        engine = job.training([2 * MiB, 4 * MiB])
        keeper = engine._keeper
        assert keeper is not None
        wait_until(lambda: keeper.note is not None, what="the keeper to look")
        assert re.fullmatch(
            r"nothing is kept pinned for a pause for now: the GPU has \d+ MiB free, less than the 1030 MiB the "
            r"copier's context needs beside the job",
            keeper.note,
        ), keeper.note
        assert copier_processes() == [] or not job.fast or job.fast._copier is None or job.fast._copier.awake_on is None
        paused = engine.pause()
        assert paused.ok and paused.path == "fast"
        assert re.search(r"host staging in this process \(the GPU has \d+ MiB free", paused.notes[0]), paused.notes
        assert engine.resume().ok
        job.assert_home(physical=0)
    finally:
        job.fake.set_other_memory(0, 0)


def test_an_allocation_short_of_memory_kills_the_registered_process_once(fake: FakeDriver) -> None:
    lib = ctypes.CDLL(_C.__file__)
    lib.flexium_vmm_alloc.restype = ctypes.c_void_p
    lib.flexium_vmm_alloc.argtypes = [ctypes.c_size_t, ctypes.c_int, ctypes.c_void_p]
    other = a_live_process()
    yields = _C.gpu_memory_yields()
    try:
        _C.set_gpu_memory_yielder(other.pid)
        assert _C.gpu_memory_yielder() == other.pid
        fake.set_other_memory(0, H200_BYTES - 4 * MiB)
        # The fake's memory is not the killed process's: still short after the kill, and said so.
        assert lib.flexium_vmm_alloc(64 * MiB, 0, None) is None
        # Reaped by the allocator (the driver frees a context only once all its threads are gone).
        assert other.wait(timeout=5) is not None and not os.path.exists(f"/proc/{other.pid}")
        assert _C.gpu_memory_yields() == yields + 1 and _C.gpu_memory_yielder() == 0
        assert lib.flexium_vmm_alloc(64 * MiB, 0, None) is None  # nothing left to kill: fails at once
        assert _C.gpu_memory_yields() == yields + 1
    finally:
        fake.set_other_memory(0, 0)
        _C.set_gpu_memory_yielder(0)
        other.kill()
        other.wait()


# ----------------------------------------------------------------------------- what users see


def test_doctor_shows_the_budget_and_who_keeps_what(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    from flexium.cli import doctor

    monkeypatch.setenv(pinned_budget.ENV, "24GiB")
    assert pinned_budget.claim(3 * GiB, "GPU-1234") is None
    try:
        assert doctor.run(as_json=True) == 0
        report = json.loads(capsys.readouterr().out)["pinned_host_memory"]
        assert report == {
            "budget_bytes": 24 * GiB,
            "setting": "24GiB",
            "source": "from the environment",
            "kept_bytes": 3 * GiB,
            "kept_by": [{"pid": os.getpid(), "bytes": 3 * GiB, "gpu": "GPU-1234"}],
        }
        assert doctor.run(as_json=False) == 0
        out = capsys.readouterr().out
        assert (
            "pinned host memory  24.0 GiB for pauses kept ready (FLEXIUM_PINNED_HOST_MEMORY=24GiB, from the "
            "environment); 3.0 GiB kept now\n" in out
        )
        assert f"\n{' ' * doctor.LABEL_WIDTH}process {os.getpid()}  3.0 GiB  for GPU GPU-1234\n" in out
    finally:
        pinned_budget.release()
    monkeypatch.setenv(pinned_budget.ENV, "0")
    assert doctor.run(as_json=False) == 0
    assert (
        "pinned host memory  none kept between pauses: each pause prepares its own staging" in capsys.readouterr().out
    )


def test_a_bad_setting_is_refused_when_the_job_starts(monkeypatch: pytest.MonkeyPatch) -> None:
    from flexium.api import runtime

    monkeypatch.setenv(pinned_budget.ENV, "a lot")
    with pytest.raises(ConfigError, match=r"FLEXIUM_PINNED_HOST_MEMORY='a lot' \(from the environment\) is not an"):
        runtime._start(None)  # type: ignore[arg-type]  (refused before the config is read)
    assert runtime.current() is None


def staging_rss(pid: int) -> int:
    """Bytes of the host staging's memfds resident in `pid`'s page tables."""
    total, inside = 0, False
    with open(f"/proc/{pid}/smaps") as smaps:
        for line in smaps:
            fields = line.split()
            if "-" in fields[0] and len(fields) >= 5:  # a mapping's header line
                inside = "flexium-host-staging" in line
            elif inside and fields[0] == "Rss:":
                total += int(fields[1]) * 1024
    return total


def test_the_copier_touches_the_staging_it_pins_and_the_job_never_does(
    job: Job, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Registering pages the registering process has not mapped runs at 4 GB/s, mapped at about 30 GB/s (facts
    `fallocate-no-faster` and `staging-kept-pinned-ahead`): the copier, which pins, touches; the job only makes the
    files. (A staging made at the safe point is written, not touched, unless FLEXIUM_WRITTEN_STAGING=0.)"""
    monkeypatch.setenv("FLEXIUM_WRITTEN_STAGING", "0")
    engine = job.training([2 * MiB, 4 * MiB, 6 * MiB])
    paused = engine.pause()
    assert paused.ok and "by the copier process" in paused.notes[0]
    (copier,) = copier_processes()
    assert staging_rss(copier) >= 12 * MiB  # the live bytes it holds, its pages mapped there
    assert staging_rss(os.getpid()) == 0
    assert engine.resume().ok
    job.assert_home(physical=0)
    assert staging_rss(os.getpid()) == 0


def test_once_kept_the_keeper_leaves_the_pool_alone(job: Job, budget: Callable[[str], None]) -> None:
    """A pool's live ranges come from a snapshot of PyTorch's allocator: a keeper that has kept
    the staging for this pool does not take one at every look."""
    budget("1GiB")
    engine = job.training([2 * MiB, 4 * MiB])
    wait_until(lambda: job.fast is not None and job.fast.keeping, what="the keeper to keep the staging")
    time.sleep(0.2)
    asked = len(job.pool.asked)
    time.sleep(0.5)  # ten looks
    assert len(job.pool.asked) == asked
    assert engine.pause().ok and engine.resume().ok


def test_a_ledger_held_by_another_process_is_a_refusal_not_a_hang(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(pinned_budget.ENV, "8GiB")
    monkeypatch.setattr(pinned_budget, "LOCK_WAIT_S", 0.3)
    pinned_budget.LEDGER_DIR.mkdir()
    holder = subprocess.Popen(
        [
            sys.executable,
            "-c",
            "import fcntl, os, sys, time; fd = os.open(sys.argv[1], os.O_RDWR | os.O_CREAT, 0o666); "
            "fcntl.flock(fd, fcntl.LOCK_EX); print('held', flush=True); time.sleep(60)",
            str(pinned_budget.LEDGER_DIR / "lock"),
        ],
        stdout=subprocess.PIPE,
        text=True,
    )
    try:
        assert holder.stdout is not None and holder.stdout.readline().strip() == "held"
        umask = os.umask(0o022)
        os.umask(umask)
        started = time.monotonic()
        refusal = pinned_budget.claim(1 * GiB, "GPU-a")
        assert time.monotonic() - started < 2.0
        assert refusal is not None and refusal.startswith("its pinned host memory ledger could not be written")
        assert "held" in refusal and ledger() == {}
        assert os.umask(umask) == umask  # the process's umask is never changed
    finally:
        holder.kill()
        holder.wait()
    assert pinned_budget.claim(1 * GiB, "GPU-a") is None
    pinned_budget.release()


def test_a_ledger_that_cannot_be_written_is_a_refusal(monkeypatch: pytest.MonkeyPatch, tmp_path: Any) -> None:
    monkeypatch.setenv(pinned_budget.ENV, "8GiB")
    monkeypatch.setattr(pinned_budget, "LEDGER_DIR", tmp_path / "not-a-folder" / "ledger")
    (tmp_path / "not-a-folder").write_text("a file where the ledger's parent folder should be")
    refusal = pinned_budget.claim(1 * GiB, "GPU-a")
    assert refusal is not None and refusal.startswith("its pinned host memory ledger could not be written")
