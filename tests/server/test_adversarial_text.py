"""Hostile text in every string field of every write, read back through every list and every
dashboard page and fragment, before and after a restart, on SQLite and PostgreSQL, against a real
server process over HTTP.

Each write is either accepted and read back exactly as sent (as the wire model normalises it:
fields that strip surrounding whitespace), or refused with a 4xx that names the field; never a
5xx. Every page answers 200, shows the text escaped, and carries no markup but its own (no
event-handler attribute, no script but /static's). Text that is not valid Unicode (a lone
surrogate, what Python keeps of bytes that are not UTF-8) and NUL are refused where they come in,
so nothing stored can make a list or a page fail.
"""

from __future__ import annotations

import html.parser
import json
import signal
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any
from urllib.parse import quote

import markupsafe
import pytest
import requests

from flexium import protocol
from flexium.server.storage.workspaces import FIRST_TOKEN_NAME
from support.hostile_text import ACCEPTED, REFUSED
from support.server import LiveServer, gpu, process_body, rank_body, report_figures

pytestmark = pytest.mark.timeout(600)

SHORT, HOST, LONG = protocol.MAX_SHORT_TEXT, protocol.MAX_HOST_LEN, protocol.MAX_LONG_TEXT


@dataclass(frozen=True)
class Field:
    """A string field of a request body: where it is, its length limit, and whether the wire
    model strips whitespace around it (and refuses it empty)."""

    path: tuple[Any, ...]
    limit: int
    stripped: bool = False

    @property
    def name(self) -> str:
        return ".".join(str(part) for part in self.path)

    def expected(self, value: str) -> str:
        return value.strip() if self.stripped else value


REGISTER_FIELDS = [
    Field(("host",), HOST, stripped=True),
    Field(("user",), SHORT),
    Field(("gpu_uuid",), SHORT),
    Field(("gpu_model",), SHORT),
    Field(("logical_device",), SHORT),
    Field(("visible_gpus", 0), SHORT, stripped=True),
    Field(("torch_version",), SHORT),
    Field(("driver_version",), SHORT),
    Field(("flexium_version",), SHORT),
    Field(("cmdline",), LONG),
    Field(("capabilities", "driver_version"), LONG),
    Field(("capabilities", "problems", 0), LONG),
    Field(("capabilities", "fast_path_problem"), LONG),
    Field(("job", "key"), SHORT, stripped=True),
    Field(("devices", 0, "uuid"), SHORT, stripped=True),
    Field(("devices", 0, "name"), SHORT),
    Field(("devices", 0, "health"), SHORT),
]
HEARTBEAT_FIELDS = [
    Field(("gpu_uuid",), SHORT),
    Field(("devices", 0, "uuid"), SHORT, stripped=True),
    Field(("devices", 0, "name"), SHORT),
    Field(("devices", 0, "health"), SHORT),
]
REPORT_FIELDS = [
    Field(("error",), LONG),
    Field(("result", "path"), LONG),
    Field(("result", "logical_device"), LONG),
    Field(("result", "source", "uuid"), LONG),
    Field(("result", "source", "name"), LONG),
    Field(("result", "source", "pci_bus_id"), LONG),
    Field(("result", "target", "uuid"), LONG),
    Field(("result", "steps", 0, "step"), LONG),
    Field(("result", "steps", 0, "error"), LONG),
    Field(("result", "failed_step"), LONG),
    Field(("result", "error"), LONG),
    Field(("result", "notes", 0), LONG),
]
# Fields whose text must also match a rule (an id's pattern, a state's names, a GPU that
# exists): hostile text there is refused, always with a 4xx naming the field.
RULED_FIELDS = {
    "register": [("process_id",), ("state",)],
    "heartbeat": [("state",)],
    "command": [("process_id",), ("kind",), ("target",)],
    "report": [("state",), ("result", "kind")],
}


def hostile_values(field: Field) -> dict[str, str]:
    """Every accepted value, and the longest text the field takes."""
    values = dict(ACCEPTED)
    values["longest"] = "\u00e9" * field.limit
    return values


