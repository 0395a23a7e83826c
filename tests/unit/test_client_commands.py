"""The control thread against a stub server that hands out commands this client cannot read
(a newer server's kind, a field of another shape, a body without an id), while a training
loop runs beside it: each readable one is reported failed once, with a message that says
what to do, a repeated delivery gets the same answer, and the next command runs."""

from __future__ import annotations

import json
import logging
import socket
import threading
import time
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from types import SimpleNamespace
from typing import Any

import pytest

from flexium import __version__, protocol, wire
from flexium.client import ApiClient, ProcessClient
from flexium.config import parse_server_address
from flexium.engine import nvml
from flexium.engine.operations import EngineState, GpuIdentity, OperationKind, OperationResult

pytestmark = pytest.mark.timeout(60)

WORKSPACE = "unit"
PROCESS_ID = "gpu-commands"
GPU = GpuIdentity(
    ordinal=0, uuid="GPU-unit0000", name="NVIDIA H200", total_memory=1 << 37, pci_bus_id="0000:01:00.0", nvml_index=0
)


def _command(command_id: int, kind: str, **fields: Any) -> dict[str, Any]:
    return {
        "id": command_id,
        "kind": kind,
        "process_id": PROCESS_ID,
        "state": "queued",
        "target_uuid": None,
        "created_at": 1000.0 + command_id,
        "delivered_at": None,
        "started_at": None,
        "finished_at": None,
        "deliveries": 0,
        "result": None,
        "error": None,
        **fields,
    }


def _process() -> dict[str, Any]:
    return {
        "process_id": PROCESS_ID,
        "host": "unit-host",
        "user": "",
        "pid": 1,
        "state": "RUNNING",
        "reported_state": "RUNNING",
        "stale": False,
        "gpu_uuid": GPU.uuid,
        "gpu_model": GPU.name,
        "gpu_index": 0,
        "logical_device": "cuda:0",
        "physical_device": "cuda:0",
        "visible_gpus": [GPU.uuid],
        "torch_version": "",
        "driver_version": "",
        "flexium_version": __version__,
        "capabilities": {},
        "memory_bytes": 0,
        "footprint_bytes": 0,
        "started_at": None,
        "registered_at": 0.0,
        "last_seen": 0.0,
        "cmdline": "",
        "active_command": None,
    }


