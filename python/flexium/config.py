"""Where flexium's settings come from, validated once.

Priority, highest first: parameters, environment variables (FLEXIUM_SERVER, GPU_DEVICE,
FLEXIUM_TOKEN, FLEXIUM_LOG_LEVEL, FLEXIUM_FAST_PATH, FLEXIUM_SAFE_POINT_WAIT, FLEXIUM_PRIORITY), the config file
(./.flexiumrc if it exists, else ~/.flexiumrc; only one is read), defaults (local mode,
"cuda:0"). Every rejected value is reported with where it came from and what a good value
looks like.
"""

from __future__ import annotations

import difflib
import ipaddress
import os
import re
import sys
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from types import MappingProxyType
from typing import Any

import yaml

from flexium import protocol
from flexium._logging import DEFAULT_LEVEL, LEVEL_NAMES, get_logger, normalize_level
from flexium.errors import ConfigError
from flexium.protocol import ServerAddress

__all__ = [
    "ENV_SERVER",
    "ENV_DEVICE",
    "ENV_TOKEN",
    "ENV_LOG_LEVEL",
    "ENV_FAST_PATH",
    "ENV_SAFE_POINT_WAIT",
    "ENV_PRIORITY",
    "RC_FILENAME",
    "DEFAULT_DEVICE",
    "FlexiumConfig",
    "ServerAddress",
    "load_config",
    "find_config_file",
    "parse_server_address",
    "validate_device",
]

ENV_SERVER = "FLEXIUM_SERVER"
ENV_DEVICE = "GPU_DEVICE"
ENV_TOKEN = "FLEXIUM_TOKEN"
ENV_LOG_LEVEL = "FLEXIUM_LOG_LEVEL"
ENV_FAST_PATH = "FLEXIUM_FAST_PATH"
ENV_SAFE_POINT_WAIT = "FLEXIUM_SAFE_POINT_WAIT"
ENV_PRIORITY = "FLEXIUM_PRIORITY"
DEFAULT_SAFE_POINT_WAIT = 5.0
MAX_SAFE_POINT_WAIT = 3600.0
RC_FILENAME = ".flexiumrc"
DEFAULT_DEVICE = "cuda:0"

SOURCE_PARAMETER = "parameter"
SOURCE_DEFAULT = "default"

_SERVER_EXAMPLE = "gpu-server:8080/myworkspace or http://localhost:8080/default"

# Field name -> (rc file key, environment variable, how messages name it).
_FIELDS: dict[str, tuple[str, str, str]] = {
    "orchestrator": ("server", ENV_SERVER, "server address"),
    "device": ("device", ENV_DEVICE, "device"),
    "token": ("token", ENV_TOKEN, "token"),
    "log_level": ("log_level", ENV_LOG_LEVEL, "log level"),
    "fast_path": ("fast_path", ENV_FAST_PATH, "fast path switch"),
    "safe_point_wait": ("safe_point_wait", ENV_SAFE_POINT_WAIT, "safe point wait"),
    "priority": ("priority", ENV_PRIORITY, "priority"),
}
_RC_KEYS = {rc_key: name for name, (rc_key, _, _) in _FIELDS.items()}

_log = get_logger("config")


@dataclass(frozen=True)
class FlexiumConfig:
    """The resolved settings. `sources[field]` says where each value came from: "parameter",
    an environment variable name, the config file's path, or "default"."""

    orchestrator: str | None = None
    device: str = DEFAULT_DEVICE
    token: str | None = field(default=None, repr=False)  # never printed
    log_level: str = DEFAULT_LEVEL
    # Our memory pool and the fast path it enables; false keeps PyTorch's own allocator.
    fast_path: bool = True
    # Seconds a command waits for the next optimizer step (safe point) before the driver path runs.
    safe_point_wait: float = DEFAULT_SAFE_POINT_WAIT
    # In the server's queue and when it makes room (protocol.PRIORITIES): told when the job registers.
    priority: int = protocol.DEFAULT_PRIORITY
    address: ServerAddress | None = None
    config_file: str | None = None  # the rc file that was read, if any
    sources: Mapping[str, str] = field(default_factory=dict, compare=False, hash=False)

    @property
    def server(self) -> str | None:
        """Alias of `orchestrator`, the name flexium.init() uses."""
        return self.orchestrator

    @property
    def local_mode(self) -> bool:
        """No server: the job trains normally but cannot be moved from the dashboard."""
        return self.orchestrator is None


