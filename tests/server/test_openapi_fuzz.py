"""A property-based fuzz of every operation the server's OpenAPI description declares
(schemathesis generating requests from ``/openapi.json``, hypothesis driving it), against a real
server process over HTTP (``python -m flexium.server``: uvicorn, the middleware, the real
database), on SQLite and on PostgreSQL.

Every answer must be: no 5xx, a status code the description declares for that operation, a body
that conforms to the declared schema and content type. Requests carry the workspace's admin
token, so they reach the operations past authentication, and then an invalid token, which must
never be let through. The workspace is seeded with processes, a job of two ranks, a command, a
job operation and a spare token, and a third of the requests name those rows, so path
parameters hit real rows and not only 404s.

Bounded and reproducible for CI: ``EXAMPLES`` requests per operation, generation mode (valid and
invalid data) and token on PostgreSQL, derandomized (the same requests every run and on either
database); SQLite gets half as many, which must still reach every operation. The schema, the
routes and their answers are the same code on either database; what the database adds to the
fuzz is what its driver refuses, and PostgreSQL refuses more (NUL characters, integers past 32
bits in an integer column), so the full sample goes there (the storage rules on both databases
are the other server tests' subject). The workspace is seeded again before each round that
follows one which may have changed its rows: a round of valid data (invalid data must change
nothing: a 2xx to it fails the test). A long-poll's wait is cut
to a few milliseconds and the server's own poll timeout is short, so no request idles for
seconds. The figures of each run (requests tried, status classes, operations covered) are
printed and, where ``FLEXIUM_RELIABILITY_FIGURES`` names a folder, written there as JSON
(docs/reliability.md quotes them).
"""

from __future__ import annotations

import collections
import os
import signal
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest
import requests

schemathesis = pytest.importorskip("schemathesis", reason='schemathesis is in the test extra: pip install ".[test]"')

import hypothesis  # noqa: E402
from hypothesis import HealthCheck, Phase  # noqa: E402
from hypothesis import strategies as st  # noqa: E402
from schemathesis import GenerationMode  # noqa: E402
from schemathesis.checks import not_a_server_error  # noqa: E402
from schemathesis.core.parameters import ParameterLocation  # noqa: E402
from schemathesis.specs.openapi.checks import (  # noqa: E402
    content_type_conformance,
    negative_data_rejection,
    response_schema_conformance,
    status_code_conformance,
)

from support.server import LiveServer, gpu, process_body, rank_body, report_figures  # noqa: E402

EXAMPLES = int(os.environ.get("FLEXIUM_FUZZ_EXAMPLES", "50"))
WORKSPACE = "default"
INVALID_TOKEN = "flx_" + "0" * 43
CHECKS = [not_a_server_error, status_code_conformance, response_schema_conformance, content_type_conformance]
MAX_WAIT_S = 0.01  # what a generated long-poll may wait
PAUSED_HOST = "full-node"

pytestmark = [pytest.mark.timeout(900), pytest.mark.started_first]


@dataclass
class Seeded:
    """The rows the fuzz names in path parameters and bodies (and its own credentials, which it
    keeps). Each round of seeding has rows of its own: the fuzz may have unregistered, finished or
    revoked the last round's."""

    token: str
    token_id: int
    spare_token_id: int = 0
    process_id: str = ""
    idle_process_id: str = ""  # a process with no command yet, for the bodies of new commands
    paused_process_id: str = ""  # a paused one on a full host, for the bodies of new waits
    wait_id: int = 0
    placement_id: int = 0
    drain_id: int = 0
    drain_host: str = ""  # a host of its own with a drained GPU (0) and free ones, for new drains
    command_id: int = 0
    operation_id: int = 0
    rounds: int = 0


@dataclass
class Figures:
    database: str
    examples: int  # per operation, generation mode and valid token
    requests: int = 0
    by_status: collections.Counter[int] = field(default_factory=collections.Counter)
    by_operation: dict[str, collections.Counter[int]] = field(default_factory=dict)
    failures: list[str] = field(default_factory=list)

    def count(self, label: str, status: int) -> None:
        self.requests += 1
        self.by_status[status] += 1
        self.by_operation.setdefault(label, collections.Counter())[status] += 1

    def summary(self) -> dict[str, Any]:
        classes = collections.Counter(f"{status // 100}xx" for status in self.by_status.elements())
        return {
            "database": self.database,
            "examples_per_operation_mode_token": self.examples,
            "requests": self.requests,
            "status_classes": dict(sorted(classes.items())),
            "server_errors": classes.get("5xx", 0),
            "operations": len(self.by_operation),
            "operations_answered_2xx": sum(
                1 for counts in self.by_operation.values() if any(200 <= s < 300 for s in counts)
            ),
            "failures": len(self.failures),
            "by_operation": {label: dict(sorted(c.items())) for label, c in sorted(self.by_operation.items())},
        }


