"""`flexium ps | head`: a reader that stops reading ends the command quietly (exit 1), with no
traceback, whichever write meets the closed pipe."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap


def test_a_closed_pipe_ends_the_command_without_a_traceback() -> None:
    # The read end is closed before the command writes: its first write (or the flush at its end) fails.
    script = textwrap.dedent(
        """
        import os, sys
        read, write = os.pipe()
        os.close(read)
        os.dup2(write, 1)
        sys.stdout = open(1, "w", closefd=False)
        from flexium.cli.main import main
        sys.exit(main(["doctor", "--json"]))
        """
    )
    done = subprocess.run(
        [sys.executable, "-c", script],
        capture_output=True,
        text=True,
        timeout=120,
        env={**os.environ, "CUDA_VISIBLE_DEVICES": ""},
    )
    assert done.returncode == 1, done.stderr
    assert "Traceback" not in done.stderr and "BrokenPipeError" not in done.stderr, done.stderr