def put(body: dict[str, Any], path: tuple[Any, ...], value: Any) -> dict[str, Any]:
    """`body` (changed in place) with `value` at `path`; lists and objects on the way are made."""
    node: Any = body
    for part, after in zip(path, path[1:], strict=False):
        if isinstance(node, list):
            while len(node) <= part:
                node.append({} if not isinstance(after, int) else [])
            node = node[part]
        else:
            node = node.setdefault(part, [] if isinstance(after, int) else {})
    last = path[-1]
    if isinstance(node, list):
        while len(node) <= last:
            node.append(None)
    node[last] = value
    return body


def get(node: Any, path: tuple[Any, ...]) -> Any:
    for part in path:
        node = node[part]
    return node


class Client:
    """The workspace's API over HTTP with its admin token, and the dashboard as a logged-in browser."""

    def __init__(self, server: LiveServer, token: str) -> None:
        self.server = server
        self.base = f"{server.url}/api/w/default"
        self.session = requests.Session()
        self.session.headers["Authorization"] = f"Bearer {token}"
        self.token = token
        self.browser: requests.Session | None = None

    def post(self, path: str, body: Any) -> requests.Response:
        return self.session.post(self.base + path, json=body, timeout=30)

    def get(self, path: str, **params: Any) -> Any:
        r = self.session.get(self.base + path, params=params, timeout=30)
        assert r.status_code == 200, (path, params, r.status_code, r.text[:500])
        return r.json()

    def page(self, path: str) -> str:
        if self.browser is None:
            self.browser = requests.Session()
            r = self.browser.post(self.server.url + "/login", data={"token": self.token}, timeout=30)
            assert r.status_code == 200 and self.browser.cookies, r.status_code
        r = self.browser.get(self.server.url + path, timeout=30)
        assert r.status_code == 200, (path, r.status_code, r.text[:500])
        assert r.headers["content-type"].startswith("text/html"), r.headers
        check_markup(self.server.url, path, r.text)
        return r.text


def expect_refused(r: requests.Response, path: tuple[Any, ...], what: str) -> None:
    """A 4xx whose message (or error code: ``target_refused``) names the field, each named part
    of its path."""
    assert 400 <= r.status_code < 500, (path, what, r.status_code, r.text[:500])
    message = f"{r.json()['error']}: {r.json()['message']}"
    for part in path:
        if isinstance(part, str):
            assert part in message, (path, what, message)


class MarkupCheck(html.parser.HTMLParser):
    """Every element of a page: an injected one shows as a script or an event-handler attribute."""

    def __init__(self, origin: str) -> None:
        super().__init__(convert_charrefs=True)
        self.scripts = (origin + "/static/", "/static/")
        self.problems: list[str] = []

    def handle_starttag(self, tag: str, attrs: list[tuple[str, str | None]]) -> None:
        for name, value in attrs:
            if name.startswith("on"):
                self.problems.append(f"<{tag} {name}={value!r}>")
        if tag == "script" and not (dict(attrs).get("src") or "").startswith(self.scripts):
            self.problems.append(f"<script {attrs}>")
        if tag in ("img", "iframe", "object", "embed"):
            self.problems.append(f"<{tag} {attrs}>")


def check_markup(origin: str, path: str, text: str) -> None:
    # A browser reads a raw carriage return as a line feed: a key with one would not name its job.
    assert "\r" not in text, (path, text[max(0, text.index("\r") - 80) : text.index("\r") + 80])
    parser = MarkupCheck(origin)
    parser.feed(text)
    parser.close()
    assert not parser.problems, (path, parser.problems[:5])


# --- the writes -------------------------------------------------------------------------------


def reported_gpu(client: Client, host: str, uuid: str, field: Field) -> Any:
    """`field` (devices.0.X) of the GPU `uuid` of `host`, as the API lists it."""
    hosts = client.get("/devices", host=host)["hosts"]
    shown = [d for h in hosts for d in h["devices"] if d["uuid"] == field.expected(uuid)]
    assert len(shown) == 1, (host, uuid, hosts)
    return get(shown[0], field.path[2:])