def _headers(token: str) -> dict[str, str]:
    return {"Authorization": f"Bearer {token}"}


def _own_token(base: str, token: str) -> Seeded:
    r = requests.get(base + "/tokens", headers=_headers(token), timeout=10)
    assert r.status_code == 200, r.text
    own = [t["id"] for t in r.json() if token.startswith(t["prefix"])]
    return Seeded(token=token, token_id=own[0])


def _seed(base: str, seeded: Seeded) -> None:
    """A new round of rows: processes on one host (one with a queued migrate, one idle), a
    torchrun job of two ranks being paused, a paused process waiting in the queue on a full host,
    a placement, a drained GPU on a host of its own, a spare token."""
    session = requests.Session()
    session.headers.update(_headers(seeded.token))

    def post(path: str, body: Any) -> Any:
        r = session.post(base + path, json=body, timeout=10)
        assert r.status_code in (200, 201), (path, r.status_code, r.text)
        return r.json()

    # The last round's rows go (a workspace's quotas are not the fuzz's subject); its spare
    # token stays while the fuzz has not revoked it.
    if seeded.rounds:
        last = seeded.rounds
        for process_id in (
            seeded.process_id,
            seeded.idle_process_id,
            seeded.paused_process_id,
            f"drained-{last}",
            f"run-{last}-rank-0",
            f"run-{last}-rank-1",
        ):
            assert session.delete(f"{base}/processes/{process_id}", timeout=10).status_code in (204, 404)
    seeded.rounds += 1
    n = seeded.rounds
    seeded.process_id, seeded.idle_process_id, seeded.paused_process_id = f"gpu-{n}", f"idle-{n}", f"paused-{n}"
    post("/processes", process_body(seeded.process_id))
    post("/processes", process_body(seeded.idle_process_id, gpu_index=2))
    full = [gpu(i, used=140 << 30) for i in range(2)]  # no room: its wait stays waiting
    paused = process_body(seeded.paused_process_id, host=PAUSED_HOST, state="PAUSED", memory=0, devices=full)
    post("/processes", {**paused, "footprint_bytes": 1 << 30})
    seeded.wait_id = post("/waits", {"process_id": seeded.paused_process_id})["wait"]["id"]
    seeded.drain_host = f"drain-node-{n}"
    post("/processes", process_body(f"drained-{n}", host=seeded.drain_host, gpu_index=1))
    seeded.drain_id = post("/drains", {"host": seeded.drain_host, "gpu": 0, "reason": "fuzz"})["id"]
    seeded.placement_id = post("/placements", {"host": f"placed-{n}", "devices": [gpu(0)]})["placement"]["id"]
    for rank in (0, 1):
        post("/processes", rank_body(rank, key=f"run-{n}", process_id=f"run-{n}-rank-{rank}"))
    seeded.command_id = post("/commands", {"kind": "migrate", "process_id": seeded.process_id, "target": "cuda:1"})[
        "id"
    ]
    operation = post("/commands", {"kind": "pause", "process_id": f"run-{n}-rank-0"})
    seeded.operation_id = operation["job"]["operation_id"]
    active = {t["id"] for t in session.get(base + "/tokens", timeout=10).json() if not t["revoked"]}
    if seeded.spare_token_id not in active:
        seeded.spare_token_id = post("/tokens", {"name": f"spare-{n}"})["id"]


def _real_rows(seeded: Seeded, names: set[str]) -> dict[str, Any]:
    rows = {
        "workspace": WORKSPACE,
        "process_id": seeded.process_id,
        "command_id": seeded.command_id,
        "operation_id": seeded.operation_id,
        "token_id": seeded.spare_token_id,
        "wait_id": seeded.wait_id,
        "placement_id": seeded.placement_id,
        "drain_id": seeded.drain_id,
    }
    return {name: value for name, value in rows.items() if name in names}


