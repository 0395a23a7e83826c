"""python/flexium/_C.pyi against the built flexium._C: the same public names, and for each
function, method and property the same parameters (names, order, which have defaults, default
values the stub spells out) and types. pybind11 writes every signature into the first line of
its docstring; mypy's stubtest cannot read those, so this test does."""

from __future__ import annotations

import ast
import re
from pathlib import Path
from typing import Any

import pytest

from flexium import _C

STUB = Path(__file__).resolve().parents[2] / "python" / "flexium" / "_C.pyi"
# pybind11's names for what the stub spells shorter (an int parameter takes __int__ or __index__).
RUNTIME_SPELLINGS = (
    ("typing.SupportsInt | typing.SupportsIndex", "int"),
    ("collections.abc.", ""),
    ("flexium._C.", ""),
)
# Dunders pybind11 or def_repr add that a stub need not repeat.
IGNORED_MEMBERS = {"__repr__", "_pybind11_conduit_v1_"}


class Signature:
    def __init__(self, params: list[tuple[str, str, str | None]], returns: str) -> None:
        self.params = params  # (name, type, default text; "..." where the stub leaves it out; None: no default)
        self.returns = returns

    def differences(self, runtime: Signature) -> list[str]:
        found = []
        if [p[0] for p in self.params] != [p[0] for p in runtime.params]:
            found.append(f"parameters {[p[0] for p in self.params]} != {[p[0] for p in runtime.params]}")
            return found
        for (name, stub_type, stub_default), (_, runtime_type, runtime_default) in zip(
            self.params, runtime.params, strict=True
        ):
            if stub_type != runtime_type:
                found.append(f"{name}: {stub_type} != {runtime_type}")
            if (stub_default is None) != (runtime_default is None):
                found.append(f"{name}: default {stub_default} != {runtime_default}")
            elif stub_default not in (None, "...") and stub_default != runtime_default:
                found.append(f"{name}: default {stub_default} != {runtime_default}")
        if self.returns != runtime.returns:
            found.append(f"returns {self.returns} != {runtime.returns}")
        return found


def normalized(text: str) -> str:
    for long, short in RUNTIME_SPELLINGS:
        text = text.replace(long, short)
    return text.strip()


def split_top_level(text: str) -> list[str]:
    parts, depth, current = [], 0, ""
    for char in text:
        if char in "[(":
            depth += 1
        elif char in "])":
            depth -= 1
        if char == "," and depth == 0:
            parts.append(current)
            current = ""
        else:
            current += char
    return [p.strip() for p in parts + [current] if p.strip()]


def runtime_signature(obj: Any, *, method: bool) -> Signature:
    """From pybind11's first docstring line: "name(a: int, b: int = -1) -> str"."""
    first = (obj.__doc__ or "").splitlines()[0] if obj.__doc__ else ""
    match = re.fullmatch(r"\w*\((.*)\) -> (.+)", first)
    assert match, f"no pybind11 signature in {first!r}"
    params = []
    for part in split_top_level(match.group(1)):
        name, _, rest = part.partition(": ")
        type_text, _, default = rest.partition(" = ")
        params.append((name, normalized(type_text), default or None))
    if method:
        params = params[1:]  # self
    return Signature(params, normalized(match.group(2)))


def stub_signature(node: ast.FunctionDef, *, method: bool) -> Signature:
    args = node.args.args[1:] if method else node.args.args
    defaults: list[ast.expr | None] = [None] * (len(args) - len(node.args.defaults)) + list(node.args.defaults)
    params = []
    for arg, default in zip(args, defaults, strict=True):
        assert arg.annotation is not None, f"{node.name}: {arg.arg} has no type"
        params.append((arg.arg, ast.unparse(arg.annotation), None if default is None else ast.unparse(default)))
    assert node.returns is not None, f"{node.name} has no return type"
    return Signature(params, ast.unparse(node.returns))


def is_property(node: ast.FunctionDef) -> bool:
    return any(isinstance(d, ast.Name) and d.id == "property" for d in node.decorator_list)


