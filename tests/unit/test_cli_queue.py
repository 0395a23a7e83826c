"""`flexium resume --when-free | --make-room | --cancel`, `flexium queue` and `flexium priority` on a
scripted server: the option combinations refused before anything is sent, what queuing a job says
(its wait, its place, what it waits for, how to list and cancel), making room followed until the
queue sends the resume (or the wait ends, or the timeout), a cancel that finds nothing waiting, the
queue's table, and a priority read, set and refused."""

from __future__ import annotations

import argparse
import time
from collections.abc import Sequence
from types import SimpleNamespace
from typing import Any

import pytest

from flexium import wire
from flexium.cli import queue as queue_cli
from flexium.cli.exit_status import EXIT_FAILED, EXIT_OK, UsageError
from flexium.cli.main import build_parser
from support.commands import command_info

GIB = 1 << 30


def wait(**fields: Any) -> wire.WaitInfo:
    values: dict[str, Any] = {
        "id": 3,
        "process_id": "gpu-7f3a",
        "job_key": None,
        "host": "node1",
        "gpu_uuid": None,
        "priority": 50,
        "state": "waiting",
        "position": 2,
        "need_bytes": 30 * GIB,
        "created_at": time.time() - 30,
        "finished_at": None,
        "command_id": None,
        "dispatches": 0,
        "requested_by": "alice",
        "reason": "queued by alice",
        "note": None,
    }
    return wire.WaitInfo(**{**values, **fields})


def held_wait() -> wire.WaitInfo:
    """A wait with room held for it on GPU 1, as a make-room without --gpu answers it (the wait is for any GPU:
    should that room not come it waits for any)."""
    room = wire.ReservationInfo(
        id=4, host="node1", gpu_uuid="GPU-0001", bytes=30 * GIB, holder="gpu-7f3a", created_at=0.0, expires_at=300.0
    )
    return wait(gpu_uuid=None, reservation=room)


def command(kind: str, command_id: int, process_id: str = "gpu-7f3a") -> wire.CommandInfo:
    return command_info(command_id, kind, process_id)


class Server:
    """The queue's API as the CLI calls it, with scripted answers."""

    workspace = "team"

    def __init__(
        self,
        created: wire.WaitCreated | None = None,
        reads: Sequence[wire.WaitInfo] = (),
        waits: Sequence[wire.WaitInfo] = (),
        placements: Sequence[wire.PlacementInfo] = (),
    ) -> None:
        self.created, self.reads, self.waits = created, list(reads), list(waits)
        self.placements = list(placements)
        self.requests: list[wire.WaitRequest] = []
        self.cancelled: list[int] = []
        self.priorities: list[tuple[str, int]] = []

    def create_wait(self, request: wire.WaitRequest) -> wire.WaitCreated:
        self.requests.append(request.model_copy())
        assert self.created is not None
        return self.created

    def get_wait(self, wait_id: int) -> wire.WaitInfo:
        return self.reads.pop(0) if len(self.reads) > 1 else self.reads[0]  # the last one again and again

    def get_command(self, command_id: int) -> wire.CommandInfo:
        return command("resume", command_id)

    def list_processes(self) -> list[Any]:  # the one process the CLI is told of, by the short id it is named with
        return [SimpleNamespace(process_id="gpu-7f3a", pid=4242)]

    def list_placements(self, *, ended: bool = False) -> list[wire.PlacementInfo]:
        return self.placements

    def list_waits(self, *, process_id: str | None = None, ended: bool = False) -> list[wire.WaitInfo]:
        return [w for w in self.waits if process_id in (None, w.process_id)]

    def cancel_wait(self, wait_id: int) -> wire.WaitInfo:
        self.cancelled.append(wait_id)
        return wait(id=wait_id, state="cancelled")

    def get_process(self, process_id: str) -> Any:
        return SimpleNamespace(process_id=process_id, priority=50, job=None)

    def set_priority(self, process_id: str, priority: int) -> Any:
        self.priorities.append((process_id, priority))
        job = SimpleNamespace(key="run-7", world_size=2)
        return SimpleNamespace(process_id=process_id, priority=priority, job=job)


