"""What the `flexium` command prints goes to a person's terminal, and much of it is text a
training job sent (its host, command line, GPU names, an operation's error and notes, a token's
name). A terminal obeys control characters: an escape sequence in a job's text could set the
window title, write the clipboard (OSC 52), move the cursor or hide what follows, and a
right-to-left override reorders what is shown. ``terminal_safe_output`` writes every such
character out as its escape (``\\x1b``, ``\\u202e``) on the way to stdout and stderr: one place
for every command, whatever prints. Newlines and tabs are the command's own layout and stay;
``--json`` output is unchanged (JSON already escapes control characters). ``terminal_width`` is how
wide the terminal lets a table be."""

from __future__ import annotations

import contextlib
import io
import os
import re
import shutil
import sys
from collections.abc import Iterator
from typing import TextIO

# C0 controls but tab and newline, DEL, C1 controls, and the bidirectional overrides and isolates.
_CONTROLS = re.compile("[\x00-\x08\x0b-\x1f\x7f-\x9f\u061c\u200e\u200f\u202a-\u202e\u2066-\u2069]")


def terminal_text(text: str) -> str:
    """`text` with each control character written out as its Python escape."""
    return _CONTROLS.sub(lambda match: match.group().encode("unicode_escape").decode("ascii"), text)


class _TerminalSafe(io.TextIOBase):
    def __init__(self, stream: TextIO) -> None:
        self._stream = stream

    def write(self, text: str) -> int:
        self._stream.write(terminal_text(text))
        return len(text)

    def flush(self) -> None:
        self._stream.flush()

    def isatty(self) -> bool:
        return self._stream.isatty()


@contextlib.contextmanager
def terminal_safe_output() -> Iterator[None]:
    with contextlib.redirect_stdout(_TerminalSafe(sys.stdout)), contextlib.redirect_stderr(_TerminalSafe(sys.stderr)):
        yield


def terminal_width() -> int | None:
    """How many characters a line of a table may take: COLUMNS when set (as ls and kubectl read
    it), else the terminal's width; None when the output goes to a file or a pipe (whole lines,
    for grep and awk; --json is for scripts)."""
    columns = os.environ.get("COLUMNS", "")
    if columns.isdigit() and int(columns) > 0:
        return int(columns)
    if not sys.stdout.isatty():
        return None
    return shutil.get_terminal_size().columns
