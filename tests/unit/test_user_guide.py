"""The user guide (docs/guide/) stays true to the code: every `flexium ...` command line it shows
parses with the real parser, every FLEXIUM_* variable it names is read somewhere, every message
it quotes is one the code can print, every Python example compiles (tests/e2e runs them), every
YAML block parses, and every relative link and image resolves, anchors included.

A quoted message is a line of a ```text block. It must be an instance of a message the code
builds: a string literal, an f-string or a %-format of python/flexium, whose placeholders may
stand for anything (so an example's ids and sizes pass, its wording must be the code's). The
line may carry the prefixes flexium prints ("[flexium] WARNING: ", "flexium: ", an exception's
name). A message whose fixed text is shorter than MIN_LITERAL explains nothing; the command
line's outcome line (`flexium: migrate PROC to cuda:1 failed: <reason>`), the engine's
`cannot pause: <reason>` and the server's target refusals are checked by their reason."""

from __future__ import annotations

import argparse
import ast
import re
import shlex
from functools import lru_cache
from pathlib import Path

import pytest
import yaml

from flexium import config
from flexium.cli.main import build_parser

ROOT = Path(__file__).resolve().parents[2]
GUIDE = ROOT / "docs" / "guide"
PAGES = sorted(GUIDE.glob("*.md"))
SOURCE = ROOT / "python" / "flexium"

FENCE = re.compile(r"^```([\w-]*)\n(.*?)^```", re.M | re.S)
INLINE_CODE = re.compile(r"`([^`\n]+)`")
LINK = re.compile(r"!?\[[^\]]*\]\(([^)\s]+)\)|<img [^>]*src=\"([^\"]+)\"")
ENV_NAME = re.compile(r"\b(FLEXIUM_[A-Z_]+|GPU_DEVICE|NCCL_NVLS_ENABLE|NCCL_CUMEM_HOST_ENABLE)\b")
PLACEHOLDER = "\x00"
# A %-format field (logging's) or an f-string's field: either may stand for any text.
PERCENT_FIELD = re.compile(r"%(?:\([^)]*\))?[-#0 +]*\d*(?:\.\d+)?[sdifrxXeEgGc]")
PREFIXES = re.compile(
    r"^(?:\[flexium\] (?:(?:WARNING|ERROR|CRITICAL): )?|flexium(?: server)?: |[\w.]*(?:Error|Exception): )"
)
MIN_LITERAL = 14  # a template with less fixed text than this says nothing about the wording
# Messages that put a head before another message, whose wording must then be a message too: the
# command line's outcome (`flexium: {title} {state}: {reason}`, cli/moves.py, cli/jobs.py), the engine's
# refusal of one rank (`cannot {kind}: {reason}`, engine/engine.py) and the server's target
# refusal (`GPU {uuid} cannot take process {id!r}: {reason}`, server/storage/targets.py).
COMPOSED_HEADS = (
    re.compile(r"^flexium: (?:migrate|pause|resume) (?:job )?\S+(?: to \S+)? (?:failed|expired): "),
    re.compile(r"^cannot (?:migrate|pause|resume): "),
    re.compile(r"^flexium: GPU \S+ cannot take process '[^']+': "),
    # engine/fast/path.py keep_ready, as the keeper logs it: pinned_budget's refusal, copier_room_problem's
    # reason; engine/fast/kept_staging.py: a job's refusal (job_operation.job_problem)
    re.compile(
        r"^(?:\[flexium\] )?(?:the staging for a pause is prepared when one is asked for|nothing is kept pinned "
        r"for a pause for now|nothing is kept pinned between pauses: a pause of this job is refused now): "
    ),
)
# Log messages that are a fixed head and one other message ("...: %s"), after flexium's prefix.
LOGGED_HEADS = (
    "migration and pause are limited: ",  # api/runtime.py, a capability problem follows
    "fast path off, migrations and pauses use the driver path: ",  # api/runtime.py, the pool's reason
)


def _blocks(kind: str) -> list[tuple[str, str]]:
    """(page name, block text) of every fenced block of this kind in the guide."""
    return [(page.name, m.group(2)) for page in PAGES for m in FENCE.finditer(page.read_text()) if m.group(1) == kind]


def test_the_guide_has_its_pages_and_the_readme_points_to_it() -> None:
    names = {page.name for page in PAGES}
    expected = {"README.md", "quick-start.md", "api.md", "configuration.md", "moves.md", "limits.md"}
    assert expected | {"launching.md", "server.md", "troubleshooting.md"} <= names
    index = (GUIDE / "README.md").read_text()
    for name in names - {"README.md"}:
        assert f"({name})" in index, f"the index does not link {name}"
    assert "](docs/guide/README.md)" in (ROOT / "README.md").read_text()