@dataclass(frozen=True)
class _Raw:
    value: Any
    source: str  # what goes into FlexiumConfig.sources
    where: str  # how an error message names it


_HOST_RE = re.compile(r"^[A-Za-z0-9_]([A-Za-z0-9_-]*[A-Za-z0-9_])?(\.[A-Za-z0-9_]([A-Za-z0-9_-]*[A-Za-z0-9_])?)*$")
_DEVICE_RE = re.compile(r"^(?:cuda:)?(-?\d+)$")
_TOKEN_RE = re.compile(r"^[\x21-\x7e]+$")  # sent in an HTTP header: printable ASCII, no blanks


def parse_server_address(text: str, *, where: str = "") -> ServerAddress:
    """Parse `host[:port]/workspace`, optionally prefixed with http:// (the default) or https://.

    The parsing itself is `flexium.protocol.parse_server_address`, the one parser the client,
    the CLI and the server share (so a port left out means the server's default, 8080). This
    adds stricter host checks and says where a bad value came from: `where` names its origin
    in error messages, e.g. "(from FLEXIUM_SERVER)".
    """
    origin = f" {where}" if where else ""
    if not isinstance(text, str):
        raise ConfigError(
            f"server address{origin} must be a string like {_SERVER_EXAMPLE}, not {text!r} ({type(text).__name__})"
        )

    def bad(reason: str) -> ConfigError:
        joint = " " if reason.startswith(("has ", "is ", "uses ", "contains ")) else ": "
        return ConfigError(
            f"server address {text!r}{origin}{joint}{reason}; expected host[:port]/workspace, e.g. {_SERVER_EXAMPLE}"
        )

    rest = text.strip()
    if not rest:
        raise bad("is empty")
    scheme, has_scheme, _ = rest.partition("://")
    if has_scheme and scheme.lower() not in ("http", "https"):
        raise bad(f"uses scheme {scheme.lower()!r}; only http:// and https:// are supported")
    if any(c in rest for c in "?#@ \t"):
        raise bad("contains a query, fragment, user name or blank")
    try:
        address = protocol.parse_server_address(rest)
    except ValueError as exc:
        reason = str(exc)
        prefix = f"server address {rest!r}"
        if reason.startswith(prefix):
            reason = reason[len(prefix) :].lstrip(": ")
        reason = reason.split(": expected host[:port]/workspace")[0]
        raise bad(reason) from None
    host = address.host
    if ":" in host:
        try:
            ipaddress.IPv6Address(host)
        except ValueError:
            raise bad(f"has an invalid IPv6 host [{host}]") from None
    elif not _HOST_RE.match(host):
        raise bad(f"has an invalid host {host!r}")
    return address


def validate_device(value: Any, *, where: str = "") -> str:
    """Return the canonical form of a device: "cuda:N" (N >= 0) or "cpu". A bare index N (as
    torch.cuda.set_device takes it, or `GPU_DEVICE=0`) means cuda:N."""
    origin = f" {where}" if where else ""
    torch = sys.modules.get("torch")
    if torch is not None and isinstance(value, torch.device):
        value = str(value)
    if isinstance(value, int) and not isinstance(value, bool) and value >= 0:
        return f"cuda:{value}"
    if not isinstance(value, str):
        raise ConfigError(
            f"device{origin} must be a string like 'cuda:0' or 'cpu', not {value!r} ({type(value).__name__})"
        )
    text = value.strip().lower()
    if text == "cpu":
        return text
    match = _DEVICE_RE.match(text)
    if match and int(match.group(1)) >= 0:
        return f"cuda:{int(match.group(1))}"
    hint = " (name the GPU: 'cuda:0')" if text == "cuda" else ""
    raise ConfigError(
        f"device {value!r}{origin} is not valid{hint}; expected 'cuda:N' or N with N >= 0 (e.g. 'cuda:1' or 1) or 'cpu'"
    )


def _validate_token(value: Any, where: str) -> str:
    if not isinstance(value, str):
        quote = ' (quote it in YAML: token: "...")' if isinstance(value, (int, float)) else ""
        raise ConfigError(f"token {where} must be a string, not {type(value).__name__}{quote}")
    token = value.strip()
    if not _TOKEN_RE.match(token):
        # Never echo the token itself.
        raise ConfigError(
            f"token {where} is empty or contains blanks or non-ASCII characters; "
            "copy the workspace token from the dashboard again"
        )
    return token


