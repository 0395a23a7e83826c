"""A refused command as the command line says it (issue 38): the one reason that matters first,
every reason under --verbose and in --json; a bad --token in the command line's own terms."""

from __future__ import annotations

import json
from types import SimpleNamespace
from typing import Any

import pytest

from flexium.cli import connection
from flexium.cli.main import main
from flexium.client import Refused
from support.commands import command_info

CPU_JOB_REFUSAL = (
    "process 'gpu-0e1e8143' cannot migrate: it reports no 'migration' capability: no NVIDIA driver: could not "
    "load libcuda.so.1 (libcuda.so.1: cannot open shared object file: No such file or directory); install the "
    "NVIDIA driver (570+ to pause and resume, 580+ to move between GPUs); torch 2.13.0+cpu is a CPU-only build: "
    "training runs, migration and pause are off; flexium's engine is not running in this process (training on cpu): "
    "migrate, pause and resume are off"
)


class RefusingServer:
    workspace = "default"
    base_url = "http://127.0.0.1:8080"
    token = "flx_test"

    def __init__(self, message: str) -> None:
        self.message = message

    def create_command(self, _request: Any) -> Any:
        raise Refused(self.message, code="capability", status=409)

    def list_processes(self) -> list[Any]:  # what a name that is no whole id is looked up in first
        return [SimpleNamespace(process_id="gpu-1", pid=4242)]

    def close(self) -> None:
        pass


@pytest.fixture
def refusing(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(connection, "connect", lambda _server, _token: RefusingServer(CPU_JOB_REFUSAL))


def test_the_one_reason_that_matters_first(refusing: None, capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["migrate", "gpu-0e1e8143", "cuda:1"]) == 1
    said = capsys.readouterr()
    assert said.out == ""
    assert said.err == (
        "flexium: process 'gpu-0e1e8143' cannot migrate: CPU-only torch: no GPU memory to move "
        "(--verbose: every reason)\n"
    )


def test_every_reason_under_verbose_and_in_json(refusing: None, capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["migrate", "gpu-0e1e8143", "cuda:1", "--verbose"]) == 1
    assert capsys.readouterr().err == f"flexium: {CPU_JOB_REFUSAL}\n"
    assert main(["migrate", "gpu-0e1e8143", "cuda:1", "--json"]) == 1
    answer = json.loads(capsys.readouterr().out)
    assert answer["message"] == CPU_JOB_REFUSAL and answer["error"] == "capability"
    assert "CPU-only torch: no GPU memory to move" in answer["short"]


def test_an_unknown_reason_is_said_whole(monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]) -> None:
    odd = "process 'gpu-1' cannot pause: it reports no 'pause_resume' capability: something new"
    monkeypatch.setattr(connection, "connect", lambda _server, _token: RefusingServer(odd))
    assert main(["pause", "gpu-1"]) == 1
    assert capsys.readouterr().err == f"flexium: {odd}\n"


@pytest.mark.parametrize("token", ["", "  ", "flx_a b"])
def test_a_bad_token_option_is_said_in_the_command_lines_terms(
    token: str, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    monkeypatch.delenv("FLEXIUM_TOKEN", raising=False)
    assert main(["ps", "--server", "127.0.0.1:9/default", "--token", token]) == 2
    err = capsys.readouterr().err
    assert err.startswith("flexium: --token is empty or holds blanks or non-ASCII characters: give a token")
    assert "passed in code" not in err and "dashboard" not in err


@pytest.mark.parametrize("timeout", ["nan", "-5", "0", "inf", "soon"])
def test_a_timeout_that_is_not_a_number_of_seconds_above_0_is_refused_before_anything_is_sent(
    timeout: str, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    monkeypatch.setattr(connection, "connect", lambda *_: pytest.fail("connected with a bad --timeout"))
    for verb in (["pause", "gpu-0e1e8143"], ["migrate", "gpu-0e1e8143", "cuda:1"], ["drain", "node1"]):
        with pytest.raises(SystemExit) as exited:
            main([*verb, "--timeout", timeout])
        assert exited.value.code == 2
        assert f"--timeout: {timeout!r}" in capsys.readouterr().err


class InterruptedServer(RefusingServer):
    """Takes the command, then the wait for its end is interrupted (Ctrl-C)."""

    def create_command(self, request: Any) -> Any:
        return command_info(9, request.kind, request.process_id)

    def wait_command(self, *_: Any, **__: Any) -> Any:
        raise KeyboardInterrupt


def test_ctrl_c_while_a_command_is_followed_says_it_goes_on(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    monkeypatch.setattr(connection, "connect", lambda *_: InterruptedServer(""))
    assert main(["pause", "gpu-0e1e8143"]) == 130
    said = capsys.readouterr().err
    assert "Traceback" not in said
    assert said.strip().endswith(
        "flexium: interrupted: command 9 (pause of gpu-0e1e8143; `flexium ps` shows it) goes on at the server"
    ), said


@pytest.mark.parametrize("process", ["", "-1", "a b"])
def test_a_process_id_that_cannot_be_one_is_said_so_before_anything_is_sent(
    process: str, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    monkeypatch.setattr(connection, "connect", lambda *_: RefusingServer("never asked"))
    assert main(["resume", "--", process]) == 1
    assert capsys.readouterr().err == f"flexium: {process!r} is not a process id: `flexium ps` lists them\n"


def test_flexium_run_offers_no_json_its_output_is_its_jobs(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exited:
        main(["run", "--json", "--", "true"])
    assert exited.value.code == 2 and "unrecognized arguments: --json" in capsys.readouterr().err
