"""How much host memory flexium may keep pinned between pauses, on this machine, for all its jobs.

A job whose host staging stays pinned between pauses frees its GPU in about a second when paused;
one whose staging is prepared at the pause's command takes seconds more (touching and pinning:
fact `staging-kept-pinned-ahead`). Kept staging is host memory the machine cannot use for anything
else, so it has a budget: FLEXIUM_PINNED_HOST_MEMORY, "25%" of the machine's memory by default
(a share of it, "32GiB", a byte count, or 0 for none). The jobs of one machine share it through a
ledger of one file per process in LEDGER_DIR; a process that is gone no longer counts.
"""

from __future__ import annotations

import fcntl
import json
import os
import re
import tempfile
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

from flexium.engine.host_memory import host_memory_total
from flexium.errors import ConfigError
from flexium.units import gib_or_mib

ENV = "FLEXIUM_PINNED_HOST_MEMORY"
# A quarter of the machine: room to keep a large job's pause ready, while three quarters stay for
# the jobs' own host memory (data loading, page cache) and for pauses that take the driver path.
DEFAULT_SETTING = "25%"
LOCK_WAIT_S = 2.0
LEDGER_DIR = Path("/dev/shm" if Path("/dev/shm").is_dir() else tempfile.gettempdir(), "flexium-pinned")
_UNITS = {"": 1, "b": 1, "k": 1 << 10, "kib": 1 << 10, "m": 1 << 20, "mib": 1 << 20, "g": 1 << 30, "gib": 1 << 30}
_UNITS.update({"t": 1 << 40, "tib": 1 << 40, "kb": 10**3, "mb": 10**6, "gb": 10**9, "tb": 10**12})


@dataclass(frozen=True)
class Budget:
    bytes: int
    setting: str  # as given, e.g. "25%"
    source: str  # where the setting came from, for messages

    def describe(self) -> str:
        return f"{gib_or_mib(self.bytes)} ({ENV}={self.setting}, {self.source})"


@dataclass(frozen=True)
class Holder:
    pid: int
    bytes: int
    gpu: str


def parse(text: str, *, where: str) -> int:
    """Bytes for a setting: "25%" (of this machine's memory), "32GiB", "512MiB", "1000000", "0"."""
    value = text.strip().lower()
    if value in ("0", "off", "none"):
        return 0
    share = re.fullmatch(r"(\d+(?:\.\d+)?)\s*%", value)
    if share:
        percent = float(share.group(1))
        total = host_memory_total()
        if percent > 100:
            raise ConfigError(f"{ENV}={text!r} ({where}) is more than the machine's memory: give at most 100%")
        return 0 if total is None else int(total * percent / 100)
    amount = re.fullmatch(r"(\d+(?:\.\d+)?)\s*([a-z]*)", value)
    if not amount or amount.group(2) not in _UNITS:
        raise ConfigError(
            f"{ENV}={text!r} ({where}) is not an amount of memory: give a share of the machine's memory "
            "like 25%, a size like 32GiB or 512MiB, or 0 to keep nothing pinned between pauses"
        )
    return int(float(amount.group(1)) * _UNITS[amount.group(2)])


def budget() -> Budget:
    raw = os.environ.get(ENV, "").strip()
    if raw:
        return Budget(parse(raw, where="from the environment"), raw, "from the environment")
    return Budget(parse(DEFAULT_SETTING, where="the default"), DEFAULT_SETTING, "the default")


def holders() -> list[Holder]:
    """The processes of this machine keeping staging pinned now."""
    found = []
    for entry in _entries():
        try:
            record = json.loads(entry.read_text())
            pid = int(entry.name)
        except (OSError, ValueError):
            continue
        if _alive(pid, record.get("start")):
            found.append(Holder(pid, int(record.get("bytes", 0)), str(record.get("gpu", ""))))
    return found


def claim(nbytes: int, gpu: str) -> str | None:
    """Records that this process keeps `nbytes` pinned (replacing what it claimed before); None
    when the budget has room, else why not (nothing is recorded then)."""
    limit = budget()
    if nbytes > limit.bytes:
        return _exceeds(nbytes, limit)
    try:
        with _locked():
            others = _others()
            refusal = _no_room(nbytes, limit, others)
            if refusal is None:
                _record(nbytes, gpu)
            return refusal
    except (OSError, LedgerBusy) as exc:
        return f"its pinned host memory ledger could not be written ({exc})"