def probe_register(client: Client) -> int:
    """Every string field of a registration alone; read back through the process and its GPUs."""
    tried = 0
    for field in REGISTER_FIELDS:
        pid = f"probe-{field.name.replace('.', '-')}"
        for name, value in {**hostile_values(field), **REFUSED, "too_long": "y" * (field.limit + 1)}.items():
            body = process_body(pid, host=f"probe-host-{pid}")
            if field.path[0] == "job":
                body["job"] = {"key": "k", "rank": 0, "world_size": 1}
            r = client.post("/processes", put(body, field.path, value))
            tried += 1
            if name in REFUSED or name == "too_long":
                expect_refused(r, field.path, name)
                continue
            assert r.status_code in (200, 201), (field.name, name, r.status_code, r.text[:500])
            if field.path[0] == "devices":
                assert reported_gpu(client, body["host"], body["devices"][0]["uuid"], field) == field.expected(value)
            else:
                shown = client.get(f"/processes/{pid}")
                assert get(shown, field.path) == field.expected(value), (field.name, name)
    for path in RULED_FIELDS["register"]:
        for name, value in {**ACCEPTED, **REFUSED}.items():
            r = client.post("/processes", put(process_body("probe-ruled"), path, value))
            expect_refused(r, path, name)
            tried += 1
    return tried


def probe_heartbeat(client: Client) -> int:
    tried = 0
    client.post("/processes", process_body("probe-beat", host="probe-beat-host"))
    for field in HEARTBEAT_FIELDS:
        for name, value in {**hostile_values(field), **REFUSED}.items():
            body: dict[str, Any] = {"devices": [gpu(0)]} if field.path[0] == "devices" else {}
            r = client.post("/processes/probe-beat/heartbeat", put(body, field.path, value))
            tried += 1
            if name in REFUSED:
                expect_refused(r, field.path, name)
                continue
            assert r.status_code == 200, (field.name, name, r.status_code, r.text[:500])
            if field.path[0] == "devices":
                shown = reported_gpu(client, "probe-beat-host", body["devices"][0]["uuid"], field)
                assert shown == field.expected(value), (field.name, name)
            else:
                assert get(client.get("/processes/probe-beat"), field.path) == field.expected(value), (field.name, name)
    for path in RULED_FIELDS["heartbeat"]:
        for name, value in {**ACCEPTED, **REFUSED}.items():
            expect_refused(client.post("/processes/probe-beat/heartbeat", put({}, path, value)), path, name)
            tried += 1
    return tried


def _delivered_command(client: Client, pid: str) -> int:
    """A fresh migrate of `pid` to its GPU 1, handed out to it: ready for its reports."""
    r = client.post("/processes", process_body(pid, host="probe-report-host"))
    assert r.status_code in (200, 201), r.text
    r = client.post("/commands", {"kind": "migrate", "process_id": pid, "target": "cuda:1"})
    assert r.status_code == 201, r.text
    command = client.get(f"/processes/{pid}/commands/next", wait=0)
    return int(command["id"])


def probe_report(client: Client) -> int:
    tried = 0
    pid = "probe-report"
    for field in REPORT_FIELDS:
        for name, value in {**hostile_values(field), **REFUSED}.items():
            command_id = _delivered_command(client, pid)
            body = put({"state": "succeeded", "result": {"kind": "migrate", "ok": True}}, field.path, value)
            r = client.post(f"/commands/{command_id}/report", body)
            tried += 1
            if name in REFUSED:
                expect_refused(r, field.path, name)
                r = client.post(f"/commands/{command_id}/report", {"state": "failed"})
                assert r.status_code == 200, r.text
                continue
            assert r.status_code == 200, (field.name, name, r.status_code, r.text[:500])
            assert get(client.get(f"/commands/{command_id}"), field.path) == field.expected(value), (field.name, name)
    for path in RULED_FIELDS["report"]:
        for name, value in {**ACCEPTED, **REFUSED}.items():
            command_id = _delivered_command(client, pid)
            body = put({"state": "succeeded", "result": {"ok": True}}, path, value)
            expect_refused(client.post(f"/commands/{command_id}/report", body), path, name)
            assert client.post(f"/commands/{command_id}/report", {"state": "failed"}).status_code == 200
            tried += 1
    return tried


