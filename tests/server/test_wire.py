"""The shared wire format: addresses (``flexium.protocol``) and the body models
(``flexium.wire``) both sides use, with the limits the server enforces."""

from __future__ import annotations

import json
import re
import subprocess
import sys
from typing import Any

import pytest
from pydantic import ValidationError

from flexium import protocol, wire


@pytest.mark.parametrize(
    "text,expected",
    [
        ("gpu-server.example.com/myworkspace", ("http", "gpu-server.example.com", 8080, "myworkspace")),
        ("localhost:9000/default", ("http", "localhost", 9000, "default")),
        ("https://gpu.example.org:443/team-a/", ("https", "gpu.example.org", 443, "team-a")),
        ("[::1]:8081/x", ("http", "::1", 8081, "x")),
        ("10.0.0.5/ws_1", ("http", "10.0.0.5", 8080, "ws_1")),
    ],
)
def test_parse_server_address(text: str, expected: tuple[str, str, int, str]) -> None:
    a = protocol.parse_server_address(text)
    assert (a.scheme, a.host, a.port, a.workspace) == expected


def test_base_url_and_paths() -> None:
    a = protocol.parse_server_address("[::1]:8081/x")
    assert a.base_url == "http://[::1]:8081"
    assert str(a) == "http://[::1]:8081/x"
    assert (
        protocol.workspace_path("x") + protocol.PATH_NEXT_COMMAND.format(process_id="gpu-1")
        == "/api/w/x/processes/gpu-1/commands/next"
    )


@pytest.mark.parametrize(
    "text", ["", "host", "host/", "host:99999/x", "host:abc/x", ":80/x", "host/Bad Name", "[::1/x"]
)
def test_parse_server_address_errors(text: str) -> None:
    with pytest.raises(ValueError, match="server address"):
        protocol.parse_server_address(text)


def test_command_state_subsets_and_error_codes() -> None:
    finished = set(protocol.FINAL_COMMAND_STATES)
    assert set(protocol.PENDING_COMMAND_STATES) < set(protocol.ACTIVE_COMMAND_STATES)
    assert set(protocol.ACTIVE_COMMAND_STATES) | finished == set(protocol.COMMAND_STATES)
    assert not set(protocol.ACTIVE_COMMAND_STATES) & finished
    assert set(protocol.REPORT_STATES) <= set(protocol.COMMAND_STATES)
    assert set(protocol.ERROR_STATUS) >= {
        "unauthorized",
        "not_found",
        "invalid_state",
        "busy",
        "target_refused",
        "capability",
        "invalid_request",
        "payload_too_large",
    }


@pytest.mark.parametrize(
    "body",
    [
        {"process_id": "gpu-1", "host": "h", "pid": "42"},  # strict: a string is not a number
        {"process_id": "gpu-1", "host": "h", "user": "a\x00b"},  # NUL
        {"process_id": "gpu-1", "host": "h", "user": "x" * (protocol.MAX_SHORT_TEXT + 1)},
        {"process_id": "gpu-1", "host": "h", "cmdline": "x" * (protocol.MAX_LONG_TEXT + 1)},
        {"process_id": "gpu-1", "host": "h", "started_at": float("inf")},
        {"process_id": "gpu 1", "host": "h"},
        {"process_id": "gpu-1", "host": " "},
        {"process_id": "gpu-1", "host": "h", "memory_bytes": protocol.MAX_INT + 1},
        {
            "process_id": "gpu-1",
            "host": "h",
            "capabilities": {"a": {"b": {"c": {"d": {"e": {"f": {"g": {"h": {"i": 1}}}}}}}}},
        },
        {"process_id": "gpu-1", "host": "h", "capabilities": {"x": list(range(protocol.MAX_JSON_ITEMS + 1))}},
        {
            "process_id": "gpu-1",
            "host": "h",
            "devices": [{"uuid": f"GPU-{i}"} for i in range(protocol.MAX_DEVICES + 1)],
        },
    ],
)
def test_requests_are_refused_beyond_the_limits(body: dict[str, Any]) -> None:
    with pytest.raises(ValidationError):
        wire.RegisterRequest.model_validate(body)


