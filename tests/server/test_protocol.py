"""The shared wire format: addresses, and the server's pydantic models mirroring the
protocol's TypedDicts (the client side imports only ``flexium.protocol``)."""

from __future__ import annotations

import subprocess
import sys
from typing import Any, get_type_hints

import pytest

from flexium import protocol
from flexium.server import schemas


@pytest.mark.parametrize("text,expected", [
    ("app.flexium.ai/myworkspace", ("http", "app.flexium.ai", 8080, "myworkspace")),
    ("localhost:9000/default", ("http", "localhost", 9000, "default")),
    ("https://gpu.example.org:443/team-a/", ("https", "gpu.example.org", 443, "team-a")),
    ("[::1]:8081/x", ("http", "::1", 8081, "x")),
    ("10.0.0.5/ws_1", ("http", "10.0.0.5", 8080, "ws_1")),
])
def test_parse_server_address(text: str, expected: tuple[str, str, int, str]) -> None:
    a = protocol.parse_server_address(text)
    assert (a["scheme"], a["host"], a["port"], a["workspace"]) == expected


def test_base_url_and_paths() -> None:
    a = protocol.parse_server_address("[::1]:8081/x")
    assert protocol.base_url(a) == "http://[::1]:8081"
    assert protocol.workspace_path("x") + protocol.PATH_NEXT_COMMAND.format(process_id="gpu-1") == \
        "/api/w/x/processes/gpu-1/commands/next"


@pytest.mark.parametrize("text", ["", "host", "host/", "host:99999/x", "host:abc/x", ":80/x", "host/Bad Name",
                                  "[::1/x"])
def test_parse_server_address_errors(text: str) -> None:
    with pytest.raises(ValueError, match="server address"):
        protocol.parse_server_address(text)


@pytest.mark.parametrize("typed,model", [
    (protocol.RegisterRequest, schemas.RegisterIn), (protocol.HeartbeatRequest, schemas.HeartbeatIn),
    (protocol.CommandRequest, schemas.CommandIn), (protocol.CommandReport, schemas.CommandReportIn),
    (protocol.ProcessUpdate, schemas.ProcessUpdateIn), (protocol.GpuReport, schemas.GpuReportIn),
    (protocol.CommandInfo, schemas.CommandOut), (protocol.ProcessInfo, schemas.ProcessOut),
    (protocol.RegisterResponse, schemas.RegisterOut), (protocol.HeartbeatResponse, schemas.HeartbeatOut),
    (protocol.DeviceInfo, schemas.DeviceOut), (protocol.HostInfo, schemas.HostOut),
    (protocol.DevicesResponse, schemas.DevicesOut), (protocol.ErrorBody, schemas.ErrorOut),
    (protocol.TargetInfo, schemas.TargetOut),
])
def test_schemas_mirror_protocol(typed: Any, model: Any) -> None:
    assert set(get_type_hints(typed)) == set(model.model_fields)


def test_state_literals_match() -> None:
    from typing import get_args

    assert get_args(schemas.ProcessState) == protocol.PROCESS_STATES
    assert get_args(schemas.DisplayState) == protocol.DISPLAY_STATES
    assert get_args(schemas.CommandKind) == protocol.COMMAND_KINDS
    assert get_args(schemas.CommandState) == protocol.COMMAND_STATES
    assert get_args(schemas.ReportState) == protocol.REPORT_STATES
    assert set(protocol.ERROR_STATUS) >= {"unauthorized", "not_found", "invalid_state", "busy", "target_refused",
                                          "capability", "invalid_request", "payload_too_large"}


def test_protocol_imports_without_server_packages() -> None:
    """The training side has no pydantic, fastapi or sqlalchemy: protocol must not need them."""
    code = ("import sys\n"
            "class Block:\n"
            "    def find_spec(self, name, path=None, target=None):\n"
            "        if name.split('.')[0] in ('pydantic', 'fastapi', 'sqlalchemy', 'starlette', 'alembic'):\n"
            "            raise ImportError('blocked ' + name)\n"
            "sys.meta_path.insert(0, Block())\n"
            "import flexium.protocol as p\n"
            "print(p.parse_server_address('h:1/w')['port'])\n")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "1"