def probe_command_and_token(client: Client) -> int:
    tried = 0
    r = client.post("/processes", process_body("probe-command", host="probe-command-host"))
    assert r.status_code in (200, 201), r.text
    for path in RULED_FIELDS["command"]:
        for name, value in {**ACCEPTED, **REFUSED, "too_long": "y" * (SHORT + 1)}.items():
            body = put({"kind": "migrate", "process_id": "probe-command", "target": "cuda:1"}, path, value)
            expect_refused(client.post("/commands", body), path, name)
            tried += 1
    for rank in (0, 1):
        r = client.post("/processes", rank_body(rank, key="probe-job", process_id=f"probe-job-rank-{rank}"))
        assert r.status_code in (200, 201), r.text
    for name, value in {**ACCEPTED, **REFUSED, "too_long": "y" * (SHORT + 1)}.items():
        for ranks in ({"0": value}, {value: "cuda:1"}):  # a rank's target, a rank
            body = {"kind": "migrate", "process_id": "probe-job-rank-0", "ranks": ranks}
            expect_refused(client.post("/commands", body), ("ranks",), name)
            tried += 1
    field = Field(("name",), SHORT)
    for name, value in {**hostile_values(field), **REFUSED, "too_long": "y" * (SHORT + 1)}.items():
        r = client.post("/tokens", {"name": value})
        tried += 1
        if name in REFUSED or name == "too_long":
            expect_refused(r, field.path, name)
            continue
        assert r.status_code == 201, (name, r.status_code, r.text[:500])
        assert r.json()["name"] == value
        assert [t["name"] for t in client.get("/tokens") if t["id"] == r.json()["id"]] == [value]
    return tried


@dataclass
class Showcase:
    """One hostile value in every field of a process, its GPUs, a job of two ranks, a command
    with its result, a job operation and a token: what the lists and pages are read with."""

    name: str
    value: str
    process_id: str
    host: str  # the value in a host name of its own (the probes registered hosts named as the value)
    command_id: int = 0
    operation_id: int = 0


def write_showcase(client: Client, name: str, value: str) -> Showcase:
    show = Showcase(name=name, value=value, process_id=f"show-{name.replace('_', '-')}", host=f"{value} show")
    host = show.host
    devices = [
        {**gpu(0), "uuid": value, "name": value, "health": value},
        {**gpu(1), "uuid": value + "-2", "name": value},
    ]
    texts = {f: value for f in ("user", "gpu_model", "logical_device", "torch_version", "driver_version")}
    texts.update(flexium_version=value, cmdline=value)
    capabilities = {
        "pause_resume": True,
        "migration": True,
        "job_operations": True,
        "driver_version": value,
        "problems": [value],
        "fast_path_problem": value,
    }
    body = process_body(
        show.process_id,
        host=host,
        devices=devices,
        gpu_uuid=value,
        visible_gpus=[value, value + "-2"],
        capabilities=capabilities,
        **texts,
    )
    r = client.post("/processes", body)
    assert r.status_code == 201, (name, r.text[:500])
    r = client.post("/commands", {"kind": "migrate", "process_id": show.process_id, "target": "cuda:1"})
    assert r.status_code == 201, (name, r.text[:500])
    show.command_id = r.json()["id"]
    assert r.json()["target_uuid"] == value + "-2"
    assert client.get(f"/processes/{show.process_id}/commands/next", wait=0)["id"] == show.command_id
    result = {
        "kind": "migrate",
        "ok": False,
        "path": value,
        "logical_device": value,
        "source": {"uuid": value, "name": value, "pci_bus_id": value},
        "target": {"uuid": value + "-2", "name": value, "pci_bus_id": value},
        "steps": [{"step": value, "seconds": 0.5, "ok": False, "error": value}],
        "failed_step": value,
        "error": value,
        "notes": [value],
    }
    r = client.post(f"/commands/{show.command_id}/report", {"state": "failed", "result": result, "error": value})
    assert r.status_code == 200, (name, r.text[:500])
    # A job of two ranks whose key is the value, on the same host; paused as a whole.
    for rank in (0, 1):
        body = rank_body(rank, key=value, process_id=f"{show.process_id}-rank-{rank}", host=host)
        body["devices"] = devices
        body["visible_gpus"] = [value, value + "-2"]
        body["gpu_uuid"] = body["visible_gpus"][rank]
        r = client.post("/processes", body)
        assert r.status_code == 201, (name, r.text[:500])
    r = client.post("/commands", {"kind": "pause", "process_id": f"{show.process_id}-rank-0"})
    assert r.status_code == 201, (name, r.text[:500])
    show.operation_id = r.json()["job"]["operation_id"]
    assert client.post("/tokens", {"name": value}).status_code == 201
    return show