def test_a_result_keeps_the_bounds_it_had_as_free_json() -> None:
    """Keys a side does not know are ignored but still bounded, and a result the client builds
    from models counts as the JSON it sends."""
    ok = {"kind": "pause", "path": "driver", "seconds": 0.5, "from_the_future": {"a": [1, 2]}}
    report = wire.CommandReport.model_validate({"state": "succeeded", "result": ok}).result
    assert report is not None and report.path == "driver" and not hasattr(report, "from_the_future")
    deep: dict[str, Any] = {"i": 1}
    for key in "abcdefgh":
        deep = {key: deep}
    for bad in (
        {"from_the_future": deep},
        {"from_the_future": list(range(protocol.MAX_JSON_ITEMS + 1))},
        {"from_the_future": "a\x00b"},
        {"notes": ["x" * (protocol.MAX_LONG_TEXT + 1)]},
        {"seconds": float("nan")},
        {"seconds": "1.5"},
    ):
        with pytest.raises(ValidationError):
            wire.CommandReport.model_validate({"state": "succeeded", "result": bad})
    with pytest.raises(ValidationError):
        wire.OperationReport(steps=[wire.StepReport(step="copy")] * (protocol.MAX_JSON_ITEMS // 6 + 1))


def test_unknown_fields_are_ignored_both_ways() -> None:
    """An older server accepts a newer client's body, and an older client reads a newer server's."""
    body = wire.RegisterRequest.model_validate({"process_id": "gpu-1", "host": "h", "from_the_future": 1})
    assert not hasattr(body, "from_the_future")
    command = wire.CommandInfo.model_validate(
        {
            "id": 1,
            "kind": "pause",
            "process_id": "gpu-1",
            "state": "queued",
            "target_uuid": None,
            "created_at": 1.0,
            "delivered_at": None,
            "started_at": None,
            "finished_at": None,
            "deliveries": 0,
            "result": None,
            "error": None,
            "target_rank": 3,
        }
    )
    assert command.id == 1


def test_a_target_is_text_or_an_integer() -> None:
    assert wire.CommandRequest(kind="migrate", process_id="p", target=2).target == 2
    assert wire.CommandRequest(kind="migrate", process_id="p", target="cuda:1").target == "cuda:1"
    with pytest.raises(ValidationError):
        wire.CommandRequest.model_validate({"kind": "migrate", "process_id": "p", "target": 1.5})


def test_the_client_side_imports_without_server_packages() -> None:
    """A training job's base install has no fastapi, sqlalchemy or alembic: the wire model,
    the client and the remote CLI must not need them."""
    code = (
        "import sys\n"
        "class Block:\n"
        "    def find_spec(self, name, path=None, target=None):\n"
        "        if name.split('.')[0] in ('fastapi', 'sqlalchemy', 'starlette', 'alembic', 'uvicorn'):\n"
        "            raise ImportError('blocked ' + name)\n"
        "sys.meta_path.insert(0, Block())\n"
        "import flexium.protocol as p, flexium.wire, flexium.client, flexium.cli.main\n"
        "print(p.parse_server_address('h:1/w').port)\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "1"


def test_an_older_client_that_sends_the_derived_location_is_not_refused() -> None:
    """gpu_index and physical_device left the requests (the server derives them from gpu_uuid);
    a client from before still sends them, and they are ignored, not refused."""
    old = {"gpu_uuid": "GPU-0001", "gpu_index": 1, "physical_device": "cuda:1"}
    register = wire.RegisterRequest.model_validate({"process_id": "gpu-1", "host": "h", **old})
    beat = wire.HeartbeatRequest.model_validate({"state": "RUNNING", **old})
    update = wire.ProcessUpdate.model_validate(old)
    for body in (register, beat, update):
        assert body.gpu_uuid == "GPU-0001"
        assert not {"gpu_index", "physical_device"} & set(body.model_dump())


def test_cuda_ordinal_is_the_position_in_visible_gpus() -> None:
    visible = ["GPU-b", "GPU-a"]
    assert wire.cuda_ordinal(visible, "GPU-a") == "cuda:1"
    assert wire.cuda_ordinal(visible, "GPU-b") == "cuda:0"
    assert wire.cuda_ordinal(visible, "GPU-c") is None
    assert wire.cuda_ordinal(visible, None) is None
    assert wire.cuda_ordinal([], "GPU-a") is None


def test_clean_text_keeps_what_it_can_of_text_that_is_not_utf8() -> None:
    assert wire.clean_text("plain") == "plain"
    assert wire.clean_text("donn\udce9es.csv") == "donn\ufffdes.csv"  # surrogateescape'd byte 0xE9
    assert wire.clean_text("a\x00b") == "a\ufffdb"
    cleaned = wire.clean_text("x\ud800y")
    cleaned.encode("utf-8")  # valid now
    assert cleaned.startswith("x") and cleaned.endswith("y")


def test_an_answer_built_from_text_that_is_not_valid_is_cleaned_not_refused() -> None:
    token = wire.TokenInfo.model_validate(
        {
            "id": 1,
            "name": "bad \udcff",
            "prefix": "flx_",
            "role": "admin",
            "created_at": 1.0,
            "revoked_at": None,
            "revoked": False,
        }
    )
    assert token.name == "bad \ufffd" and json.loads(token.model_dump_json())["name"] == "bad \ufffd"


def test_a_lone_surrogate_in_a_request_is_refused_naming_it() -> None:
    body = {"process_id": "gpu-1", "host": "node", "cmdline": "train.py donn\udce9es.csv"}
    with pytest.raises(ValidationError, match="unable to parse raw data as a unicode string"):
        wire.RegisterRequest.model_validate(body)  # pydantic's own check of a text field
    # Anywhere in the JSON a peer sends, the keys this side ignores included:
    with pytest.raises(ValidationError, match="U\\+DCFF at position 4 is a lone surrogate"):
        wire.ProcessCapabilities.model_validate({"a_newer_field": ["bad \udcff"]})


def test_a_refusal_inside_free_json_says_where_it_is() -> None:
    """A result's or capabilities' validation error names only the field holding them: the
    message says where inside."""
    cases = [
        (wire.ProcessCapabilities, {"problems": ["fine", "a\x00b"]}, "problems.1: must not contain NUL"),
        (wire.ProcessCapabilities, {"newer": {"deep": ["bad \udcff"]}}, "newer.deep.0: must be valid Unicode"),
        (wire.ProcessCapabilities, {"newer": {"key\x00": 1}}, "newer.(a key): must not contain NUL"),
        (wire.OperationReport, {"steps": [{"step": "x" * (protocol.MAX_LONG_TEXT + 1)}]}, "steps.0.step: a string"),
        (wire.OperationReport, {"newer": 1 << 63}, "newer: a number is out of range"),
    ]
    for model, body, where in cases:
        with pytest.raises(ValidationError, match=re.escape(where)):
            model.model_validate(body)


def test_how_long_a_command_took_is_the_operations_measure_else_the_servers_clock() -> None:
    """One rule for the dashboard's outcomes, `flexium jobs`' TIME and the migration-duration metric."""

    def command(result: dict[str, Any] | None, started: float | None, finished: float | None) -> wire.CommandInfo:
        return wire.CommandInfo(
            id=1,
            kind="pause",
            process_id="gpu-1",
            state="succeeded" if finished is not None else "running",
            target_uuid=None,
            created_at=100.0,
            delivered_at=100.5,
            started_at=started,
            finished_at=finished,
            deliveries=1,
            result=None if result is None else wire.OperationReport.model_validate(result),
            error=None,
        )

    assert command({"seconds": 1.25}, 101.0, 109.0).took_s == 1.25  # the job's own measure, not the 8 s around it
    assert command({"seconds": -1.0}, 101.0, 109.0).took_s == 8.0  # a measure that cannot be: the server's clock
    assert command({}, 101.0, 104.5).took_s == 3.5
    assert command(None, 101.0, None).took_s is None  # not ended
    assert command(None, None, 104.0).took_s is None  # ended before it started (expired, cancelled)