def _validate_log_level(value: Any, where: str) -> str:
    choices = ", ".join(sorted(set(LEVEL_NAMES.values())))
    if not isinstance(value, str):
        raise ConfigError(f"log level {where} must be a level name ({choices}), not {value!r} ({type(value).__name__})")
    canonical = normalize_level(value)
    if canonical is None:
        raise ConfigError(f"log level {value!r} {where} is not a Python level name; use one of {choices} (any case)")
    return canonical


_TRUE = ("1", "true", "yes", "on")
_FALSE = ("0", "false", "no", "off")


def _validate_switch(value: Any, where: str, what: str = "fast path switch") -> bool:
    if isinstance(value, bool):
        return value
    if isinstance(value, str) and value.strip().lower() in _TRUE + _FALSE:
        return value.strip().lower() in _TRUE
    raise ConfigError(f"{what} {value!r} {where} is not valid; use true or false (also 1/0, on/off, yes/no)")


def switch_from_env(name: str, default: bool, what: str) -> bool:
    """An on/off environment variable outside the config file (ConfigError names a bad value)."""
    value = os.environ.get(name)
    if value is None or not value.strip():
        return default
    return _validate_switch(value, f"(from environment variable {name})", what)


def _validate_priority(value: Any, where: str) -> int:
    try:
        return protocol.read_priority(value if isinstance(value, (int, str)) else str(value))
    except ValueError:
        raise ConfigError(f"priority {value!r} {where} is not valid; give {protocol.PRIORITY_SYNTAX}") from None


def _validate_wait(value: Any, where: str) -> float:
    try:
        seconds = float(value) if not isinstance(value, bool) else float("nan")
    except (TypeError, ValueError):
        seconds = float("nan")
    if not 0 < seconds <= MAX_SAFE_POINT_WAIT:
        raise ConfigError(
            f"safe point wait {value!r} {where} is not valid; give seconds above 0 and at most "
            f"{MAX_SAFE_POINT_WAIT:g}, e.g. 5 or 0.5"
        )
    return seconds


def find_config_file() -> Path | None:
    """./.flexiumrc if it exists, else ~/.flexiumrc if it exists, else None."""
    candidates = [Path.cwd() / RC_FILENAME]
    try:
        candidates.append(Path.home() / RC_FILENAME)
    except RuntimeError:  # no HOME and no passwd entry: only the local file can apply
        pass
    for path in candidates:
        if os.path.lexists(path):
            return path.absolute()
    return None


def _read_rc(path: Path) -> dict[str, tuple[Any, int]]:
    """The rc file's known keys as {field: (value, line)}; unknown keys are logged and dropped."""
    try:
        text = path.read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as exc:
        raise ConfigError(f"cannot read config file {path}: {exc}; fix or remove it") from exc
    try:
        root = yaml.compose(text, Loader=yaml.SafeLoader)
        data = yaml.safe_load(text)
    except yaml.YAMLError as exc:
        mark = getattr(exc, "problem_mark", None) or getattr(exc, "context_mark", None)
        at_line = f", line {mark.line + 1}" if mark is not None else ""
        problem = getattr(exc, "problem", None) or str(exc).splitlines()[0]
        raise ConfigError(
            f"config file {path}{at_line} is not valid YAML ({problem}); "
            "it should hold lines like 'server: localhost:8080/default' and 'device: cuda:0'"
        ) from None
    if data is None:
        return {}
    if not isinstance(data, dict) or not isinstance(root, yaml.MappingNode):
        raise ConfigError(
            f"config file {path} must be a YAML mapping of keys to values, but its top level is a "
            f"{type(data).__name__}; write one 'key: value' per line, e.g. 'server: localhost:8080/default'"
        )
    lines: dict[Any, int] = {}
    for key_node, value_node in root.value:
        if not isinstance(key_node, yaml.ScalarNode):
            continue
        if key_node.value in lines:  # YAML keeps the last one silently: which one was meant is not known
            raise ConfigError(
                f"config file {path} sets {key_node.value!r} twice (lines {lines[key_node.value]} and "
                f"{value_node.start_mark.line + 1}); keep the one you mean"
            )
        lines[key_node.value] = value_node.start_mark.line + 1
    found: dict[str, tuple[Any, int]] = {}
    for key, value in data.items():
        name = _RC_KEYS.get(key) if isinstance(key, str) else None
        line = lines.get(str(key), 0)
        if name is None:
            close = difflib.get_close_matches(str(key), sorted(_RC_KEYS), n=1)
            hint = f"; did you mean {close[0]!r}?" if close else ""
            _log.warning(
                "ignoring unknown key %r in config file %s (line %d); known keys: %s%s",
                key,
                path,
                line,
                ", ".join(sorted(_RC_KEYS)),
                hint,
            )
            continue
        if value is not None:
            found[name] = (value, line)
    return found