# --- the reads --------------------------------------------------------------------------------


def read_api(client: Client, shows: list[Showcase]) -> int:
    """Every list and item the API has, each with the text intact."""
    reads = 0
    processes = {p["process_id"]: p for p in client.get("/processes")}
    commands = {c["id"]: c for c in client.get("/commands", limit=1000)}
    jobs = {j["key"]: j for j in client.get("/jobs")}
    devices = {h["host"]: h for h in client.get("/devices")["hosts"]}
    token_names = {t["name"] for t in client.get("/tokens")}
    client.get("")
    reads += 6
    for show in shows:
        v, host = show.value, show.host.strip()
        for listed in (processes[show.process_id], client.get(f"/processes/{show.process_id}")):
            assert listed["host"] == host and listed["cmdline"] == v and listed["user"] == v, show.name
            assert listed["gpu_uuid"] == v and listed["visible_gpus"] == [v.strip(), (v + "-2").strip()]
            assert listed["capabilities"]["problems"] == [v], show.name
        on_host = {p["process_id"] for p in client.get("/processes", host=host)}
        assert on_host == {show.process_id, f"{show.process_id}-rank-0", f"{show.process_id}-rank-1"}, show.name
        assert client.get("/processes", gpu=v + "-2") != []
        for kind in ("migrate", "resume"):
            judged = client.get(f"/processes/{show.process_id}/targets", kind=kind)
            assert {t["device"]["name"] for t in judged} == {v}, show.name
        for command in (commands[show.command_id], client.get(f"/commands/{show.command_id}")):
            assert command["error"] == v and command["result"]["notes"] == [v], show.name
            assert command["result"]["steps"][0]["error"] == v and command["result"]["source"]["uuid"] == v
        assert show.command_id in {c["id"] for c in client.get("/commands", process_id=show.process_id)}
        job = jobs[v.strip()]
        assert [rank["host"] for rank in job["ranks"]] == [host] * 2, show.name
        operation = client.get(f"/operations/{show.operation_id}")
        assert operation["job_key"] == v.strip() and len(operation["commands"]) == 2, show.name
        assert {d["health"] for d in devices[host]["devices"]} == {v, "ok"}, show.name
        assert client.get("/devices", host=host)["hosts"][0]["devices"][0]["name"] == v
        assert v in token_names, show.name
        reads += 11
    return reads


def as_html(text: str) -> str:
    """`text` as a page must hold it: escaped, a carriage return as a character reference."""
    return str(markupsafe.escape(text)).replace("\r", "&#13;")


def read_pages(client: Client, shows: list[Showcase]) -> int:
    """The page and every fragment, all of them and narrowed to each showcase; each escapes the
    text and keeps its own markup."""
    reads = 0
    pages = ("/", "/ui/processes", "/ui/devices", "/ui/commands", "/ui/totals", "/tokens", "/ui/tokens")
    everything = [client.page(path) for path in pages]
    reads += len(everything)
    for show in shows:
        escaped_host = as_html(show.host.strip())
        assert escaped_host in everything[0] and escaped_host in everything[2], show.name
        assert as_html(show.value) in everything[5] and as_html(show.value) in everything[6], show.name  # token names
        pid = quote(show.process_id)
        narrowed = [
            client.page(f"/ui/processes?id={pid}&id={pid}-rank-0"),
            client.page(f"/ui/processes/{pid}/targets?kind=migrate"),
            client.page(f"/ui/processes/{pid}/targets?kind=resume"),
            client.page(f"/ui/jobs/{quote(show.value.strip(), safe='')}/migrate"),
            client.page(f"/ui/devices?host={quote(show.host.strip(), safe='')}"),
            client.page(f"/ui/drain-host?host={quote(show.host.strip(), safe='')}"),
        ]
        assert escaped_host in narrowed[0] and escaped_host in narrowed[4] and escaped_host in narrowed[5], show.name
        assert as_html(show.value) in narrowed[1], show.name  # the GPU names
        reads += len(narrowed)
    return reads


