"""Entry point of the `flexium` command."""

from __future__ import annotations

import argparse
import sys
from typing import Optional, Sequence


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="flexium", description="Move, pause and resume PyTorch training on NVIDIA GPUs.")
    commands = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    doctor = commands.add_parser("doctor", help="check what this machine allows (driver, torch, GPUs)")
    doctor.add_argument("--json", action="store_true", help="machine-readable output")
    return parser


def main(argv: Optional[Sequence[str]] = None) -> int:
    args = build_parser().parse_args(argv)
    if args.command == "doctor":
        from flexium.cli import doctor

        return doctor.run(as_json=args.json)
    return 2


if __name__ == "__main__":
    sys.exit(main())