# --- command lines ------------------------------------------------------------------------------


def _command_lines() -> list[tuple[str, str]]:
    found: list[tuple[str, str]] = []
    for page in PAGES:
        text = page.read_text()
        for m in FENCE.finditer(text):
            if m.group(1) not in ("bash", "console"):
                continue
            for line in m.group(2).splitlines():
                line = line.strip()
                if m.group(1) == "console":
                    if not line.startswith("$ "):
                        continue
                    line = line[2:]
                for part in re.split(r"\s*(?:&&|;)\s*", line):
                    found.append((page.name, part.split(" | ")[0]))  # what a pipe feeds is not flexium's
        outside = FENCE.sub("", text)
        found += [(page.name, span) for span in INLINE_CODE.findall(outside) if " | " not in span]
    commands = []
    for page, line in found:
        words = shlex.split(line, comments=True) if line else []
        while words and re.fullmatch(r"[A-Za-z_][A-Za-z0-9_]*=.*", words[0]):
            words.pop(0)  # VAR=value in front of the command
        if words[:1] == ["flexium"] and len(words) > 1:
            commands.append((page, " ".join(shlex.quote(w) for w in words)))
    return commands


COMMANDS = _command_lines()


def test_the_guide_shows_commands_of_every_kind() -> None:
    shown = {shlex.split(line)[1] for _, line in COMMANDS}
    assert {"server", "workspace", "token", "ps", "devices", "migrate", "pause", "resume", "doctor", "demo"} <= shown


@pytest.mark.parametrize(("page", "line"), COMMANDS, ids=[f"{p}: {c}" for p, c in COMMANDS])
def test_every_command_line_parses(page: str, line: str, capsys: pytest.CaptureFixture[str]) -> None:
    words = shlex.split(line)[1:]
    parser = build_parser()
    if len(words) == 1 or words[1:] == ["--help"]:  # a command named in the text: it must exist
        commands = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction))
        assert words[0] in commands.choices, f"{page}: there is no command `{line}`"
        return
    try:
        parser.parse_args(words)
    except SystemExit as exc:
        raise AssertionError(f"{page}: `{line}` does not parse: {capsys.readouterr().err.strip()}") from exc


# --- environment variables ----------------------------------------------------------------------


@lru_cache(maxsize=1)
def _source_text() -> str:
    return "\n".join(path.read_text() for path in sorted(SOURCE.rglob("*.py")))


def test_every_environment_variable_named_is_read_by_the_code() -> None:
    names = {name for page in PAGES for name in ENV_NAME.findall(page.read_text())}
    assert {config.ENV_SERVER, config.ENV_TOKEN, config.ENV_DEVICE, "FLEXIUM_DATABASE_URL"} <= names
    tests = "\n".join(path.read_text() for path in sorted((ROOT / "tests").rglob("*.py")))
    unknown = sorted(name for name in names if f'"{name}"' not in _source_text() + tests)
    assert not unknown, f"the guide names variables no code reads: {unknown}"


# --- quoted messages ----------------------------------------------------------------------------


def _literal_text(node: ast.AST) -> str | None:
    """A string literal or an f-string as text with PLACEHOLDER for each field."""
    if isinstance(node, ast.Constant) and isinstance(node.value, str):
        return node.value
    if isinstance(node, ast.JoinedStr):
        parts = []
        for value in node.values:
            if isinstance(value, ast.Constant) and isinstance(value.value, str):
                parts.append(value.value)
            else:
                parts.append(PLACEHOLDER)
        return "".join(parts)
    return None


@lru_cache(maxsize=1)
def _templates() -> list[tuple[re.Pattern[str], int, bool]]:
    """Every line of every string the code builds, as a pattern, its amount of fixed text, and
    whether it ends in fixed text (not in a field that may hold another message)."""
    seen: set[str] = set()
    for path in sorted(SOURCE.rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text())):
            text = _literal_text(node)
            if text is None:
                continue
            if isinstance(node, ast.Constant):
                text = PERCENT_FIELD.sub(PLACEHOLDER, text).replace("%%", "%")
            seen.update(line for line in text.split("\n") if line.strip())
    templates = []
    for line in seen:
        pieces = line.split(PLACEHOLDER)
        if len(pieces) == 2 and not pieces[1]:
            continue  # fixed text then one field ("server address {...}"): a prefix says nothing of the rest
        literal = sum(len(p) for p in pieces)
        pattern = re.compile("(?:.+?)".join(re.escape(p) for p in pieces), re.S)
        templates.append((pattern, literal, pieces[-1] != ""))
    return templates


