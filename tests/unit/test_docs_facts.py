"""The docs stay true to the repository. docs/facts.md is the one list of measured facts, each under
a stable name (its heading), and every citation of one, in code, tests and docs, is the word fact
(or facts) followed by names in backticks; a citation by a number, the form of the two numbered
lists it replaced, fails. Every repository path a doc names in backticks exists (or is listed as
gone in bench/probes/README.md), every relative link of docs/ and the bench READMEs resolves,
anchors included, and every benchmark run a doc cites has its section in docs/measurements.md.
The user guide's own links are tests/unit/test_user_guide.py's."""

from __future__ import annotations

import re
from functools import cache, lru_cache
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
FACTS = ROOT / "docs" / "facts.md"
MEASUREMENTS = ROOT / "docs" / "measurements.md"
PROBES_README = ROOT / "bench" / "probes" / "README.md"

# Where citations may be: every text file of these folders, and the files at the top.
SCANNED_DIRS = ("python", "csrc", "tests", "bench", "docs", "ci", "examples")
SCANNED_TOP = ("README.md", "pyproject.toml", "CMakeLists.txt")
TEXT_SUFFIXES = {".py", ".pyi", ".md", ".c", ".h", ".cpp", ".sh", ".toml", ".txt", ".yml", ".yaml", ".html", ".js"}
SKIPPED_PARTS = {"__pycache__", "build", ".venv", "node_modules"}
# The docs whose backticked paths must exist.
PATH_DOCS = (
    *sorted((ROOT / "docs").glob("*.md")),
    *sorted((ROOT / "docs" / "guide").glob("*.md")),
    ROOT / "README.md",
    ROOT / "bench" / "README.md",
    PROBES_README,
)
# The docs whose benchmark runs must be in docs/measurements.md.
RUN_DOCS = (*sorted((ROOT / "docs").glob("*.md")), *sorted((ROOT / "docs" / "guide").glob("*.md")), ROOT / "README.md")
# The docs whose relative links this test resolves (the guide and README are test_user_guide's).
LINK_DOCS = (*sorted((ROOT / "docs").glob("*.md")), ROOT / "bench" / "README.md", PROBES_README)
# Where the docs' short paths start: the repository, the package (with its folder or without), and the
# engine and server inside it (docs/design.md's tables name their modules from there).
PACKAGE = ROOT / "python" / "flexium"
PATH_BASES = (ROOT, ROOT / "python", PACKAGE, PACKAGE / "engine", PACKAGE / "server")

# What may stand between "fact" and what it cites: spaces and line breaks, a comment's marker, a
# string literal continued on the next line.
_GAP = r"""(?:\s|\#|//|\*|"\s*\n\s*f?")+"""
NAME = r"`([a-z0-9]+(?:-[a-z0-9]+)*)`"
# One cited name, linked in docs or not: `name` or [`name`](...facts.md#name) or [fact `<name>`](...).
_CITED = r"\[?`[a-z0-9-]+`(?:\]\([^)\s]*\))?"
CITATION = re.compile(r"\[?\b[Ff]acts?" + _GAP + _CITED + r"(?:(?:,\s*and|,|\s+and)" + _GAP + _CITED + r")*")
NUMBERED = re.compile(r"\b[Ff]acts?" + _GAP + r"\d+")
LINK = re.compile(r"\[[^\]]*\]\(([^)\s]+)\)")
FENCE = re.compile(r"^```[^\n]*\n.*?^```", re.M | re.S)
INLINE_CODE = re.compile(r"`([^`\n]+)`")
PATH = re.compile(r"^[\w.-]+(?:/[\w.*-]+)+/?$")
RUN_CITATION = re.compile(r"\b[Rr]uns?\s+(\d+[a-c]?(?![\w-])(?:(?:,\s*|\s+and\s+|–)(?:\d+[a-c]?|[a-c])(?![\w-]))*)")


def _text_files() -> list[Path]:
    files = [ROOT / name for name in SCANNED_TOP]
    for folder in SCANNED_DIRS:
        for path in sorted((ROOT / folder).rglob("*")):
            if path.suffix in TEXT_SUFFIXES and path.is_file() and not SKIPPED_PARTS & set(path.parts):
                files.append(path)
    return files


