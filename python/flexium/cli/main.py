"""Entry point of the `flexium` command."""

from __future__ import annotations

import argparse
import sys
from typing import Optional, Sequence

# Handed whole to the server package, which parses its own options (see cli/admin.py).
DELEGATED = ("server", "workspace", "token")


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="flexium",
        description="Move, pause and resume PyTorch training on NVIDIA GPUs.",
        epilog="Commands that talk to a server read FLEXIUM_SERVER (host[:port]/workspace) and FLEXIUM_TOKEN, "
        "else .flexiumrc. Exit status: 0 done, 1 refused or failed, 2 bad usage, 3 server unreachable.",
    )
    commands = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    doctor = commands.add_parser("doctor", help="check what this machine allows (driver, torch, GPUs)")
    doctor.add_argument("--json", action="store_true", help="machine-readable output")

    from flexium.cli import remote

    remote.add_commands(commands)

    demo = commands.add_parser("demo", help="start a local server and a small training job attached to it")
    demo.add_argument("--port", type=int, default=None, help="server port (default 8080)")
    demo.add_argument("--host", default="127.0.0.1", help="address the server listens on (default 127.0.0.1)")
    demo.add_argument("--database", metavar="URL", help="database (default: the server's SQLite file under ~/.flexium)")

    commands.add_parser("server", add_help=False, help="run the server: API, dashboard, live events "
                        "(flexium server --help)")
    commands.add_parser("workspace", add_help=False, help="create or list workspaces (flexium workspace --help)")
    commands.add_parser("token", add_help=False, help="issue, revoke or list tokens (flexium token --help)")
    return parser


def main(argv: Optional[Sequence[str]] = None) -> int:
    args_list = list(sys.argv[1:] if argv is None else argv)
    if args_list and args_list[0] in DELEGATED:
        from flexium.cli import admin

        return admin.run(args_list)
    args = build_parser().parse_args(args_list)
    if args.command == "doctor":
        from flexium.cli import doctor

        return doctor.run(as_json=args.json)
    if args.command == "demo":
        from flexium.cli import demo

        return demo.run(port=args.port, host=args.host, database=args.database)
    from flexium.cli import remote

    return remote.run(args)


if __name__ == "__main__":
    sys.exit(main())
