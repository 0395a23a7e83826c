"""Why a command was sent and who sent it by which door: a reason given with the command (one
line, bounded), the token's name and the door (flexium's command line by its User-Agent, the
dashboard by its session, the server's policies, any other client), stored with the command and
its audit entry; on SQLite and PostgreSQL."""

from __future__ import annotations

from typing import Any

import pytest

from flexium import protocol
from flexium.server import storage
from flexium.server.storage.audit import PolicyActor, record_commands_created
from support.server import Api

CLI = {"User-Agent": f"flexium/0.1.0 {protocol.CLI_AGENT_MARK}"}


def _send(api: Api, kind: str, reason: Any = None, headers: dict[str, str] | None = None) -> Any:
    body: dict[str, Any] = {"kind": kind, "process_id": "gpu-1"}
    if reason is not None:
        body["reason"] = reason
    return api.post("/commands", body, headers={**api.headers(), **(headers or {})})


def _token_name(api: Api) -> str:
    [admin] = [t for t in api.get("/tokens").json() if t["role"] == "admin" and not t["revoked"]]
    return str(admin["name"])


def _created_entry(api: Api, command_id: int) -> dict[str, Any]:
    [entry] = [
        e for e in api.get("/audit").json() if e["action"] == "command.created" and e["command_id"] == command_id
    ]
    return dict(entry)


def test_a_reason_and_the_command_line_door_are_stored_with_the_command(api: Api) -> None:
    api.register()
    sent = _send(api, "pause", "  free GPU 0 for alice's eval run  ", CLI)
    assert sent.status_code == 201, sent.text
    command = sent.json()
    name = _token_name(api)
    assert (command["reason"], command["sent_by"], command["door"]) == ("free GPU 0 for alice's eval run", name, "cli")
    stored = api.get(f"/commands/{command['id']}").json()
    assert (stored["reason"], stored["sent_by"], stored["door"]) == ("free GPU 0 for alice's eval run", name, "cli")
    [listed] = api.get("/commands", params={"process_id": "gpu-1"}).json()
    assert listed["door"] == "cli" and listed["reason"] == stored["reason"]
    entry = _created_entry(api, command["id"])
    assert entry["door"] == "cli" and entry["token_name"] == name
    assert "free GPU 0 for alice's eval run" in entry["detail"]


def test_another_client_is_the_api_door_and_a_blank_reason_is_none(api: Api) -> None:
    api.register()
    command = _send(api, "pause", "   ", {"User-Agent": "curl/8.5.0"}).json()
    assert command["door"] == "api" and command["reason"] is None and command["sent_by"] == _token_name(api)
    assert _created_entry(api, command["id"])["door"] == "api"
    # a client that only claims to be flexium's library, not its command line, is the API too
    api.post(f"/commands/{command['id']}/report", {"state": "succeeded"})
    again = _send(api, "resume", None, {"User-Agent": "flexium/0.1.0 (process)"}).json()
    assert again["door"] == "api", again


def test_the_dashboard_door_is_its_session(api: Api) -> None:
    api.register()
    assert api.log_in().status_code == 303
    try:
        sent = api.client.post(
            api.base + "/commands",
            json={"kind": "pause", "process_id": "gpu-1", "reason": "maintenance on this host at 14:00"},
            headers={protocol.CSRF_HEADER: "1", **CLI},  # the session decides, whatever the agent says
        )
    finally:
        api.client.cookies.clear()
    assert sent.status_code == 201, sent.text
    command = sent.json()
    assert (command["door"], command["sent_by"]) == ("dashboard", _token_name(api))
    assert command["reason"] == "maintenance on this host at 14:00"
    assert _created_entry(api, command["id"])["door"] == "dashboard"


@pytest.mark.parametrize(
    "reason",
    ["x" * (protocol.MAX_REASON_LEN + 1), "two\nlines", "a tab\there", "\x1b]0;owned\x07", "right\u202eto left"],
)
def test_a_reason_is_one_bounded_line_of_printable_text(api: Api, reason: str) -> None:
    api.register()
    refused = _send(api, "pause", reason, CLI)
    assert refused.status_code == 422, refused.text
    assert "reason" in refused.text
    assert api.get("/commands", params={"process_id": "gpu-1"}).json() == []


def test_a_reason_of_the_longest_length_is_kept_whole(api: Api) -> None:
    api.register()
    reason = "é" * protocol.MAX_REASON_LEN
    assert _send(api, "pause", reason).json()["reason"] == reason


def test_a_policy_is_its_own_door(api: Api) -> None:
    api.register()
    commands = api.db.run(
        storage.create_commands_audited,
        write=True,
        workspace_id=1,
        actor=PolicyActor("make room"),
        kind="pause",
        process_id="gpu-1",
        now=api.ctx.started_at + 1,
        stale_after=30.0,
        reason="room for a job of a higher priority",
    )
    [command] = commands
    assert (command.sent_by, command.door) == ("policy: make room", "policy")
    stored = api.get(f"/commands/{command.id}").json()
    assert (stored["sent_by"], stored["door"], stored["reason"]) == (
        "policy: make room",
        "policy",
        "room for a job of a higher priority",
    )
    entry = _created_entry(api, command.id)
    assert entry["door"] == "policy" and entry["token_name"] == "policy: make room"


def test_a_command_a_policy_creates_on_its_own_is_stamped_with_its_audit_entry(api: Api) -> None:
    """The queue's policies create their commands and then their audit entries (not through
    create_commands_audited): the entry stamps who and which door on the command all the same."""
    api.register()

    def as_a_policy(*, session: Any) -> list[Any]:
        commands = storage.create_commands(
            session=session,
            workspace_id=1,
            kind="pause",
            process_id="gpu-1",
            now=api.ctx.started_at + 1,
            stale_after=30.0,
            reason="make room: a job of a higher priority needs 8.0 GiB on GPU 0",
        )
        actor = PolicyActor("make room")
        return record_commands_created(session=session, workspace_id=1, actor=actor, commands=commands, now=1.0)

    [command] = api.db.run(as_a_policy, write=True)
    assert (command.sent_by, command.door) == ("policy: make room", "policy")
    stored = api.get(f"/commands/{command.id}").json()
    assert (stored["sent_by"], stored["door"]) == ("policy: make room", "policy"), stored