def parse(*argv: str) -> argparse.Namespace:
    args: argparse.Namespace = build_parser().parse_args(list(argv))
    return args


def run(server: Server, *argv: str) -> int:
    args = parse(*argv)
    status: int = args.on_server(server, args)
    return status


@pytest.fixture(autouse=True)
def no_pause_between_reads(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(queue_cli, "FOLLOW_EVERY_S", 0.0)


@pytest.mark.parametrize(
    ("argv", "said"),
    [
        (("gpu-7f3a", "cuda:1", "--when-free"), "take no TARGET or --ranks: name the GPU with --gpu"),
        (("gpu-7f3a", "--make-room", "--ranks", "0=cuda:1"), "take no TARGET or --ranks"),
        (("gpu-7f3a", "--cancel", "--gpu", "cuda:1"), "--cancel takes no --gpu or --host"),
        (("gpu-7f3a", "--make-room", "--host", "node2"), "--host goes with --when-free"),
        (("gpu-7f3a", "--cancel", "--reason", "later"), "--reason goes with a command or a wait, not with --cancel"),
        (("gpu-7f3a", "--when-free", "--reason", "two\nlines"), "--reason: "),
        (("gpu-7f3a", "--gpu", "cuda:1"), "--gpu and --host go with --when-free or --make-room"),
    ],
)
def test_option_combinations_that_cannot_be_are_refused_before_anything_is_sent(
    argv: tuple[str, ...], said: str
) -> None:
    server = Server()
    with pytest.raises(UsageError, match=said.replace("(", r"\(")):
        run(server, "resume", *argv)
    assert server.requests == []


def test_when_free_and_make_room_are_one_or_the_other() -> None:
    with pytest.raises(SystemExit):
        parse("resume", "gpu-7f3a", "--when-free", "--make-room")


def test_queuing_says_its_wait_its_place_and_how_to_list_and_cancel_it(capsys: pytest.CaptureFixture[str]) -> None:
    server = Server(wire.WaitCreated(wait=wait(), commands=[]))
    assert run(server, "resume", "gpu-7f3a", "--when-free", "--gpu", "cuda:1", "--host", "node1") == EXIT_OK
    assert server.requests == [wire.WaitRequest(process_id="gpu-7f3a", gpu="cuda:1", host="node1", make_room=False)]
    assert capsys.readouterr().out == (
        "resume gpu-7f3a: queued as wait 3, number 2 in host node1's queue: it resumes when a GPU of its host has "
        "30.0 GiB free (0.5 GiB more as headroom beside other processes or on another GPU; `flexium queue` lists "
        "the queue; `flexium resume gpu-7f3a --cancel` takes it out)\n"
    )


def test_a_wait_for_a_named_gpu_says_it_as_it_was_named(capsys: pytest.CaptureFixture[str]) -> None:
    server = Server(wire.WaitCreated(wait=wait(gpu_uuid="GPU-0001"), commands=[]))
    assert run(server, "resume", "gpu-7f3a", "--when-free", "--gpu", "cuda:1") == EXIT_OK
    assert "it resumes when cuda:1 (GPU-0001) has 30.0 GiB free" in capsys.readouterr().out


def test_a_reason_goes_with_the_wait_and_the_queue_shows_it(capsys: pytest.CaptureFixture[str]) -> None:
    server = Server(wire.WaitCreated(wait=wait(), commands=[]))
    for option in ("--when-free", "--make-room"):
        assert run(server, "resume", "gpu-7f3a", option, "--reason", "the demo at 3", "--no-wait") == EXIT_OK
    assert [(r.make_room, r.reason) for r in server.requests] == [(False, "the demo at 3"), (True, "the demo at 3")]
    capsys.readouterr()
    assert run(Server(waits=[wait(why="the demo at 3")]), "queue") == EXIT_OK
    assert capsys.readouterr().out.splitlines()[1].endswith("alice  why: the demo at 3")


def test_a_process_named_in_short_is_looked_up_before_the_wait_is_asked_for() -> None:
    """The server hears only of the process meant: a first try with the short name would stand in its
    audit log as a request refused (no such process)."""
    server = Server(wire.WaitCreated(wait=wait(), commands=[]))
    for named in ("gpu-7f", "7f3a", "4242"):  # a prefix, the id's hex, the pid
        assert run(server, "resume", named, "--when-free", "--no-wait") == EXIT_OK
    assert [r.process_id for r in server.requests] == ["gpu-7f3a"] * 3


def test_making_room_is_followed_until_the_queue_sends_the_resume(capsys: pytest.CaptureFixture[str]) -> None:
    held = held_wait()
    created = wire.WaitCreated(wait=held, commands=[command("pause", 5, "gpu-low")])
    dispatched = held.model_copy(update={"state": "dispatched", "command_id": 9})
    server = Server(created, reads=[held, dispatched])
    args = parse("resume", "gpu-7f3a", "--make-room")
    resume = queue_cli.resume_later(server, args)  # type: ignore[arg-type]
    assert isinstance(resume, wire.CommandInfo) and (resume.id, resume.kind) == (9, "resume")
    assert server.requests[0].make_room is True and server.reads == [dispatched]  # read to the last
    err = capsys.readouterr().err
    assert "resume gpu-7f3a: making room: pausing gpu-low (command 5)" in err
    assert "room held for it on GPU-0001; waiting for the pauses to free it" in err


def test_a_pause_making_room_that_is_slow_to_be_taken_is_said_once_with_where_to_look(
    capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(queue_cli, "PAUSE_SLOW_S", 0.0)
    held = held_wait()
    created = wire.WaitCreated(wait=held, commands=[command("pause", 5, "gpu-low")])
    dispatched = held.model_copy(update={"state": "dispatched", "command_id": 9})
    server = Server(created, reads=[held, held, dispatched])
    resume = queue_cli.resume_later(server, parse("resume", "gpu-7f3a", "--make-room"))  # type: ignore[arg-type]
    assert isinstance(resume, wire.CommandInfo) and resume.id == 9
    err = capsys.readouterr().err
    slow = "resume gpu-7f3a: pausing gpu-low (command 5) is still queued after 0 s: a job takes its pause at its next"
    assert err.count(slow) == 1, err
    assert "`flexium ps` shows whether it is STALE" in err


def test_making_room_fails_when_the_wait_ends_without_a_resume_or_outlives_the_timeout(
    capsys: pytest.CaptureFixture[str],
) -> None:
    held = held_wait()
    gone = held.model_copy(update={"state": "cancelled", "note": "the job left"})
    server = Server(wire.WaitCreated(wait=held, commands=[]), reads=[gone])
    assert queue_cli.resume_later(server, parse("resume", "gpu-7f3a", "--make-room")) == EXIT_FAILED  # type: ignore[arg-type]
    assert "resume gpu-7f3a: wait 3 cancelled: the job left" in capsys.readouterr().err

    late = Server(wire.WaitCreated(wait=held, commands=[]), reads=[held] * 3)
    args = parse("resume", "gpu-7f3a", "--make-room", "--timeout", "0.01")
    assert queue_cli.resume_later(late, args) == EXIT_FAILED  # type: ignore[arg-type]
    assert "still waiting after 0 s (wait 3); it resumes when the room shows" in capsys.readouterr().err

    # A pause that was to make the room failed: the room is not held any more, and the wait says why.
    note = "room not made: pausing gpu-low (command 5) failed: no host memory; no room is held for it now, it waits"
    not_made = held.model_copy(update={"reservation": None, "note": note})
    failed = Server(wire.WaitCreated(wait=held, commands=[]), reads=[not_made])
    assert queue_cli.resume_later(failed, parse("resume", "gpu-7f3a", "--make-room")) == EXIT_FAILED  # type: ignore[arg-type]
    assert f"resume gpu-7f3a: {note} (wait 3: `flexium queue` shows it" in capsys.readouterr().err


def test_a_room_free_at_once_gives_the_resume_to_follow(capsys: pytest.CaptureFixture[str]) -> None:
    server = Server(wire.WaitCreated(wait=wait(state="dispatched"), commands=[command("resume", 8)]))
    resume = queue_cli.resume_later(server, parse("resume", "gpu-7f3a", "--when-free"))  # type: ignore[arg-type]
    assert isinstance(resume, wire.CommandInfo) and resume.id == 8
    assert capsys.readouterr().out == ""


def test_cancel_takes_the_waiting_wait_out_or_says_nothing_waits(capsys: pytest.CaptureFixture[str]) -> None:
    server = Server(waits=[wait(id=2, state="dispatched", command_id=11), wait(id=3)])
    assert run(server, "resume", "gpu-7f3a", "--cancel") == EXIT_OK
    assert server.cancelled == [3]
    assert "resume gpu-7f3a when free: cancelled (wait 3); it stays paused" in capsys.readouterr().out

    under_way = Server(waits=[wait(id=2, state="dispatched", command_id=11)])
    assert run(under_way, "resume", "gpu-7f3a", "--cancel") == EXIT_FAILED
    assert under_way.cancelled == []
    assert "gpu-7f3a is not waiting in the queue: its resume, command 11, is under way" in capsys.readouterr().err


def test_the_queue_lists_each_wait_with_its_priority_place_and_a_clipped_note(
    capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("COLUMNS", "80")  # a narrow terminal: the note is clipped to NOTE_WIDTH
    long_note = "resume refused by the job: " + "x" * 80
    server = Server(
        waits=[
            wait(priority=90, position=1),
            wait(id=4, process_id="run-7-rank-0", job_key="run-7", gpu_uuid="GPU-0001", priority=70, note=long_note),
            wait(id=6, process_id="gpu-9c1d", gpu_uuid="GPU-0002", gpu_index=2, priority=50, position=3),
        ]
    )
    assert run(server, "queue") == EXIT_OK
    lines = capsys.readouterr().out.splitlines()
    # The GPU a wait names, by its nvidia-smi index where its host reported it, else by its UUID.
    assert lines[3].split()[:7] == ["6", "gpu-9c1d", "normal", "3", "waiting", "node1", "2"], lines[3]
    assert lines[2].split()[7] == "GPU-0001", lines[2]
    assert lines[0].split() == [
        "WAIT", "PROCESS", "PRIORITY", "PLACE", "STATE", "HOST", "GPU", "NEEDS", "WAITING", "BY", "NOTE",
    ]  # fmt: skip
    assert lines[1].split()[:9] == ["3", "gpu-7f3a", "high", "1", "waiting", "node1", "any", "30.0", "GiB"]
    assert lines[2].split()[:5] == ["4", "run-7-rank-0", "(job)", "70", "2"]
    assert lines[2].endswith("x~") and len(lines[2].split("alice  ")[1]) == queue_cli.NOTE_WIDTH
    assert lines[-1].startswith("PLACE: in its host's queue")
    monkeypatch.setenv("COLUMNS", "250")  # a wide one shows it whole
    assert run(server, "queue") == EXIT_OK
    assert capsys.readouterr().out.splitlines()[2].endswith(long_note)
    monkeypatch.delenv("COLUMNS")  # to a pipe (as here: not a terminal), whole lines, as `flexium ps` prints
    assert run(server, "queue") == EXIT_OK
    assert capsys.readouterr().out.splitlines()[2].endswith(long_note)

    # The reason it was queued with comes first, before a note that may be clipped.
    why = wait(id=7, why="paper deadline", note="room not made: pausing gpu-1 (command 3) failed: no host memory")
    assert run(Server(waits=[why]), "queue") == EXIT_OK
    assert (
        capsys.readouterr()
        .out.splitlines()[1]
        .endswith("alice  why: paper deadline; room not made: pausing gpu-1 (command 3) failed: no host memory")
    )

    done = wait(id=5, state="done", position=None, command_id=12, finished_at=time.time())
    assert run(Server(waits=[done]), "queue", "--all") == EXIT_OK
    assert capsys.readouterr().out.splitlines()[1].endswith("alice  resumed by command 12")

    assert run(Server(), "queue") == EXIT_OK
    assert capsys.readouterr().out == "no job waits to resume or start in workspace 'team'\n"
    assert run(Server(), "queue", "--all") == EXIT_OK
    assert capsys.readouterr().out == "no wait yet\n"


def placement(**fields: Any) -> wire.PlacementInfo:
    values: dict[str, Any] = {
        "id": 7,
        "host": "node1",
        "state": "waiting",
        "gpu_uuid": None,
        "need_bytes": 76 * GIB,
        "priority": 10,
        "position": 1,
        "placed_uuid": None,
        "placed_index": None,
        "process_id": None,
        "created_at": time.time() - 12,
        "placed_at": None,
        "finished_at": None,
        "requested_by": "bob",
        "command": "python train.py",
        "note": "waits for 76.5 GiB (its 76.0 GiB and headroom): GPU 0: 74.0 GiB free",
    }
    return wire.PlacementInfo(**{**values, **fields})


def test_the_queue_lists_the_jobs_flexium_run_waits_to_start_too(capsys: pytest.CaptureFixture[str]) -> None:
    """A placement waiting for room, and one placed (its room held until its job registers), beside the
    paused jobs waiting to resume: one listing of what goes next on each host; --json carries both."""
    placed = placement(id=8, state="placed", position=None, placed_index=1, placed_uuid="GPU-0001", note="placed")
    named = placement(id=9, position=2, gpu_uuid="GPU-0002", gpu_index=2, why="big eval")
    server = Server(waits=[wait()], placements=[placement(), placed, named])
    assert run(server, "queue") == EXIT_OK
    lines = capsys.readouterr().out.splitlines()
    assert lines[0] == "paused, waiting to resume:" and lines[1].split()[0] == "WAIT"
    start = lines.index("waiting to start or starting (flexium run):")
    assert lines[start + 1].split() == [
        "PLACEMENT", "PRIORITY", "PLACE", "STATE", "HOST", "GPU", "NEEDS", "WAITING", "BY", "COMMAND", "NOTE",
    ]  # fmt: skip
    assert lines[start + 2].split()[:9] == ["7", "low", "1", "waiting", "node1", "any", "76.0", "GiB", "12s"]
    assert lines[start + 2].endswith("GPU 0: 74.0 GiB free")
    assert lines[start + 3].split()[:6] == ["8", "low", "-", "placed", "node1", "1"]
    # The GPU it asked for by its index; the reason it was started with before the note.
    assert lines[start + 4].split()[:6] == ["9", "low", "2", "waiting", "node1", "2"]
    assert lines[start + 4].endswith("why: big eval; GPU 0: 74.0 GiB free")
    assert run(Server(placements=[placement()]), "queue", "--json") == EXIT_OK
    listed = wire.QueueListing.model_validate_json(capsys.readouterr().out)
    assert listed.waits == [] and [p.id for p in listed.placements] == [7]


def test_a_priority_is_shown_set_by_name_or_number_and_refused_outside_the_scale(
    capsys: pytest.CaptureFixture[str],
) -> None:
    server = Server()
    assert run(server, "priority", "gpu-7f3a") == EXIT_OK
    assert capsys.readouterr().out == "gpu-7f3a: priority normal\n"
    assert run(server, "priority", "gpu-7f3a", "HIGH") == EXIT_OK
    assert run(server, "priority", "gpu-7f3a", "70") == EXIT_OK
    assert server.priorities == [("gpu-7f3a", 90), ("gpu-7f3a", 70)]
    assert capsys.readouterr().out.splitlines() == [
        "gpu-7f3a: priority high (every rank of job run-7)",
        "gpu-7f3a: priority 70 (every rank of job run-7)",
    ]
    for wrong in ("urgent", "101", "-1"):
        with pytest.raises(UsageError, match="is not low, normal, high or a number 0-100"):
            run(server, "priority", "gpu-7f3a", wrong)
    assert len(server.priorities) == 2