class StubServer:
    """What the real server does with commands, on the paths the process client uses: the
    long-poll hands out the oldest command not finished, again and again until a final report
    comes (``redeliver`` ids once more after it, as after a lost answer); a report's answer is
    the stored command, whatever its kind."""

    def __init__(self) -> None:
        self.commands: list[dict[str, Any]] = []
        self.reports: list[tuple[int, dict[str, Any]]] = []
        self.redeliver: set[int] = set()
        self.polls = 0
        self.beats = 0
        self.refuse_reports = False  # 503 to every report, as a busy server's share for others
        self.refused_reports = 0
        self.changed = threading.Condition()
        self.httpd = ThreadingHTTPServer(("127.0.0.1", 0), self._handler())
        self.httpd.daemon_threads = True
        threading.Thread(target=self.httpd.serve_forever, name="stub-server", daemon=True).start()

    @property
    def address(self) -> str:
        return f"127.0.0.1:{self.httpd.server_address[1]}/{WORKSPACE}"

    def queue(self, command: dict[str, Any]) -> None:
        with self.changed:
            self.commands.append(command)
            self.changed.notify_all()

    def reports_on(self, command_id: int) -> list[dict[str, Any]]:
        with self.changed:
            return [body for cid, body in self.reports if cid == command_id]

    def next_command(self, wait: float) -> dict[str, Any] | None:
        deadline = time.monotonic() + min(wait, 0.5)
        with self.changed:
            self.polls += 1
            while True:
                pending = [c for c in self.commands if c["state"] in ("queued", "delivered")]
                if pending:
                    command = pending[0]
                    command["state"] = "delivered"
                    command["deliveries"] += 1
                    return dict(command)
                left = deadline - time.monotonic()
                if left <= 0:
                    return None
                self.changed.wait(left)

    def report(self, command_id: int, body: dict[str, Any]) -> dict[str, Any] | None:
        with self.changed:
            command = next((c for c in self.commands if c.get("id") == command_id), None)
            if command is None:
                return None
            self.reports.append((command_id, body))
            command["state"] = body["state"]
            command["error"] = body.get("error")
            if body["state"] != "running" and command_id in self.redeliver:
                self.redeliver.discard(command_id)
                command["state"] = "delivered"
            self.changed.notify_all()
            return dict(command)

    def _handler(self) -> type[BaseHTTPRequestHandler]:
        stub = self
        prefix = protocol.workspace_path(WORKSPACE)

        class Handler(BaseHTTPRequestHandler):
            def log_message(self, *_: Any) -> None:
                pass

            def _send(self, status: int, body: Any = None) -> None:
                data = b"" if body is None else json.dumps(body).encode()
                self.send_response(status)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(data)))
                self.end_headers()
                self.wfile.write(data)

            def _body(self) -> Any:
                return json.loads(self.rfile.read(int(self.headers.get("Content-Length") or 0)) or b"null")

            def do_GET(self) -> None:
                path, _, query = self.path.partition("?")
                if path == prefix + protocol.PATH_NEXT_COMMAND.format(process_id=PROCESS_ID):
                    wait = float(dict(p.split("=") for p in query.split("&") if p).get("wait", "1"))
                    command = stub.next_command(wait)
                    self._send(204) if command is None else self._send(200, command)
                else:
                    self._send(404, {"error": "not_found", "message": self.path})

            def do_POST(self) -> None:
                body = self._body()
                if self.path == prefix + protocol.PATH_PROCESSES:
                    self._send(
                        201,
                        {
                            "process": _process(),
                            "heartbeat_interval_s": 0.2,
                            "poll_timeout_s": 1.0,
                            "stale_after_s": 30.0,
                            "server_time": time.time(),
                        },
                    )
                elif self.path == prefix + protocol.PATH_HEARTBEAT.format(process_id=PROCESS_ID):
                    stub.beats += 1
                    self._send(
                        200,
                        {"ok": True, "pending_command": None, "heartbeat_interval_s": 0.2, "server_time": time.time()},
                    )
                elif self.path.startswith(prefix + "/commands/") and self.path.endswith("/report"):
                    if stub.refuse_reports:
                        stub.refused_reports += 1
                        self._send(503, {"error": "unavailable", "message": "the server is busy"})
                        return
                    command = stub.report(int(self.path.split("/")[-2]), body)
                    self._send(404, {"error": "not_found", "message": "no such command"}) if command is None else (
                        self._send(200, command)
                    )
                else:
                    self._send(404, {"error": "not_found", "message": self.path})

            def do_DELETE(self) -> None:
                self._send(204)

        return Handler

    def close(self) -> None:
        self.httpd.shutdown()
        self.httpd.server_close()


class PausingEngine:
    """Pauses and resumes at once; records what it was asked."""

    def __init__(self) -> None:
        self.state = EngineState.RUNNING
        self.gpus = [GPU]
        self.calls: list[str] = []

    def _done(self, kind: OperationKind) -> OperationResult:
        self.calls.append(kind.value)
        return OperationResult(
            kind=kind, path="driver", ok=True, logical_device="cuda:0", source=GPU, target=None, seconds=0.01
        )

    def pause(self) -> OperationResult:
        self.state = EngineState.PAUSED
        return self._done(OperationKind.PAUSE)

    def resume(self, target: str | None = None) -> OperationResult:
        self.state = EngineState.RUNNING
        return self._done(OperationKind.RESUME)

    def migrate(self, target: str) -> OperationResult:
        return self._done(OperationKind.MIGRATE)

    def add_state_listener(self, listener: Any) -> None:
        pass


class Reporter:
    def register_body(self, _gpus: Any) -> wire.RegisterRequest:
        return wire.RegisterRequest(
            process_id=PROCESS_ID, host="unit-host", state="RUNNING", capabilities=self.capabilities()
        )

    def heartbeat_body(self, _gpus: Any) -> wire.HeartbeatRequest:
        return wire.HeartbeatRequest(state="RUNNING")

    def process_update(self) -> wire.ProcessUpdate:
        return wire.ProcessUpdate(state="RUNNING", gpu_uuid=GPU.uuid)

    def capabilities(self) -> wire.ProcessCapabilities:
        return wire.ProcessCapabilities(pause_resume=True, migration=True, problems=[])