def class_differences(name: str, node: ast.ClassDef, runtime: type) -> list[str]:
    found: list[str] = []
    if isinstance(getattr(runtime, "__members__", None), dict):  # a py::enum_
        stub_members = [
            a.target.id
            for a in node.body
            if isinstance(a, ast.AnnAssign)
            and isinstance(a.target, ast.Name)
            and ast.unparse(a.annotation) == f"ClassVar[{name}]"
        ]
        if stub_members != list(runtime.__members__):
            found.append(f"{name}: members {stub_members} != {list(runtime.__members__)}")
        stub_properties = sorted(f.name for f in node.body if isinstance(f, ast.FunctionDef) and is_property(f))
        if stub_properties != ["name", "value"]:
            found.append(f"{name}: the stub's properties are {stub_properties}, an enum has name and value")
        return found
    stub_members = {f.name: f for f in node.body if isinstance(f, ast.FunctionDef)}
    runtime_members = {}
    for member, value in vars(runtime).items():
        if member in IGNORED_MEMBERS:
            continue
        if isinstance(value, property):
            runtime_members[member] = value
        elif member == "__init__" and (value.__doc__ or "").startswith("__init__("):
            runtime_members[member] = value  # a constructor bound with py::init
        elif not member.startswith("_") and callable(value):
            runtime_members[member] = value
    for missing in sorted(runtime_members.keys() - stub_members.keys()):
        found.append(f"{name}.{missing} is not in the stub")
    for extra in sorted(stub_members.keys() - runtime_members.keys()):
        found.append(f"{name}.{extra} is in the stub, not in the module")
    for member in sorted(runtime_members.keys() & stub_members.keys()):
        value, stub = runtime_members[member], stub_members[member]
        if isinstance(value, property) != is_property(stub):
            found.append(f"{name}.{member}: property in one, method in the other")
            continue
        live = runtime_signature(value.fget if isinstance(value, property) else value, method=True)
        found += [f"{name}.{member}: {d}" for d in stub_signature(stub, method=True).differences(live)]
    return found


def differences(stub_source: str, module: Any) -> list[str]:
    tree = ast.parse(stub_source)
    stub: dict[str, ast.AST] = {}
    for node in tree.body:
        if isinstance(node, (ast.FunctionDef, ast.ClassDef)):
            stub[node.name] = node
        elif isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name):
            stub[node.target.id] = node
        elif isinstance(node, ast.ImportFrom):  # "from m import X as X" re-exports X
            stub.update({a.name: node for a in node.names if a.asname == a.name})
    runtime = {name: getattr(module, name) for name in dir(module) if not name.startswith("_")}

    found = [f"{n} is not in the stub" for n in sorted(runtime.keys() - stub.keys())]
    found += [f"{n} is in the stub, not in the module" for n in sorted(stub.keys() - runtime.keys())]
    for name in sorted(runtime.keys() & stub.keys()):
        value, node = runtime[name], stub[name]
        if isinstance(node, ast.ImportFrom):
            if getattr(value, "__module__", None) != node.module:
                found.append(f"{name}: the stub takes it from {node.module}, the module from {value.__module__}")
        elif isinstance(node, ast.ClassDef):
            if not isinstance(value, type):
                found.append(f"{name} is a class in the stub only")
            else:
                found += class_differences(name, node, value)
        elif isinstance(node, ast.FunctionDef):
            if isinstance(value, type) or not callable(value):
                found.append(f"{name} is a function in the stub only")
            else:
                found += [
                    f"{name}: {d}"
                    for d in stub_signature(node, method=False).differences(runtime_signature(value, method=False))
                ]
        elif isinstance(node, ast.AnnAssign) and ast.unparse(node.annotation) != type(value).__name__:
            found.append(f"{name}: {ast.unparse(node.annotation)} != {type(value).__name__}")
    return found


def test_the_stub_matches_the_built_module() -> None:
    assert differences(STUB.read_text(), _C) == []


def test_driver_error_is_flexiums_own_error() -> None:
    from flexium.errors import DriverError, FlexiumError

    assert _C.DriverError is DriverError and issubclass(DriverError, FlexiumError)
    assert issubclass(DriverError, RuntimeError)  # callers that caught RuntimeError still do


@pytest.mark.parametrize(
    ("before", "after", "expected"),
    [
        ("def lock(pid: int, timeout_ms: int)", "def lock(pid: int, timeout: int)", "lock: parameters"),
        (
            "def vmm_segments() -> list[SegmentInfo]",
            "def vmm_segments() -> list[tuple[int, int]]",
            "vmm_segments: returns",
        ),
        (
            "def restore_segments_from_host(device: int = -1)",
            "def restore_segments_from_host(device: int = 0)",
            "restore_segments_from_host: device: default",
        ),
        (
            "def map_imported(staged: Sequence[StagedSegment],",
            "def map_imported(staged: Sequence[int],",
            "map_imported: staged:",
        ),
        ("    @property\n    def fd(self) -> int: ...\n", "", "StagedSegment.fd is not in the stub"),
        (
            "def abort_host_order() -> None: ...\n",
            "def abort_host_order() -> None: ...\ndef gone() -> None: ...\n",
            "gone is in the stub, not in the module",
        ),
        ("def unlock(pid: int) -> None: ...\n", "", "unlock is not in the stub"),
        ("    FAILED: ClassVar[ProcessState]\n", "", "ProcessState: members"),
        (
            "    def sleep(self) -> None: ...\n",
            "    @property\n    def sleep(self) -> None: ...\n",
            "HostCopier.sleep: property in one",
        ),
        ("CHECKPOINT_API_VERSION: int", "CHECKPOINT_API_VERSION: str", "CHECKPOINT_API_VERSION: str != int"),
    ],
)
def test_a_stub_that_drifted_is_caught(before: str, after: str, expected: str) -> None:
    source = STUB.read_text()
    assert before in source
    found = differences(source.replace(before, after, 1), _C)
    assert any(d.startswith(expected) for d in found), found