class EventStream:
    """The workspace's live events, opened before the showcases are written."""

    def __init__(self, client: Client) -> None:
        self.response = client.session.get(client.base + "/events", stream=True, timeout=(10, 5))
        assert self.response.status_code == 200
        self.lines = self.response.iter_lines(decode_unicode=True)

    def read_showcases(self, shows: list[Showcase]) -> int:
        """Every frame until each showcase's registration went by: each frame's data is JSON and
        carries the text intact."""
        hosts = {show.process_id: show.host.strip() for show in shows}
        frames = 0
        try:
            for line in self.lines:
                if not line.startswith("data: "):
                    continue
                data = json.loads(line[len("data: ") :])
                frames += 1
                process = data.get("process") or {}
                if data.get("action") == "registered" and process.get("process_id") in hosts:
                    assert process["host"] == hosts.pop(process["process_id"])
                if not hosts:
                    break
        finally:
            self.response.close()
        assert not hosts, f"no registered event for {sorted(hosts)}"
        return frames


# --- the test ---------------------------------------------------------------------------------


@pytest.fixture
def server(database_url: str, tmp_path: Path) -> Iterator[LiveServer]:
    srv = LiveServer(
        database_url,
        str(tmp_path / "home"),
        "--stale-after",
        "600",
        "--poll-timeout",
        "0.05",
        "--device-write-interval",
        "0.001",
    )
    srv.start()
    yield srv
    srv.stop(signal.SIGKILL)


def test_hostile_text_in_every_field_is_refused_or_read_back_intact_everywhere(
    server: LiveServer, database_url: str, request: pytest.FixtureRequest
) -> None:
    assert server.token
    client = Client(server, server.token)
    writes = probe_register(client) + probe_heartbeat(client) + probe_report(client)
    writes += probe_command_and_token(client)
    events = EventStream(client)
    shows = [write_showcase(client, name, value) for name, value in ACCEPTED.items()]
    reads = events.read_showcases(shows) + read_api(client, shows) + read_pages(client, shows)
    server.restart()
    after = Client(server, client.token)
    reads += read_api(after, shows) + read_pages(after, shows)
    database = database_url.split(":", 1)[0]
    line = (
        f"adversarial text on {database}: {writes} hostile writes, {len(shows)} showcases, "
        f"{reads} reads of lists, items, pages and events (before and after a restart)"
    )
    figures = {"database": database, "writes": writes, "showcases": len(shows), "reads": reads}
    report_figures(request, f"adversarial-text-{database}", line, figures)


# --- bytes that are not UTF-8, and names given on the command line ------------------------------


def _raw_body(text: bytes) -> bytes:
    """`text` (bytes) in every string field a write reads: the body of each write operation."""
    fields = ("host", "process_id", "gpu_uuid", "name", "error", "state", "kind")
    return b"{" + b", ".join(b'"%s": "%s"' % (f.encode(), text) for f in fields) + b"}"


RAW_BODIES = {
    "invalid_utf8": _raw_body(b"\xff\xfe"),
    "overlong_utf8": _raw_body(b"\xc0\xaf"),
    "raw_nul_byte": _raw_body(b"a\x00b"),
    # A surrogate encoded as UTF-8 (CESU-8): Python's JSON reader keeps it as a lone surrogate.
    "encoded_surrogate": _raw_body(b"donn\xed\xb3\xa9es"),
    "truncated": b'{"host": "\xe2\x82',
}
WRITES = [
    "/processes",
    "/processes/gpu-1/heartbeat",
    "/commands",
    "/commands/{command_id}/report",
    "/tokens",
]


