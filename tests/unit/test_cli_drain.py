"""`flexium drain` and `flexium undrain` on a scripted server: where they read HOST[:GPU] from, each
job's move printed as it goes (again only when its command's state changes; a job left where it is
on stderr), the summary counting each job by its last move, a drain still under way after --timeout
failing with the way to see it, --json, and undrain choosing the drains a HOST or HOST:GPU names."""

from __future__ import annotations

import argparse
import json
from typing import Any

import pytest

from flexium import wire
from flexium.cli import drain as drain_cli
from flexium.cli.exit_status import EXIT_FAILED, EXIT_OK, UsageError
from flexium.cli.main import build_parser


def move(process_id: str, action: str, state: str | None, command_id: int | None = 1, note: str = "") -> Any:
    return wire.DrainMoveInfo(
        process_id=process_id,
        job_key=None,
        action=action,  # type: ignore[arg-type]
        command_id=None if action == "refused" else command_id,
        command_state=state,  # type: ignore[arg-type]
        target_uuid=None,
        created_at=0.0,
        note=note or f"{action} note",
    )


def drain(
    state: str = "draining", moves: list[Any] | None = None, remaining: list[str] | None = None, **fields: Any
) -> wire.DrainInfo:
    values: dict[str, Any] = {
        "id": 4,
        "host": "node1",
        "gpu_uuid": "GPU-0002",
        "gpu_index": 2,
        "state": state,
        "created_at": 0.0,
        "ended_at": None,
        "requested_by": "alice",
        "ended_by": None,
        "reason": "",
        "moves": moves or [],
        "remaining": remaining or [],
    }
    return wire.DrainInfo(**{**values, **fields})


class Server:
    """The drains API as the CLI calls it: the drain made, then one scripted answer per read (the
    last one again and again)."""

    def __init__(
        self, made: wire.DrainInfo, reads: list[wire.DrainInfo], listed: tuple[wire.DrainInfo, ...] = ()
    ) -> None:
        self.made, self.reads, self.listed = made, reads, list(listed)
        self.requests: list[wire.DrainRequest] = []
        self.ended: list[int] = []

    def create_drain(self, request: wire.DrainRequest) -> wire.DrainInfo:
        self.requests.append(request)
        return self.made

    def get_drain(self, drain_id: int) -> wire.DrainInfo:
        assert drain_id == self.made.id
        return self.reads.pop(0) if len(self.reads) > 1 else self.reads[0]

    def list_drains(self, host: str) -> list[wire.DrainInfo]:
        return [d for d in self.listed if d.host == host]

    def undrain(self, drain_id: int) -> wire.DrainInfo:
        self.ended.append(drain_id)
        return next(d for d in self.listed if d.id == drain_id).model_copy(update={"state": "ended"})


def run(server: Server, *argv: str) -> int:
    args: argparse.Namespace = build_parser().parse_args(list(argv))
    status: int = args.on_server(server, args)
    return status