class Training:
    """Optimizer steps, as a training thread would take them beside the client's threads."""

    def __init__(self) -> None:
        self.steps = 0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="training", daemon=True)
        self._thread.start()

    def _run(self) -> None:
        while not self._stop.wait(0.005):
            self.steps += 1

    def keeps_stepping(self) -> bool:
        before = self.steps
        return _wait_for(lambda: self.steps > before + 5, 5.0)

    def stop(self) -> None:
        self._stop.set()
        self._thread.join(5)


class Records(logging.Handler):
    def __init__(self) -> None:
        super().__init__(logging.DEBUG)
        self.records: list[logging.LogRecord] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.records.append(record)

    def warnings(self) -> list[str]:
        return [r.getMessage() for r in self.records if r.levelno == logging.WARNING]


def _wait_for(condition: Any, timeout: float) -> bool:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if condition():
            return True
        time.sleep(0.01)
    return bool(condition())


@pytest.fixture
def setup(
    monkeypatch: pytest.MonkeyPatch,
) -> Iterator[tuple[StubServer, ProcessClient, PausingEngine, Training, Records]]:
    monkeypatch.setattr(nvml, "host_gpus", lambda: [])
    stub = StubServer()
    engine = PausingEngine()
    training_process = SimpleNamespace(
        config=None, engine=engine, process_id=PROCESS_ID, logical_device="cuda:0", capabilities=None
    )
    records = Records()
    logger = logging.getLogger("flexium.client")
    logger.addHandler(records)
    client = ProcessClient(
        training_process,  # type: ignore[arg-type]
        ApiClient(parse_server_address(stub.address), "flx_unit"),
        reporter=Reporter(),  # type: ignore[arg-type]
    ).start()
    training = Training()
    try:
        assert client.wait_registered(10)
        yield stub, client, engine, training, records
    finally:
        client.stop()
        training.stop()
        logger.removeHandler(records)
        stub.close()


@pytest.mark.parametrize(
    "unreadable, problem",
    [
        (
            _command(1, "defrag"),
            f"this flexium (version {__version__}) cannot run command kind 'defrag' sent by the server; "
            "upgrade flexium in the job",
        ),
        (
            _command(1, "resume", target_uuid=["GPU-a", "GPU-b"]),
            f"this flexium (version {__version__}) cannot read the command the server sent (target_uuid: ",
        ),
    ],
    ids=["unknown kind", "field of another shape"],
)
def test_an_unreadable_command_is_reported_failed_once_and_the_next_one_runs(
    setup: tuple[StubServer, ProcessClient, PausingEngine, Training, Records],
    unreadable: dict[str, Any],
    problem: str,
) -> None:
    stub, client, engine, training, records = setup
    stub.redeliver.add(1)  # its failed report's answer is lost once: the server hands it out again
    stub.queue(unreadable)
    stub.queue(_command(2, "pause"))
    assert _wait_for(lambda: [r["state"] for r in stub.reports_on(2)] == ["running", "succeeded"], 10)

    answers = stub.reports_on(1)
    assert len(answers) == 2 and answers[0] == answers[1], answers  # the same answer to the re-delivery
    assert answers[0]["state"] == "failed" and answers[0]["error"].startswith(problem), answers[0]
    assert answers[0]["process"]["state"] == "RUNNING"  # where the process is, as in every final report
    assert engine.calls == ["pause"]
    assert [w for w in records.warnings() if "command 1" in w] == [f"command 1: {answers[0]['error']}"]
    assert not any("could not report" in w for w in records.warnings())  # the answer naming its kind is not read

    stub.queue(_command(3, "resume"))
    assert _wait_for(lambda: [r["state"] for r in stub.reports_on(3)] == ["running", "succeeded"], 10)
    assert engine.calls == ["pause", "resume"]
    assert training.keeps_stepping()
    assert all(t.is_alive() for t in client._threads)


def test_a_command_without_a_readable_id_is_logged_once_and_polled_with_backoff(
    setup: tuple[StubServer, ProcessClient, PausingEngine, Training, Records],
) -> None:
    stub, client, engine, training, records = setup
    nameless = _command(0, "defrag")
    del nameless["id"]
    stub.queue(nameless)
    time.sleep(1.5)
    with stub.changed:
        polls = stub.polls
        nameless["state"] = "expired"  # the server's TTL ends it
    warnings = [w for w in records.warnings() if "cannot read" in w]
    assert len(warnings) == 1 and "the next command" in warnings[0] and "id: " in warnings[0], warnings
    assert polls < 15, polls  # backoff waits between polls, not a hot loop
    assert stub.reports == []

    stub.queue(_command(4, "pause"))
    assert _wait_for(lambda: [r["state"] for r in stub.reports_on(4)] == ["running", "succeeded"], 10)
    assert engine.calls == ["pause"]
    assert training.keeps_stepping()


