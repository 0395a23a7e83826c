"""What the `flexium` command prints of a job's text reaches a terminal with its control
characters written out (cli/terminal.py)."""

from __future__ import annotations

import sys

import pytest

from flexium.cli.printing import print_table
from flexium.cli.terminal import terminal_safe_output, terminal_text


@pytest.mark.parametrize(
    "text, shown",
    [
        ("\x1b]52;c;cm0gLXJmIH4=\x07", "\\x1b]52;c;cm0gLXJmIH4=\\x07"),  # write the clipboard
        ("\x1b[2J\x1b[H", "\\x1b[2J\\x1b[H"),  # clear the screen
        ("ok\rFORGED", "ok\\rFORGED"),  # overwrite the line
        ("\x9b31m", "\\x9b31m"),  # a C1 escape
        ("\u202egpj.exe", "\\u202egpj.exe"),  # a right-to-left override
        ("caf\u00e9 \U0001f680 \u0661\u0662", "caf\u00e9 \U0001f680 \u0661\u0662"),  # text stays text
        ("two\tcolumns\nand lines", "two\tcolumns\nand lines"),  # the command's own layout
    ],
)
def test_control_characters_are_written_out(text: str, shown: str) -> None:
    assert terminal_text(text) == shown


def test_every_print_of_a_command_goes_through_it(capsys: pytest.CaptureFixture[str]) -> None:
    with terminal_safe_output():
        print_table([("HOST", "GPU"), ("\x1b]0;owned\x07node", "\u202eH200")])
        print("reason: \x1b[8mhidden", file=sys.stderr)
    out, err = capsys.readouterr()
    assert "\x1b" not in out + err and "\u202e" not in out
    assert "\\x1b]0;owned\\x07node" in out and "\\u202eH200" in out and "\\x1b[8mhidden" in err