def _where(path: Path, text: str, offset: int) -> str:
    return f"{path.relative_to(ROOT)}:{text.count(chr(10), 0, offset) + 1}"


def _slug(heading: str) -> str:
    """GitHub's anchor for a heading."""
    text = heading.strip().lower().replace("`", "")
    return re.sub(r"\s", "-", re.sub(r"[^\w\s-]", "", text))


@cache
def _anchors(page: Path) -> frozenset[str]:
    text = FENCE.sub("", page.read_text())
    return frozenset(_slug(m.group(1)) for m in re.finditer(r"^#+ (.+)$", text, re.M))


@lru_cache(maxsize=1)
def fact_names() -> tuple[str, ...]:
    """The facts, by the names of their headings (### `name`)."""
    return tuple(re.findall(r"^### " + NAME + r"\s*$", FACTS.read_text(), re.M))


def test_every_fact_has_one_kebab_case_name() -> None:
    names = fact_names()
    assert len(names) >= 50, f"docs/facts.md: {len(names)} facts found under '### `name`' headings"
    assert len(set(names)) == len(names), sorted(n for n in names if names.count(n) > 1)
    numbered = re.findall(r"^#+ .*\b[Ff]act \d", FACTS.read_text(), re.M)
    assert not numbered, numbered


def test_every_cited_fact_exists() -> None:
    known = set(fact_names())
    unknown, cited = [], 0
    for path in _text_files():
        text = path.read_text(errors="replace")
        for m in CITATION.finditer(text):
            for name in re.findall(NAME, m.group(0)):
                cited += 1
                if name not in known:
                    unknown.append(f"{_where(path, text, m.start())}: fact `{name}`")
    assert not unknown, "citations of facts docs/facts.md does not have:\n" + "\n".join(unknown)
    assert cited >= 200, cited  # the scan reads the code, tests and docs


def test_no_fact_is_cited_by_a_number() -> None:
    numbered = []
    for path in _text_files():
        text = path.read_text(errors="replace")
        numbered += [f"{_where(path, text, m.start())}: {m.group(0)!r}" for m in NUMBERED.finditer(text)]
    assert not numbered, "cite a fact by its name (fact `<name>`), not by a number:\n" + "\n".join(numbered)


def test_a_citation_by_an_unknown_name_or_a_number_is_caught() -> None:
    known, number = fact_names()[0], 12  # written apart, so that this file cites nothing by a number
    text = f'# see facts `{known}` and `no-such-fact`, fact {number} and fact "\n    "`{known}`'
    assert [re.findall(NAME, m.group(0)) for m in CITATION.finditer(text)] == [[known, "no-such-fact"], [known]]
    assert [m.group(0) for m in NUMBERED.finditer(text)] == [f"fact {number}"]
    linked = f"[fact `{known}`](facts.md#{known}) and facts [`{known}`](x.md#{known}) and [`a-b`](y.md#a-b)"
    assert [re.findall(NAME, m.group(0)) for m in CITATION.finditer(linked)] == [[known], [known, "a-b"]]


def test_every_link_to_a_fact_names_its_anchor() -> None:
    """A linked citation's text and anchor name the same fact."""
    wrong = []
    for path in _text_files():
        if path.suffix != ".md":
            continue
        text = path.read_text()
        for m in re.finditer(r"\[(?:facts? )?`([a-z0-9-]+)`\]\(([^)\s]*)\)", text):
            if m.group(2).partition("#")[0].endswith("facts.md") or path == FACTS:
                if m.group(2).partition("#")[2] != m.group(1):
                    wrong.append(f"{_where(path, text, m.start())}: {m.group(0)}")
    assert not wrong, wrong


@lru_cache(maxsize=1)
def gone_paths() -> frozenset[str]:
    """The paths bench/probes/README.md lists as retired or renamed: docs may name them as history."""
    text = PROBES_README.read_text()
    section = text[text.index("## Retired probes and former names") :]
    return frozenset(m.group(1) for m in re.finditer(r"^\| `([^`]+)` \|", section, re.M))


