"""The training process's client in this test process, against the real server: engine
refusals and failures come back as failed commands with the engine's message, and neither
start nor stop waits for a server that is down or never answers."""

from __future__ import annotations

import logging
import socket
import time
from collections.abc import Iterator
from types import SimpleNamespace
from typing import Any

import pytest

from flexium import wire
from flexium.client import ApiClient, ProcessClient, start_client
from flexium.client.http import DEFAULT_TIMEOUT_S
from flexium.client.process import REGISTER_TIMEOUT_S
from flexium.config import parse_server_address
from flexium.engine.operations import EngineState, GpuIdentity, OperationKind, OperationResult
from flexium.errors import (
    CapabilityError,
    InvalidStateError,
    OperationFailedError,
    OperationInProgressError,
    TargetRefusedError,
)
from support.e2e import HEARTBEAT_S, WORKSPACE, Server, wait_until

pytestmark = pytest.mark.timeout(120)

GIB = 1 << 30
GPUS = [
    GpuIdentity(
        ordinal=i,
        uuid=f"GPU-e2e0000{i}",
        name="NVIDIA H200",
        total_memory=140 * GIB,
        pci_bus_id=f"0000:0{i}:00.0",
        nvml_index=i,
    )
    for i in range(2)
]


class ScriptedEngine:
    """Raises what the test queues, in order, whatever the operation."""

    def __init__(self) -> None:
        self.state = EngineState.RUNNING
        self.gpus = GPUS
        self.outcomes: list[BaseException] = []
        self.calls: list[tuple[str, Any]] = []

    def _next(self, kind: str, target: Any) -> OperationResult:
        self.calls.append((kind, target))
        raise self.outcomes.pop(0)

    def migrate(self, target: Any) -> OperationResult:
        return self._next("migrate", target)

    def pause(self) -> OperationResult:
        return self._next("pause", None)

    def resume(self, target: Any = None) -> OperationResult:
        return self._next("resume", target)

    def add_state_listener(self, listener: Any) -> None:
        pass


class ScriptedReporter:
    """A movable process on a host with two H200s, whatever this machine has."""

    def __init__(self, process_id: str) -> None:
        self.process_id = process_id

    def register_body(self, _gpus: Any) -> wire.RegisterRequest:
        return wire.RegisterRequest.model_validate(
            {
                "process_id": self.process_id,
                "host": "e2e-host",
                "pid": 1,
                "gpu_uuid": GPUS[0].uuid,
                "gpu_model": "NVIDIA H200",
                "logical_device": "cuda:0",
                "visible_gpus": [g.uuid for g in GPUS],
                "capabilities": {"pause_resume": True, "migration": True},
                "memory_bytes": GIB,
                "state": "RUNNING",
                "devices": [
                    {
                        "uuid": g.uuid,
                        "index": g.ordinal,
                        "name": g.name,
                        "memory_total": g.total_memory,
                        "memory_used": GIB if g.ordinal == 0 else 0,
                        "health": "ok",
                    }
                    for g in GPUS
                ],
            }
        )

    def heartbeat_body(self, _gpus: Any) -> wire.HeartbeatRequest:
        return wire.HeartbeatRequest(state="RUNNING", memory_bytes=GIB)

    def process_update(self) -> wire.ProcessUpdate:
        return wire.ProcessUpdate(state="RUNNING", gpu_uuid=GPUS[0].uuid, memory_bytes=GIB)

    def capabilities(self) -> wire.ProcessCapabilities:
        return wire.ProcessCapabilities(pause_resume=True, migration=True, problems=[])


def _session(process_id: str, engine: ScriptedEngine | None, address: str, token: str | None) -> Any:
    from flexium.config import FlexiumConfig

    config = FlexiumConfig(orchestrator=address, token=token, address=parse_server_address(address))
    return SimpleNamespace(
        config=config, engine=engine, process_id=process_id, logical_device="cuda:0", capabilities=None
    )


@pytest.fixture
def scripted(server: Server) -> Iterator[tuple[ProcessClient, ScriptedEngine]]:
    engine = ScriptedEngine()
    session = _session("gpu-scripted", engine, server.address, server.token)
    client = ProcessClient(
        session, ApiClient(session.config.address, server.token), reporter=ScriptedReporter("gpu-scripted")
    ).start()  # type: ignore[arg-type]
    assert client.wait_registered(10)
    yield client, engine
    client.stop()


def _command(server: Server, kind: str, target: str | None = None) -> dict[str, Any]:
    body: dict[str, Any] = {"kind": kind, "process_id": "gpu-scripted"}
    if target:
        body["target"] = target
    r = server.post("/commands", body)
    assert r.status_code == 201, r.text
    done = server.get(f"/commands/{r.json()['id']}", params={"wait": 20}, timeout=30).json()
    assert done["state"] in ("succeeded", "failed"), done
    return done


def test_engine_refusals_are_failed_commands_with_the_message(
    server: Server, scripted: tuple[ProcessClient, ScriptedEngine]
) -> None:
    client, engine = scripted
    refusals = [
        TargetRefusedError("cuda:1 has 0.20 GiB free; the job needs 1.00 GiB"),
        OperationInProgressError("cannot pause: another operation is in progress (MIGRATING)"),
        CapabilityError("migration to another GPU is not available on this machine: driver 575"),
        InvalidStateError("cannot migrate: an earlier rollback failed"),
    ]
    kinds = ["migrate", "pause", "migrate", "migrate"]
    for kind, refusal in zip(kinds, refusals, strict=True):
        engine.outcomes.append(refusal)
        done = _command(server, kind, "cuda:1" if kind == "migrate" else None)
        assert done["state"] == "failed" and done["error"] == str(refusal)
    assert [k for k, _ in engine.calls] == kinds
    assert engine.calls[0][1] == GPUS[1].uuid  # the physical GPU, by UUID
    assert server.process("gpu-scripted")["state"] == "RUNNING"