def _is_message(text: str, least: int, *, closed: bool = False) -> bool:
    return any(
        literal >= least and (ends_fixed or not closed) and pattern.fullmatch(text)
        for pattern, literal, ends_fixed in _templates()
    )


def _explained(line: str) -> bool:
    heads = [m for m in (pattern.match(line) for pattern in COMPOSED_HEADS) if m is not None]
    if heads:
        tails = any(_is_message(line[head.end() :], MIN_LITERAL) for head in heads)
        return tails or _is_message(line, MIN_LITERAL, closed=True)
    stripped = PREFIXES.sub("", line)
    for head in LOGGED_HEADS:
        if stripped.startswith(head):
            return _is_message(stripped[len(head) :], MIN_LITERAL)
    return _is_message(line, MIN_LITERAL) or _is_message(stripped, MIN_LITERAL)


def test_the_logged_heads_are_the_codes() -> None:
    for head in LOGGED_HEADS:
        assert f'"{head}%s"' in _source_text(), head


QUOTED = [(page, line) for page, block in _blocks("text") for line in block.splitlines() if line.strip()]


def test_the_guide_quotes_messages() -> None:
    assert len(QUOTED) >= 40


@pytest.mark.parametrize(("page", "line"), QUOTED, ids=[f"{p}: {line[:70]}" for p, line in QUOTED])
def test_every_quoted_message_is_one_the_code_prints(page: str, line: str) -> None:
    assert _explained(line), f"{page}: no message of python/flexium reads like this:\n{line}"


def test_a_reworded_message_is_caught() -> None:
    real = "flexium: no process 'gpu-0000' in workspace 'vision' (`flexium ps` lists them)"
    assert _explained(real)
    assert not _explained(real.replace("lists them", "shows them"))
    assert not _explained("flexium: GPU GPU-1 cannot host process 'gpu-1': the job is already on it")
    assert not _explained("flexium: GPU GPU-1 cannot take process 'gpu-1': the job is on it already")
    assert _explained("flexium: GPU GPU-1 cannot take process 'gpu-1': the job is already on it")


# --- examples, YAML, links ----------------------------------------------------------------------


@pytest.mark.parametrize(("page", "code"), _blocks("python"), ids=[p for p, _ in _blocks("python")])
def test_every_python_example_compiles(page: str, code: str) -> None:
    compile(code, f"{page} example", "exec")


# Top-level keys of the other files the guide shows in YAML: Kubernetes objects, Prometheus's configuration.
OTHER_YAML = {"apiVersion", "scrape_configs"}


def test_yaml_blocks_parse_and_flexiumrc_examples_use_known_keys() -> None:
    blocks = _blocks("yaml")
    assert blocks
    for page, block in blocks:
        for document in yaml.safe_load_all(block):
            assert isinstance(document, dict), (page, document)
            if not set(document) & OTHER_YAML:  # a .flexiumrc
                known = {rc_key for rc_key, _env, _label in config._FIELDS.values()}
                assert set(document) <= known, (page, set(document) - known)


def _slug(heading: str) -> str:
    """GitHub's anchor for a heading."""
    text = heading.strip().lower().replace("`", "")
    return re.sub(r"\s", "-", re.sub(r"[^\w\s-]", "", text))


def _anchors(page: Path) -> set[str]:
    text = FENCE.sub("", page.read_text())
    return {_slug(m.group(1)) for m in re.finditer(r"^#+ (.+)$", text, re.M)}


def test_every_relative_link_and_image_resolves() -> None:
    checked = 0
    for page in [*PAGES, ROOT / "README.md"]:
        for m in LINK.finditer(FENCE.sub("", page.read_text())):
            target = m.group(1) or m.group(2)
            if re.match(r"[a-z]+:", target):
                continue
            path_part, _, anchor = target.partition("#")
            resolved = (page.parent / path_part).resolve() if path_part else page
            assert resolved.exists(), f"{page.name}: broken link {target}"
            if anchor:
                assert anchor in _anchors(resolved), f"{page.name}: no heading for #{anchor} in {resolved.name}"
            if resolved.suffix == ".png":
                assert resolved.parent == ROOT / "docs" / "images", target
            checked += 1
    assert checked >= 30