def claim_up_to(nbytes: int, gpu: str, *, at_least: int, step: int = 1) -> tuple[int, str]:
    """Records that this process keeps as much of `nbytes` pinned as the budget has left, in whole
    `step`s, if that is `at_least` (replacing what it claimed before). Returns the bytes claimed (0:
    none, nothing recorded) and why they are fewer than `nbytes` ("" when they are not)."""
    limit = budget()
    try:
        with _locked():
            others = _others()
            share = min(nbytes, max(0, limit.bytes - sum(h.bytes for h in others)) // step * step)
            why = (
                ""
                if share == nbytes
                else _exceeds(nbytes, limit)
                if nbytes > limit.bytes
                else _no_room(nbytes, limit, others)
            )
            if share < max(at_least, 1):
                return 0, why or ""
            _record(share, gpu)
            return share, why or ""
    except (OSError, LedgerBusy) as exc:
        return 0, f"its pinned host memory ledger could not be written ({exc})"


def _exceeds(nbytes: int, limit: Budget) -> str:
    return f"its {gib_or_mib(nbytes)} exceed flexium's pinned host memory budget of {limit.describe()}"


def _others() -> list[Holder]:
    return [h for h in holders() if h.pid != os.getpid()]


def _no_room(nbytes: int, limit: Budget, others: list[Holder]) -> str | None:
    held = sum(h.bytes for h in others)
    if held + nbytes <= limit.bytes:
        return None
    pids = ", ".join(str(h.pid) for h in others)
    return (
        f"its {gib_or_mib(nbytes)} do not fit in the {gib_or_mib(max(0, limit.bytes - held))} left of flexium's "
        f"pinned host memory budget of {limit.describe()}; processes {pids} keep {gib_or_mib(held)}"
    )


def _record(nbytes: int, gpu: str) -> None:
    record = {"bytes": nbytes, "gpu": gpu, "start": _start_time(os.getpid())}
    (LEDGER_DIR / str(os.getpid())).write_text(json.dumps(record))


def release() -> None:
    try:
        (LEDGER_DIR / str(os.getpid())).unlink()
    except OSError:
        pass


def _entries() -> Iterator[Path]:
    try:
        yield from (p for p in LEDGER_DIR.iterdir() if p.name.isdigit())
    except OSError:
        return


class LedgerBusy(Exception):
    pass


class _locked:
    """The ledger's lock: one claim at a time on this machine, waited for at most LOCK_WAIT_S (a
    resume claims: it must never hang on another process). The folder is shared by every user
    (sticky, like /tmp): each process writes only its own file. Modes are set with chmod, never
    through the umask, which is the whole process's."""

    def __enter__(self) -> None:
        try:
            LEDGER_DIR.mkdir(exist_ok=False)
            os.chmod(LEDGER_DIR, 0o1777)
        except FileExistsError:
            pass
        self._fd = os.open(LEDGER_DIR / "lock", os.O_RDWR | os.O_CREAT, 0o666)
        try:
            if os.fstat(self._fd).st_uid == os.getuid():
                os.fchmod(self._fd, 0o666)
            deadline = time.monotonic() + LOCK_WAIT_S
            while True:
                try:
                    fcntl.flock(self._fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
                    return
                except BlockingIOError:
                    if time.monotonic() > deadline:
                        raise LedgerBusy(
                            f"another process held the ledger {LEDGER_DIR} for {LOCK_WAIT_S:g} s"
                        ) from None
                    time.sleep(0.01)
        except BaseException:
            os.close(self._fd)
            raise

    def __exit__(self, *_: object) -> None:
        fcntl.flock(self._fd, fcntl.LOCK_UN)
        os.close(self._fd)


def _start_time(pid: int) -> int | None:
    """The process's start time in clock ticks since boot: a pid reused later has another one."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
        return int(stat[stat.rindex(")") + 2 :].split()[19])
    except (OSError, ValueError, IndexError):
        return None


def _alive(pid: int, start: int | None) -> bool:
    now = _start_time(pid)
    return now is not None and (start is None or now == start)
