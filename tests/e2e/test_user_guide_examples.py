"""Every Python example of the user guide (docs/guide/*.md, its ```python blocks) runs as
written, each in a fresh interpreter with no server configured and a home of its own, and says
what it promises to say."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import pytest

from support.live_server import clean_env

pytestmark = pytest.mark.timeout(300)

GUIDE = Path(__file__).resolve().parents[2] / "docs" / "guide"
FENCE = re.compile(r"^```python\n(.*?)^```", re.M | re.S)
EXAMPLES = [
    (f"{page.name}#{number}", code)
    for page in sorted(GUIDE.glob("*.md"))
    for number, code in enumerate(FENCE.findall(page.read_text()), start=1)
]
# What an example prints when it ran to its end (each example's last print, by its page and number).
EXPECTED = {
    "api.md#1": r"^process gpu-[0-9a-f]{8} on (cuda:\d+|cpu)$",
    "api.md#2": r"^the session ended with the block: True$",
    "api.md#3": r"^movable: (True|False) \| moving now: False$",
    "api.md#4": r"^reported$",
    "api.md#6": r"^can migrate: (True|False)$",
    "configuration.md#1": r"^\{'orchestrator': 'default', 'device': 'default'",
}


def test_the_guide_has_python_examples() -> None:
    assert len(EXAMPLES) >= 7
    assert set(EXPECTED) <= {name for name, _ in EXAMPLES}


@pytest.mark.parametrize(("name", "code"), EXAMPLES, ids=[name for name, _ in EXAMPLES])
def test_the_example_runs(name: str, code: str, tmp_path: Path) -> None:
    done = subprocess.run(
        [sys.executable, "-c", code],
        env=clean_env(tmp_path),
        cwd=tmp_path,
        capture_output=True,
        text=True,
        timeout=240,
    )
    assert done.returncode == 0, f"{name} failed:\n{done.stdout}\n{done.stderr}"
    assert "Traceback" not in done.stderr, done.stderr
    if name in EXPECTED:
        assert re.search(EXPECTED[name], done.stdout, re.M), f"{name} printed:\n{done.stdout}"
