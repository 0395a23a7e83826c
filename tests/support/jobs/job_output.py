"""How the test jobs print the lines their tests wait for: one write per line. Unbuffered (the
tests run their jobs with PYTHONUNBUFFERED=1), a print() writes its text and its newline apart, and
a line that another thread (flexium's log, on the same pipe as stderr) or another rank sharing the
pipe writes meanwhile lands between them. A job started with its server down trained on in CI while
its test waited 60 s for its ``init`` line: the client warns that it cannot reach the server just as
init returns. (With a thread logging beside it, 15,127 of 20,000 printed lines had its text inside
them here; written at once, none.) The scripts here import it by name: run by path, their own
folder comes first on sys.path."""

import sys


def say(line: str) -> None:
    sys.stdout.write(line + "\n")
    sys.stdout.flush()
