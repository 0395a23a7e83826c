"""A long script name in the process column and on the job page wraps between its words (after
_ - /, before a capital after a small letter), never inside one, and stays inside its cell, at
desktop and phone widths."""

from __future__ import annotations

from typing import Any

import pytest

from support.dashboard import GIB, FakeHost, Jobs
from support.dashboard_page import Dashboard

pytestmark = pytest.mark.timeout(120)

SCRIPT = "finetune_llama3_8b_instruct_with_lora_rank8_and_flashAttn.py"
VIEWPORTS = ((1280, 800), (390, 844))

# Each character of the element's text with the top of its line box and its right edge, and the
# right edge of the content box of `arguments[1]`, the cell or panel it must stay inside.
_LAYOUT = """
var el = arguments[0], box = arguments[1];
el.scrollIntoView();
var chars = [], walker = document.createTreeWalker(el, NodeFilter.SHOW_TEXT), node;
while ((node = walker.nextNode())) {
  for (var i = 0; i < node.data.length; i++) {
    var range = document.createRange(); range.setStart(node, i); range.setEnd(node, i + 1);
    var r = range.getBoundingClientRect();
    chars.push({c: node.data[i], top: r.top, right: r.right});
  }
}
var b = box.getBoundingClientRect(), style = getComputedStyle(box);
return {chars: chars, limit: b.right - parseFloat(style.paddingRight) - parseFloat(style.borderRightWidth),
        scroll: box.scrollWidth, client: box.clientWidth, title: el.title, text: el.textContent};
"""


def _between_words(before: str, after: str) -> bool:
    return before in "_-/" or (before.islower() and after.isupper())


def _assert_wraps_between_words(dash: Dashboard, name_css: str, box_css: str, where: str) -> int:
    """The name's lines; fails when one ends inside a word or the name leaves its box."""
    layout: dict[str, Any] = dash.wait(
        lambda: dash.js(
            "var el = document.querySelector(arguments[0]), box = document.querySelector(arguments[1]);"
            "return el && box ? (function () {" + _LAYOUT + "}).apply(null, [el, box]) : null;",
            name_css,
            box_css,
        ),
        f"{where}: the name",
    )
    chars = layout["chars"]
    assert "".join(c["c"] for c in chars) == SCRIPT, (where, layout["text"])  # whole, not cut
    breaks = [i for i in range(1, len(chars)) if chars[i]["top"] > chars[i - 1]["top"] + 1]
    inside = [SCRIPT[:i] + " | " + SCRIPT[i:] for i in breaks if not _between_words(SCRIPT[i - 1], SCRIPT[i])]
    assert not inside, (where, "split inside a word", inside)
    widest = max(c["right"] for c in chars)
    assert widest <= layout["limit"] + 0.5, (where, "past its box", widest, layout["limit"])
    assert layout["scroll"] <= layout["client"], (where, "its box overflows", layout)
    return len(breaks) + 1


def test_a_long_script_name_wraps_between_words_inside_its_cell(dash: Dashboard, jobs: Jobs, artifacts: Any) -> None:
    assert len(SCRIPT) == 60
    jobs(FakeHost("longname-node"), "gpu-l0ngname", gpu=0, memory=4 * GIB, cmdline=f"python exp/{SCRIPT} --lr 1e-4")
    dash.open()
    dash.wait(lambda: dash.has_row("gpu-l0ngname"), "the job's row appears")
    row = "#proc-gpu-l0ngname"
    try:
        for width, height in VIEWPORTS:
            dash.viewport(width, height)
            lines = _assert_wraps_between_words(dash, f"{row} .job-name", f"{row} td.col-name", f"row at {width} px")
            assert lines >= 2, "60 characters do not fit one line of the column: the test would prove nothing"
            assert dash.overflow()["scroll"] <= width
            dash.d.save_screenshot(str(artifacts / f"long-name-{width}.png"))
        dash.open("jobs/gpu-l0ngname")
        for width, height in VIEWPORTS:
            dash.viewport(width, height)
            _assert_wraps_between_words(dash, "#job-title", ".job-head", f"job page at {width} px")
    finally:
        dash.reset_viewport()