def test_a_command_target_is_logged_in_the_jobs_own_numbering(
    setup: tuple[StubServer, ProcessClient, PausingEngine, Training, Records],
) -> None:
    """The command names its GPU by UUID only; the job's log shows it as cuda:N when it sees
    that GPU (wire.cuda_ordinal, as the server and the CLI show it), else as the UUID."""
    stub, client, engine, training, records = setup
    logger = logging.getLogger("flexium.client")
    level = logger.level
    logger.setLevel(logging.INFO)
    try:
        stub.queue(_command(5, "migrate", target_uuid=GPU.uuid))
        stub.queue(_command(6, "migrate", target_uuid="GPU-not-mine"))
        assert _wait_for(lambda: len(stub.reports_on(6)) == 2, 10)
    finally:
        logger.setLevel(level)
    said = [r.getMessage() for r in records.records]
    assert any(m.startswith("command 5: migrate to cuda:0 ") for m in said), said
    assert any(m.startswith("command 6: migrate to GPU-not-mine ") for m in said), said


def test_heartbeats_go_on_while_a_report_is_retried(
    setup: tuple[StubServer, ProcessClient, PausingEngine, Training, Records],
) -> None:
    """A server that refuses the job's reports (503) but takes its heartbeats: the outcome is
    retried without holding back the heartbeats, else the job would look stale, and then lands."""
    stub, client, engine, training, records = setup
    stub.refuse_reports = True
    stub.queue(_command(7, "pause"))
    assert _wait_for(lambda: engine.calls == ["pause"] and stub.refused_reports >= 3, 20)
    beats = stub.beats
    assert _wait_for(lambda: stub.beats >= beats + 3, 5), "no heartbeat while the report was retried"
    assert stub.reports_on(7) == []
    stub.refuse_reports = False
    assert _wait_for(lambda: [r["state"] for r in stub.reports_on(7)] == ["succeeded"], 20)
    assert training.keeps_stepping()


def test_stop_is_bounded_when_the_name_lookup_hangs(
    setup: tuple[StubServer, ProcessClient, PausingEngine, Training, Records], monkeypatch: pytest.MonkeyPatch
) -> None:
    """At exit the unregister opens a connection of its own, whose name lookup no request timeout
    bounds: a resolver that does not answer must not hold the process's exit."""
    stub, client, engine, training, records = setup
    real = socket.getaddrinfo

    def hanging(*args: Any, **kwargs: Any) -> Any:
        time.sleep(30)
        return real(*args, **kwargs)

    monkeypatch.setattr(socket, "getaddrinfo", hanging)
    started = time.monotonic()
    client.stop(timeout=0.5)
    assert time.monotonic() - started < 2.0


def test_a_registration_the_server_refuses_is_said_at_error_once(caplog: pytest.LogCaptureFixture) -> None:
    """A refusal (4xx) is about this process, not a passing outage: it is logged at ERROR with
    the server's reason, once however often the registration is tried again."""
    from flexium.client.http import Refused

    class RefusingApi:
        base_url, workspace = "http://127.0.0.1:9", "default"
        tries = 0

        def register(self, body: Any, *, timeout: float) -> Any:
            RefusingApi.tries += 1
            raise Refused("request: cmdline: Input should be a valid string", code="invalid_request", status=422)

    training = SimpleNamespace(engine=None, process_id="cpu-1", logical_device="cpu", capabilities=None, config=None)
    client = ProcessClient(training, RefusingApi())  # type: ignore[arg-type]
    with caplog.at_level(logging.DEBUG, logger="flexium.client"):
        assert not client._register() and not client._register()
    errors = [r for r in caplog.records if r.levelno == logging.ERROR]
    assert RefusingApi.tries == 2 and len(errors) == 1
    assert "refused to register this process (request: cmdline: Input should be a valid string)" in errors[0].message