def test_the_engine_gets_the_uuid_whatever_the_target_text(
    server: Server, scripted: tuple[ProcessClient, ScriptedEngine]
) -> None:
    """The server resolves cuda:N, an nvidia-smi index or a UUID once; the engine sees the UUID."""
    _, engine = scripted
    for target in ("1", GPUS[1].uuid, "cuda:1"):
        engine.outcomes.append(TargetRefusedError("refused by the test"))
        assert _command(server, "migrate", target)["state"] == "failed"
    assert [t for _, t in engine.calls] == [GPUS[1].uuid] * 3


def test_a_failed_operation_reports_its_timings(server: Server, scripted: tuple[ProcessClient, ScriptedEngine]) -> None:
    _, engine = scripted
    result = OperationResult(
        kind=OperationKind.MIGRATE,
        path="driver",
        ok=False,
        logical_device="cuda:0",
        source=GPUS[0],
        target=GPUS[1],
        seconds=0.25,
        failed_step="restore",
        error="phase 'restore' failed; rolled back",
    )
    engine.outcomes.append(
        OperationFailedError("migrate failed: phase 'restore' failed; rolled back", step="restore", result=result)
    )
    done = _command(server, "migrate", "cuda:1")
    assert done["state"] == "failed" and "rolled back" in done["error"]
    assert done["result"]["failed_step"] == "restore" and done["result"]["seconds"] == 0.25


def test_no_engine_refuses_every_command(server: Server) -> None:
    """A process that reports migration but has no engine (the server trusts its report)."""
    session = _session("gpu-noengine", None, server.address, server.token)

    class Reporter(ScriptedReporter):
        def capabilities(self) -> wire.ProcessCapabilities:
            return wire.ProcessCapabilities(pause_resume=False, migration=False, problems=["no NVIDIA driver"])

    client = ProcessClient(
        session, ApiClient(session.config.address, server.token), reporter=Reporter("gpu-noengine")
    ).start()  # type: ignore[arg-type]
    try:
        assert client.wait_registered(10)
        r = server.post("/commands", {"kind": "pause", "process_id": "gpu-noengine"})
        done = server.get(f"/commands/{r.json()['id']}", params={"wait": 20}, timeout=30).json()
        assert done["state"] == "failed" and "no NVIDIA driver" in done["error"]
    finally:
        client.stop()
    assert server.process("gpu-noengine") is None


@pytest.mark.parametrize("kind", ["refused", "black hole"])
def test_start_and_stop_never_wait_for_the_server(kind: str) -> None:
    """Connection refused, or a server that accepts connections and never answers."""
    listener = socket.socket()
    listener.bind(("127.0.0.1", 0))
    port = listener.getsockname()[1]
    if kind == "black hole":
        listener.listen(16)
    else:
        listener.close()
    try:
        session = _session("gpu-nowhere", ScriptedEngine(), f"127.0.0.1:{port}/e2e", "flx_x")
        # Bounds between what waiting would take (a registration's 2 s, a request's 10 s, to a server
        # that never answers) and what a machine shared with other work may add to doing nothing.
        started = time.monotonic()
        client = start_client(session)
        assert client is not None
        assert time.monotonic() - started < REGISTER_TIMEOUT_S / 2
        time.sleep(1.0)
        assert not client.registered
        started = time.monotonic()
        client.stop()
        assert time.monotonic() - started < DEFAULT_TIMEOUT_S / 2
        wait_until(lambda: not any(t.is_alive() for t in client._threads), 15, "the client threads to end")
    finally:
        listener.close()


def test_a_token_revoked_while_the_server_was_down_is_said_once_when_it_is_back(
    server: Server, caplog: pytest.LogCaptureFixture
) -> None:
    """As when `flexium demo` stops (its server goes, and the job token it printed is revoked) and is
    started again: the job first says the server cannot be reached, then, the server back, that its
    token is refused, once, at WARNING, with what to do, however often it tries again; it is not stopped."""
    from flexium.server import database_admin

    issued = server.post("/tokens", {"name": "a job of mine", "role": "job"})
    assert issued.status_code == 201, issued.text
    token = issued.json()["token"]
    session = _session("gpu-revoked", None, server.address, token)
    client = ProcessClient(session, ApiClient(session.config.address, token), reporter=ScriptedReporter("gpu-revoked"))
    client.start()  # type: ignore[arg-type]
    try:
        assert client.wait_registered(10)
        caplog.set_level("INFO", logger="flexium")
        server.stop()
        wait_until(lambda: any("training continues" in r.getMessage() for r in caplog.records), 30, "the outage")
        database_admin.revoke_token(WORKSPACE, token, database_url=server.database)
        server.start()

        def said() -> list[logging.LogRecord]:
            return [r for r in caplog.records if "refused this process's token" in r.getMessage()]

        wait_until(lambda: said(), 60, "the refused token to be said")
        time.sleep(6 * HEARTBEAT_S)  # it keeps trying: said no more
        [warning] = said()
        assert warning.levelname == "WARNING"
        message = warning.getMessage()
        assert "training continues without flexium's server; set FLEXIUM_TOKEN" in message, message
    finally:
        client.stop()