@pytest.fixture(autouse=True)
def no_pause_between_reads(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(drain_cli, "FOLLOW_EVERY_S", 0.0)


@pytest.mark.parametrize(
    ("text", "where"),
    [("node1", ("node1", None)), ("node1:2", ("node1", "2")), (" node1:GPU-5a3b ", ("node1", "GPU-5a3b"))],
)
def test_where_is_a_host_or_one_of_its_gpus(text: str, where: tuple[str, str | None]) -> None:
    assert drain_cli.read_where(text) == where


@pytest.mark.parametrize("text", ["", ":2", "node1:"])
def test_a_where_without_a_host_or_with_an_empty_gpu_is_refused(text: str) -> None:
    with pytest.raises(UsageError, match="is not HOST"):
        drain_cli.read_where(text)


def test_each_move_is_printed_as_it_goes_and_again_only_when_its_state_changes(
    capsys: pytest.CaptureFixture[str],
) -> None:
    first = move("gpu-a", "migrate", "queued", 1, "moving gpu-a to GPU 0")
    server = Server(
        drain(moves=[first]),
        [
            drain(moves=[first.model_copy(update={"command_state": "running"}), move("gpu-b", "pause", "queued", 2)]),
            drain(moves=[first.model_copy(update={"command_state": "running"}), move("gpu-b", "pause", "queued", 2)]),
            drain(
                "drained",
                moves=[
                    first.model_copy(update={"command_state": "succeeded"}),
                    move("gpu-b", "pause", "succeeded", 2),
                    move("gpu-c", "refused", None, note="left where it is: it uses several GPUs"),
                ],
            ),
        ],
    )
    # A job left on the drained GPU: the drain stays, and the command fails, so that a script does not go on.
    assert run(server, "drain", "node1:2", "--reason", "fan swap") == EXIT_FAILED
    assert server.requests == [wire.DrainRequest(host="node1", gpu="2", reason="fan swap")]
    out, err = capsys.readouterr()
    assert out.splitlines() == [
        "drain 4 of node1:2: nothing is placed, resumed or migrated there until `flexium undrain node1:2`",
        "  gpu-a: migrate (command 1) [queued]: moving gpu-a to GPU 0",
        "  gpu-a: migrate (command 1) [running]: moving gpu-a to GPU 0",
        "  gpu-b: pause (command 2) [queued]: pause note",
        "  gpu-a: migrate (command 1) [succeeded]: moving gpu-a to GPU 0",
        "  gpu-b: pause (command 2) [succeeded]: pause note",
        "drain 4: drained: 1 moved, 1 paused (queued to resume when free), 1 left where they are (named above)",
    ]
    assert err.splitlines() == [
        "  gpu-c: not moved: left where it is: it uses several GPUs",
        "flexium: drain 4: 1 job(s) still on node1:2: gpu-c (named above with why); the drain stays, so nothing new "
        "goes there: move or pause them yourself, or `flexium undrain node1:2`",
    ]


def test_the_summary_counts_each_job_by_its_last_move_and_names_what_remains() -> None:
    shown = drain(
        "draining",
        moves=[
            move("gpu-a", "migrate", "failed", 1),
            move("gpu-a", "pause", "succeeded", 3),  # its migrate failed, the pause that followed did not
            move("gpu-b", "migrate", "running", 2),  # under way: neither done nor failed
            move("gpu-c", "migrate", None, 4),  # forgotten: its command is gone
        ],
        remaining=["gpu-d"],
    )
    assert drain_cli.summary(shown) == (
        "drain 4: draining: 0 moved, 1 paused (queued to resume when free), 1 left where they are (named above), "
        "still to move: gpu-d"
    )
    assert (
        drain_cli.move_line(move("gpu-c", "migrate", None, 4))
        == "  gpu-c: migrate (command 4) [forgotten]: migrate note"
    )
    # failed: its note was the plan, the refusal after it says why
    assert drain_cli.move_line(move("gpu-a", "migrate", "failed", 1)) == (
        "  gpu-a: migrate (command 1) [failed]: planned as: migrate note"
    )
    job_rank = move("run-7-rank-0", "pause", "queued", 5).model_copy(update={"job_key": "run-7"})
    assert drain_cli.move_line(job_rank).startswith("  job run-7: pause (command 5) [queued]")


def test_a_drain_still_under_way_after_the_timeout_fails_saying_how_to_see_it(
    capsys: pytest.CaptureFixture[str],
) -> None:
    under_way = drain(moves=[move("gpu-a", "migrate", "running", 1)])
    assert run(Server(under_way, [under_way] * 5), "drain", "node1:2", "--timeout", "0.01") == EXIT_FAILED
    err = capsys.readouterr().err
    assert "drain 4: moves still under way after 0 s (`flexium drain` again shows them; GET /drains/4)" in err

    assert run(Server(under_way, []), "drain", "node1:2", "--no-wait") == EXIT_OK  # no read: nothing followed
    assert capsys.readouterr().out.splitlines()[-1].startswith("drain 4: draining: 0 moved")


def test_json_prints_the_drain_as_it_ended_and_nothing_else(capsys: pytest.CaptureFixture[str]) -> None:
    done = drain("drained", moves=[move("gpu-a", "migrate", "succeeded", 1)])
    assert run(Server(drain(), [done]), "drain", "node1", "--json") == EXIT_OK
    out, err = capsys.readouterr()
    assert json.loads(out)["state"] == "drained" and json.loads(out)["moves"][0]["process_id"] == "gpu-a"
    assert err == ""


def test_json_after_the_timeout_is_the_drain_alone_the_failure_on_stderr(capsys: pytest.CaptureFixture[str]) -> None:
    under_way = drain(moves=[move("gpu-a", "migrate", "running", 1)])
    assert run(Server(under_way, [under_way]), "drain", "node1:2", "--json", "--timeout", "0.01") == EXIT_FAILED
    out, err = capsys.readouterr()
    assert json.loads(out)["state"] == "draining"  # one JSON document: a script reads what is under way
    assert "moves still under way after 0 s" in err


def test_undrain_ends_every_drain_a_host_or_gpu_names(capsys: pytest.CaptureFixture[str]) -> None:
    whole = drain(id=5, gpu_uuid=None, gpu_index=None)
    by_index, by_uuid = drain(id=6), drain(id=7, gpu_uuid="GPU-0003", gpu_index=3)
    server = Server(drain(), [], (by_index, by_uuid))
    assert run(server, "undrain", "node1:2") == EXIT_OK
    assert run(server, "undrain", "node1:GPU-0003") == EXIT_OK
    assert server.ended == [6, 7]
    assert capsys.readouterr().out.splitlines() == [
        "undrained node1:2 (drain 6): jobs may be placed and resumed there again",
        "undrained node1:3 (drain 7): jobs may be placed and resumed there again",
    ]
    everything = Server(drain(), [], (by_index, by_uuid))
    assert run(everything, "undrain", "node1") == EXIT_OK
    assert everything.ended == [6, 7]

    assert run(Server(drain(), [], (whole,)), "undrain", "node1:2") == EXIT_FAILED
    assert "node1 is drained as a whole (drain 5): `flexium undrain node1`" in capsys.readouterr().err
    assert run(Server(drain(), []), "undrain", "node1:2") == EXIT_FAILED
    assert "node1:2 is not drained (`flexium drain` drains it)" in capsys.readouterr().err


@pytest.mark.parametrize("reason", ["x" * 3000, "two\nlines"])
def test_a_reason_the_server_would_refuse_is_a_usage_error_before_anything_is_sent(reason: str) -> None:
    server = Server(drain(), [])
    with pytest.raises(UsageError, match="^--reason: "):  # exit status 2 (cli/connection.py)
        run(server, "drain", "node1", "--reason", reason)
    assert server.requests == []