def _repository_path(span: str) -> str | None:
    """The path a backticked span names, when it names one of the repository's (else None)."""
    token = span.split()[0].split("::")[0] if span.strip() else ""
    if not PATH.match(token) or token.startswith(("/", "~", "./")):
        return None
    return token


def _exists(doc: Path, path: str) -> bool | None:
    """Whether `path` exists under a base where its first folder does; None when no base has that
    folder (not a path of this repository: torch's, the host's)."""
    first = path.split("/")[0]
    bases = [base for base in (doc.parent, *PATH_BASES) if (base / first).exists() or first == ".."]
    if not bases:
        return None
    return any(list(base.glob(path.rstrip("/"))) if "*" in path else (base / path).exists() for base in bases)


def test_every_repository_path_in_the_docs_exists() -> None:
    missing, checked = [], 0
    for doc in PATH_DOCS:
        text = FENCE.sub("", doc.read_text())
        for m in INLINE_CODE.finditer(text):
            path = _repository_path(m.group(1))
            if path is None or path in gone_paths():
                continue
            exists = _exists(doc, path)
            if exists is None:
                continue
            checked += 1
            if not exists:
                missing.append(f"{doc.relative_to(ROOT)}: `{path}`")
    assert not missing, "paths the docs name that the repository does not hold:\n" + "\n".join(missing)
    assert checked >= 150, checked


def test_a_stale_path_is_caught_and_a_foreign_one_left_alone() -> None:
    design = ROOT / "docs" / "design.md"
    assert _exists(design, "engine/fast/path.py") and _exists(design, "csrc/vmm_registry.*")
    assert _exists(design, "engine/fast_path.py") is False and _exists(design, "bench/staging_probe.py") is False
    assert _exists(design, "torch/utils/data/_utils/pin_memory.py") is None


def test_the_gone_paths_are_gone() -> None:
    """A path listed as retired that exists again is a doc to correct."""
    assert gone_paths() and not [p for p in gone_paths() if (ROOT / p).exists()]


def test_every_relative_link_of_the_docs_resolves() -> None:
    broken, checked = [], 0
    for doc in LINK_DOCS:
        text = FENCE.sub("", doc.read_text())
        for m in LINK.finditer(text):
            target = m.group(1)
            if re.match(r"[a-z]+:", target):
                continue
            file_part, _, anchor = target.partition("#")
            resolved = (doc.parent / file_part).resolve() if file_part else doc
            checked += 1
            if not resolved.exists():
                broken.append(f"{doc.relative_to(ROOT)}: {target}")
            elif anchor and resolved.suffix == ".md" and anchor not in _anchors(resolved):
                broken.append(f"{doc.relative_to(ROOT)}: no heading for #{anchor} in {resolved.name}")
    assert not broken, broken
    assert checked >= 100, checked


def _runs(text: str) -> set[str]:
    """The runs a text names: "run 10", "runs 12 and 13", "runs 11–13" (both ends), "runs 14a–c"."""
    found = set()
    for m in RUN_CITATION.finditer(text):
        last = ""
        for part in re.split(r",\s*|\s+and\s+", m.group(1)):
            for piece in part.split("–"):
                if piece and piece[0].isdigit():
                    last = piece
                    found.add(piece)
                elif piece:  # "14a–c": the number is the previous piece's
                    found.add(re.sub(r"[a-c]$", "", last) + piece)
    return found


def test_every_cited_run_has_its_section_in_measurements() -> None:
    headings = re.findall(r"^### (?:Runs?|Before run) (.+)$", MEASUREMENTS.read_text(), re.M)
    measured = set().union(*(_runs("runs " + h.split(" (")[0]) for h in headings))
    assert {"10", "14c", "17"} <= measured, measured
    cited = {}
    for doc in RUN_DOCS:
        if doc != MEASUREMENTS:
            cited.update({run: doc.relative_to(ROOT) for run in _runs(doc.read_text())})
    assert not {run: doc for run, doc in cited.items() if run not in measured}, measured