def test_bytes_that_are_not_utf8_in_a_raw_body_are_refused_with_a_4xx(api: Any) -> None:
    api.register("gpu-1")
    command = api.command("pause")
    assert command.status_code == 201, command.text
    before = api.get("/processes").json()
    for path in WRITES:
        for name, raw in RAW_BODIES.items():
            r = api.client.post(
                api.base + path.format(command_id=command.json()["id"]),
                content=raw,
                headers={**api.headers(), "Content-Type": "application/json"},
            )
            assert r.status_code in (400, 422), (path, name, r.status_code, r.text)
            assert r.json()["error"] in ("bad_request", "invalid_request"), (path, name, r.text)
    # Nothing was stored: the lists read as before, and every page renders.
    assert api.get("/processes").json() == before
    assert api.get(f"/commands/{command.json()['id']}").json()["state"] == "queued"
    assert all(t["name"] == FIRST_TOKEN_NAME or t["name"] == "" for t in api.get("/tokens").json())
    index, rows, commands = api.pages("/", "/ui/processes", "/ui/commands")
    assert "gpu-1" in index and "gpu-1" in rows and "pause" in commands


def test_workspace_and_token_names_given_on_the_command_line(database_url: str) -> None:
    """`flexium workspace create NAME` and `flexium token issue WS --name NAME` (database_admin):
    a workspace name is refused unless it is a plain name; a token's name is stored as given,
    or refused by the API's rule for it, never a database error."""
    from flexium.server import database_admin
    from flexium.server.errors import InvalidRequest

    database_admin.create_workspace("hostile", database_url=database_url)
    kept = []
    names = {**ACCEPTED, **REFUSED, "too_long": "y" * (SHORT + 1), "trailing_newline": "ws\n"}
    for name, value in names.items():
        with pytest.raises(InvalidRequest, match="invalid workspace name"):
            database_admin.create_workspace(value, database_url=database_url)
        if name in REFUSED or name == "too_long":
            with pytest.raises(InvalidRequest, match="token name"):
                database_admin.issue_token("hostile", name=value, database_url=database_url)
            continue
        assert database_admin.issue_token("hostile", name=value, database_url=database_url).token.startswith("flx_")
        kept.append(value)
    assert [t.name for t in database_admin.list_tokens("hostile", database_url=database_url)] == [
        FIRST_TOKEN_NAME,
        *kept,
    ]
    assert [w.name for w in database_admin.list_workspaces(database_url=database_url)] == ["hostile"]


def test_hostile_text_in_the_parameters_of_lists_and_fragments(api: Any) -> None:
    """What a list or a fragment is narrowed by (a process id, a host, a GPU) is checked where it
    comes in: text no row can hold is a 422 or finds nothing, never the database's refusal (the
    last line of defence, answered 422 with "could not be stored") nor a 5xx."""
    api.register("gpu-1")
    values = [quote(v, safe="", errors="surrogatepass") for v in (*ACCEPTED.values(), *REFUSED.values(), "y" * 5000)]
    values += ["%FF", "%ED%B3%A9", "a%00b"]  # bytes that are not UTF-8, a NUL, as a URL carries them
    paths = [
        "/ui/processes?id={v}",
        "/ui/processes?id=gpu-1&id={v}",
        "/ui/devices?host={v}",
        "/ui/drain-host?host={v}",
        "/ui/processes/{v}/targets?kind=migrate",
        "/ui/jobs/{v}/migrate",
        "/ui/tokens/{v}/revoke",
        "/api/w/default/processes?host={v}",
        "/api/w/default/processes?gpu={v}",
        "/api/w/default/processes/{v}",
        "/api/w/default/processes/{v}/targets",
        "/api/w/default/commands?process_id={v}",
        "/api/w/default/devices?host={v}",
        "/api/w/{v}/processes",
    ]
    assert api.log_in().status_code == 303  # a dashboard session: the fragments are read as a browser reads them
    try:
        for path in paths:
            for value in values:
                url = path.format(v=value)
                r = api.client.get(url, headers=api.headers() if url.startswith("/api/") else {})
                assert r.status_code in (200, 404, 422), (url[:120], r.status_code, r.text[:300])
                assert "could not be stored" not in r.text, (url[:120], r.text[:300])
    finally:
        api.client.cookies.clear()
