"""The `flexium` command's parsers: all of them are built in cli/ (the server package parses no
command line), and the server's options become its Settings without the server extra."""

from __future__ import annotations

import argparse
import ast
from pathlib import Path

import pytest

from flexium.cli import server
from flexium.cli.main import build_parser

PACKAGE = Path(__file__).resolve().parents[2] / "python" / "flexium"
# The host copier's child process reads a fixed argv that the engine itself writes: not a user's command line.
INTERNAL_ARGV = {"engine/fast/host_copier_process.py"}


def _imports_argparse(path: Path) -> bool:
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import) and any(alias.name == "argparse" for alias in node.names):
            return True
        if isinstance(node, ast.ImportFrom) and node.module == "argparse":
            return True
    return False


def test_every_parser_is_under_cli() -> None:
    parsing = {str(p.relative_to(PACKAGE)) for p in PACKAGE.rglob("*.py") if _imports_argparse(p)}
    assert parsing, "found no module that parses a command line: is PACKAGE right?"
    assert {p for p in parsing if not p.startswith("cli/")} == INTERNAL_ARGV


def test_server_options_become_settings(tmp_path: Path) -> None:
    args = build_parser().parse_args(
        [
            "server",
            "--port",
            "9001",
            "--database",
            f"sqlite:///{tmp_path / 's.db'}",
            "--stale-after",
            "30",
            "--access-log",
        ]
    )
    settings = server.settings_from_args(args)
    assert (settings.port, settings.stale_after_s, settings.access_log) == (9001, 30.0, True)
    assert settings.database_url == f"sqlite:///{tmp_path / 's.db'}"


def test_workspace_and_token_commands() -> None:
    parser = build_parser()
    args = parser.parse_args(["workspace", "create", "team", "--database", "sqlite:///x.db"])
    assert (args.command, args.action, args.name, args.database) == ("workspace", "create", "team", "sqlite:///x.db")
    args = parser.parse_args(["token", "revoke", "team", "3"])
    assert (args.command, args.action, args.workspace, args.token, args.database) == (
        "token",
        "revoke",
        "team",
        "3",
        None,
    )


def _commands(parser: argparse.ArgumentParser, path: tuple[str, ...] = ()) -> list[tuple[str, argparse.ArgumentParser]]:
    found = [(" ".join(("flexium", *path)), parser)]
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            for name, sub in action.choices.items():
                found += _commands(sub, (*path, name))
    return found


def test_every_command_says_what_it_does_and_every_option_has_help() -> None:
    missing = []
    for command, parser in _commands(build_parser()):
        if not parser.description:
            missing.append(f"{command}: no description")
        for action in parser._actions:
            if not isinstance(action, argparse._SubParsersAction) and not action.help:
                missing.append(f"{command} {'/'.join(action.option_strings) or action.dest}: no help")
    assert missing == []


def test_help_shows_defaults_once(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit):
        build_parser().parse_args(["migrate", "--help"])
    text = " ".join(capsys.readouterr().out.split())
    assert "move a running process to another GPU" in text  # the command's own description
    assert text.count("(default 300)") == 1 and "(default: 300" not in text


def test_version_names_the_distribution(capsys: pytest.CaptureFixture[str]) -> None:
    from flexium import __version__

    with pytest.raises(SystemExit) as exited:
        build_parser().parse_args(["--version"])
    assert exited.value.code == 0
    assert capsys.readouterr().out.strip() == f"flexium {__version__}"


@pytest.mark.parametrize(
    ("argv", "usage"),
    [
        (["ps", "--bogus"], "usage: flexium ps"),
        (["token", "issue", "team", "--bogus"], "usage: flexium token issue"),
        (["server", "--hots"], "usage: flexium server"),
    ],
)
def test_an_unknown_option_is_answered_with_the_commands_own_usage(
    argv: list[str], usage: str, capsys: pytest.CaptureFixture[str]
) -> None:
    from flexium.cli.main import main

    with pytest.raises(SystemExit) as exited:
        main(argv)
    assert exited.value.code == 2
    err = capsys.readouterr().err
    assert err.startswith(usage) and f"unrecognized arguments: {argv[-1]}" in err