def _naming_real_rows(case: Any, seeded: Seeded) -> Any:
    """A generated body names the idle process where it names one (a new command's), or the paused
    one and its host (a new wait's); a new drain's names the drain host and one of its free GPUs."""
    if isinstance(case.body, dict) and case.path.endswith("/drains") and isinstance(case.body.get("host"), str):
        case.body["host"] = seeded.drain_host
        case.body["gpu"] = 2
    if isinstance(case.body, dict) and isinstance(case.body.get("process_id"), str):
        waits = case.path.endswith("/waits")
        case.body["process_id"] = seeded.paused_process_id if waits else seeded.idle_process_id
        if waits and case.body.get("host") is not None:
            case.body["host"] = PAUSED_HOST
    return case


def _strategy(operation: Any, mode: GenerationMode, seeded: Seeded) -> Any:
    """A third of the requests anything the schema allows (or, negative, refuses), a third in
    the real workspace, a third naming its real rows."""
    names = {p.name for p in operation.path_parameters}
    sources = [operation.as_strategy(generation_mode=mode)]
    if "workspace" in names:
        sources.append(operation.as_strategy(generation_mode=mode, path_parameters={"workspace": WORKSPACE}))
        rows = operation.as_strategy(generation_mode=mode, path_parameters=_real_rows(seeded, names))
        if mode is GenerationMode.POSITIVE:  # an invalid body keeps what made it invalid
            rows = rows.map(lambda case: _naming_real_rows(case, seeded))
        sources.append(rows)
    return st.one_of(sources)


def _bounded(case: Any, seeded: Seeded) -> None:
    """What the fuzz must not do to itself: wait out long-polls, or revoke its own token."""
    wait = (case.query or {}).get("wait")
    if isinstance(wait, (int, float)) and not isinstance(wait, bool) and wait > MAX_WAIT_S:
        case.query["wait"] = MAX_WAIT_S
    token_id = (case.path_parameters or {}).get("token_id")
    if token_id == seeded.token_id and case.method == "DELETE":
        case.path_parameters["token_id"] = seeded.spare_token_id


def _own_headers(case: Any, headers: dict[str, str]) -> dict[str, str]:
    """The token the fuzz sends, except where a negative case's invalid part is its headers:
    the description declares the bearer scheme, so that case leaves out or spoils Authorization
    on purpose, and the server must refuse it as sent."""
    components = case._meta.components if case._meta is not None else {}
    header = components.get(ParameterLocation.HEADER)
    return {} if header is not None and header.mode is GenerationMode.NEGATIVE else headers


def _call_event_stream(case: Any, url: str, headers: dict[str, str], figures: Figures) -> None:
    """The event stream never ends: its status and first frame are checked, then it is closed."""
    label = f"{case.method} {case.path}"
    r = requests.request(**case.as_transport_kwargs(base_url=url, headers=headers), stream=True, timeout=10)
    try:
        figures.count(label, r.status_code)
        declared = set(case.operation.definition.raw["responses"])
        problems = []
        if str(r.status_code) not in declared:
            problems.append(f"undeclared status {r.status_code}")
        if r.status_code >= 500:
            problems.append(f"server error {r.status_code}")
        if r.status_code == 200:
            if not r.headers.get("content-type", "").startswith("text/event-stream"):
                problems.append(f"content type {r.headers.get('content-type')!r}")
            first = next(r.iter_lines(decode_unicode=True), "")
            if not first.startswith("retry:"):
                problems.append(f"first line {first!r}")
        if problems:
            figures.failures.append(f"{label}: {'; '.join(problems)}\n{case.as_curl_command(headers=headers)}")
    finally:
        r.close()


