"""Entry point of the `flexium` command: every command's parser is built here from cli/'s modules."""

from __future__ import annotations

import argparse
import os
import sys
from collections.abc import Sequence
from typing import Any

from flexium.cli import connection, drain, moves, processes, queue, run, server, workspaces
from flexium.cli.exit_status import EXIT_FAILED
from flexium.cli.terminal import terminal_safe_output

DISTRIBUTION = "flexium"  # pyproject.toml's [project] name


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="flexium",
        description="Move, pause and resume PyTorch training on NVIDIA GPUs.",
        epilog="Commands that talk to a server read FLEXIUM_SERVER (host[:port]/workspace) and FLEXIUM_TOKEN, "
        "else .flexiumrc. Exit status: 0 done, 1 refused or failed, 2 bad usage or settings, 3 server unreachable, "
        "130 stopped by Ctrl-C.",
    )
    parser.add_argument("--version", action="version", version=version_line())
    commands = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    doctor = commands.add_parser("doctor", help="check what this machine allows (driver, torch, GPUs)")
    doctor.add_argument("--json", action="store_true", help="machine-readable output")

    processes.add_commands(commands)
    moves.add_commands(commands)
    queue.add_commands(commands)
    drain.add_commands(commands)
    run.add_commands(commands)

    demo = commands.add_parser("demo", help="start a local server and a small training job attached to it")
    demo.add_argument("--port", type=int, default=None, help="server port (default 8080)")
    demo.add_argument("--host", default="127.0.0.1", help="address the server listens on (default 127.0.0.1)")
    demo.add_argument("--database", metavar="URL", help="database (default: the server's SQLite file under ~/.flexium)")
    demo.add_argument(
        "--simulated",
        action="store_true",
        help="run the job on a simulated host with two simulated GPUs even where NVIDIA GPUs are "
        "(the default where there are none)",
    )

    server.add_command(commands)
    workspaces.add_commands(commands)
    _describe_commands(commands)
    return parser


def version_line() -> str:
    """The installed distribution's name and version (what pip shows), and the package's."""
    from importlib import metadata

    from flexium import __version__

    try:
        installed = metadata.version(DISTRIBUTION)
    except metadata.PackageNotFoundError:
        return f"{DISTRIBUTION} {__version__} (not installed as a distribution: run from a source tree)"
    return f"{DISTRIBUTION} {installed}"


class _HelpWithDefaults(argparse.HelpFormatter):
    """Each option's default after its help, unless the help already says it or there is none."""

    def _get_help_string(self, action: argparse.Action) -> str:
        text = action.help or ""
        default = action.default
        if "default" in text or default in (None, False, "", argparse.SUPPRESS) or not action.option_strings:
            return text
        return f"{text} (default: %(default)s)"


def _describe_commands(commands: Any) -> None:
    """Every command's --help opens with what the command does (its line in `flexium --help`)
    and shows its defaults, wherever its parser was built."""
    summaries = {choice.dest: choice.help for choice in commands._choices_actions}
    for name, sub in commands.choices.items():
        sub.description = sub.description or summaries.get(name)
        sub.formatter_class = _HelpWithDefaults
        if sub.get_default("usage_parser") is None:  # an unknown option is answered with this usage (main)
            sub.set_defaults(usage_parser=sub)
        for action in sub._actions:
            if isinstance(action, argparse._SubParsersAction):
                _describe_commands(action)


def main(argv: Sequence[str] | None = None) -> int:
    try:
        status = _main(argv)
        sys.stdout.flush()  # inside: a reader gone (`flexium ps | head`) shows here at the latest
        return status
    except BrokenPipeError:
        # Whoever read the output stopped reading it: nothing more to say, and no traceback at exit.
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, sys.stdout.fileno())
        return EXIT_FAILED


def _main(argv: Sequence[str] | None) -> int:
    parser = build_parser()
    args, unrecognized = parser.parse_known_args(argv)
    if unrecognized:
        # argparse leaves these to the top parser; each command answers with its own usage
        # (`flexium server --hots` lists the server's options, `flexium ps --bogus` those of ps).
        getattr(args, "usage_parser", parser).error(f"unrecognized arguments: {' '.join(unrecognized)}")
    if args.command == "doctor":
        from flexium.cli import doctor

        return doctor.run(as_json=args.json)
    if args.command == "demo":
        from flexium.cli import demo

        return demo.run(port=args.port, host=args.host, database=args.database, simulated=args.simulated)
    if args.command == "server":
        return server.run(args)
    # What these print holds text that training jobs sent (cli/terminal.py).
    with terminal_safe_output():
        if args.command in ("workspace", "token"):
            return workspaces.run(args)
        return connection.run(args)


if __name__ == "__main__":
    sys.exit(main())