def _setting(
    name: str, param: Any, rc: dict[str, tuple[Any, int]], rc_path: Path | None, parameter: str
) -> _Raw | None:
    """One setting from the first source that has it: the parameter, its variable, the rc file."""
    rc_key, env_name, _label = _FIELDS[name]
    env_value = os.environ.get(env_name, "")
    if param is not None:
        return _Raw(param, SOURCE_PARAMETER, f"(passed in code as {parameter}=)")
    if env_value.strip():
        # An empty variable counts as unset: `FLEXIUM_SERVER= python train.py` means local mode.
        return _Raw(env_value, env_name, f"(from environment variable {env_name})")
    if name in rc:
        value, line = rc[name]
        return _Raw(value, str(rc_path), f"(from {rc_path}, line {line}, key '{rc_key}')")
    return None


def load_config(
    orchestrator: str | None = None,
    device: str | None = None,
    *,
    token: str | None = None,
    priority: str | int | None = None,
    server_parameter: str = "orchestrator",
) -> FlexiumConfig:
    """Resolve and validate flexium's settings. Raises ConfigError naming the bad value's source.
    `server_parameter`: what the caller's API calls the server address (init's is `server`)."""
    rc_path = find_config_file()
    rc = _read_rc(rc_path) if rc_path is not None else {}
    params: dict[str, Any] = {"orchestrator": orchestrator, "device": device, "token": token, "priority": priority}
    raw = {
        name: _setting(name, params.get(name), rc, rc_path, server_parameter if name == "orchestrator" else name)
        for name in _FIELDS
    }

    sources: dict[str, str] = {}
    for name in _FIELDS:
        entry = raw[name]
        sources[name] = entry.source if entry is not None else SOURCE_DEFAULT

    orchestrator_value: str | None = None
    address: ServerAddress | None = None
    entry = raw["orchestrator"]
    if entry is not None:
        address = parse_server_address(entry.value, where=entry.where)
        orchestrator_value = entry.value.strip()

    entry = raw["device"]
    device_value = validate_device(entry.value, where=entry.where) if entry is not None else default_device()

    entry = raw["token"]
    token_value = _validate_token(entry.value, entry.where) if entry is not None else None

    entry = raw["log_level"]
    log_level = _validate_log_level(entry.value, entry.where) if entry is not None else DEFAULT_LEVEL

    entry = raw["fast_path"]
    fast_path = _validate_switch(entry.value, entry.where) if entry is not None else True

    entry = raw["safe_point_wait"]
    safe_point_wait = _validate_wait(entry.value, entry.where) if entry is not None else DEFAULT_SAFE_POINT_WAIT

    entry = raw["priority"]
    priority_value = _validate_priority(entry.value, entry.where) if entry is not None else protocol.DEFAULT_PRIORITY

    return FlexiumConfig(
        orchestrator=orchestrator_value,
        device=device_value,
        token=token_value,
        log_level=log_level,
        fast_path=fast_path,
        safe_point_wait=safe_point_wait,
        priority=priority_value,
        address=address,
        config_file=str(rc_path) if rc_path is not None else None,
        sources=MappingProxyType(sources),
    )


def default_device() -> str:
    """Without a setting: the GPU of this rank's LOCAL_RANK under torchrun (every rank of a job
    sees every GPU, so that it can move, and uses its own), else cuda:0."""
    local_rank = os.environ.get("LOCAL_RANK", "")
    return f"cuda:{int(local_rank)}" if local_rank.isdigit() else DEFAULT_DEVICE


def resolve_device(device: str | None = None) -> str:
    """The device alone, from the same sources in the same order as load_config (a disabled
    runtime reads no other setting)."""
    rc_path = find_config_file()
    rc = _read_rc(rc_path) if rc_path is not None else {}
    entry = _setting("device", device, rc, rc_path, "device")
    return validate_device(entry.value, where=entry.where) if entry is not None else default_device()