def _fuzz_operation(
    operation: Any, mode: GenerationMode, *, url: str, token: str, seeded: Seeded, figures: Figures, examples: int
) -> None:
    headers = _headers(token)
    session = requests.Session()
    label = operation.label
    streams = operation.path.endswith("/events")
    # Invalid data must be refused (negative_data_rejection): the description is as strict as the server.
    checks = CHECKS + ([negative_data_rejection] if mode is GenerationMode.NEGATIVE else [])

    @hypothesis.given(case=_strategy(operation, mode, seeded))
    @hypothesis.settings(
        max_examples=examples,
        derandomize=True,
        database=None,
        deadline=None,
        phases=[Phase.explicit, Phase.generate],  # every failure is collected; none is shrunk
        suppress_health_check=list(HealthCheck),
    )
    def run(case: Any) -> None:
        _bounded(case, seeded)
        sent = _own_headers(case, headers)
        if streams:
            _call_event_stream(case, url, sent, figures)
            return
        try:
            response = case.call(base_url=url, session=session, headers=sent, timeout=30)
        except requests.RequestException as exc:
            figures.failures.append(f"{label}: no answer: {exc!r}\n{case.as_curl_command(headers=sent)}")
            return
        figures.count(label, response.status_code)
        if token != seeded.token and label.split(" ", 1)[1].startswith("/api/") and response.status_code < 300:
            figures.failures.append(f"{label}: an invalid token got {response.status_code}")
        try:
            case.validate_response(response, checks=checks, headers=sent)
        except BaseException as exc:  # schemathesis reports every failed check at once, as an exception group
            figures.failures.append(f"{label} ({mode.value}): {exc}"[:3000])

    try:
        run()
    except hypothesis.errors.Unsatisfiable:
        # An operation without parameters or body has no invalid request to make.
        assert mode is GenerationMode.NEGATIVE and label in ("GET /healthz", "GET /metrics"), label


def _report(request: pytest.FixtureRequest, figures: Figures) -> None:
    summary = figures.summary()
    line = (
        f"openapi fuzz on {figures.database}: {summary['requests']} requests over {summary['operations']} "
        f"operations ({summary['operations_answered_2xx']} answered 2xx at least once), status classes "
        f"{summary['status_classes']}, {summary['server_errors']} server errors, {summary['failures']} failures"
    )
    report_figures(request, f"openapi-fuzz-{figures.database}", line, summary)


@pytest.fixture
def server(database_url: str, tmp_path: Path) -> Iterator[LiveServer]:
    srv = LiveServer(database_url, str(tmp_path / "home"), "--poll-timeout", "0.05")
    srv.start()
    yield srv
    srv.stop(signal.SIGKILL)


def _operations(schema: Any) -> list[Any]:
    operations = [result.ok() for result in schema.get_all_operations()]
    # Revoking runs last: a fuzzed revoke may hit the spare token the other operations name.
    return sorted(operations, key=lambda op: (op.method.upper() == "DELETE" and "/tokens/" in op.path, op.label))


def _examples(database_kind: str) -> int:
    return EXAMPLES if database_kind == "postgresql" else max(1, EXAMPLES // 2)


def test_every_operation_answers_within_its_description(
    server: LiveServer, database_kind: str, request: pytest.FixtureRequest
) -> None:
    assert server.token
    base = f"{server.url}/api/w/{WORKSPACE}"
    seeded = _own_token(base, server.token)
    schema = schemathesis.openapi.from_url(server.url + "/openapi.json")
    operations = _operations(schema)
    figures = Figures(database=database_kind, examples=_examples(database_kind))
    described: set[str] = set()
    for operation in operations:
        described.add(operation.label)
        for mode in (GenerationMode.POSITIVE, GenerationMode.NEGATIVE):
            # A round of valid data may change the rows it names, so the round after it gets new ones.
            if mode is GenerationMode.NEGATIVE or seeded.rounds == 0:
                _seed(base, seeded)
            for token, examples in ((server.token, figures.examples), (INVALID_TOKEN, max(1, figures.examples // 4))):
                _fuzz_operation(
                    operation, mode, url=server.url, token=token, seeded=seeded, figures=figures, examples=examples
                )
    _report(request, figures)
    # The server stayed up and its own token was never lost to the fuzz.
    assert requests.get(f"{base}/processes", headers=_headers(server.token), timeout=10).status_code == 200
    assert not figures.failures, f"{len(figures.failures)} failures; the first:\n\n" + "\n\n".join(
        figures.failures[:10]
    )
    assert figures.by_status and max(figures.by_status) < 500
    # Every operation was tried and answered 2xx at least once: the fuzz got past auth and validation.
    assert set(figures.by_operation) == described
    reached = {label for label, counts in figures.by_operation.items() if any(200 <= s < 300 for s in counts)}
    assert reached == described, sorted(described - reached)
