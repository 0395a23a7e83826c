"""flexium.config: priority, sources, validation messages, rc file handling, the local-mode box."""

from __future__ import annotations

import dataclasses
import logging
from pathlib import Path

import pytest

from flexium import _logging
from flexium.config import (
    FlexiumConfig,
    ServerAddress,
    load_config,
    parse_server_address,
    validate_device,
)
from flexium.errors import ConfigError

ENV_VARS = (
    "FLEXIUM_SERVER",
    "GPU_DEVICE",
    "FLEXIUM_TOKEN",
    "FLEXIUM_LOG_LEVEL",
    "FLEXIUM_FAST_PATH",
    "FLEXIUM_SAFE_POINT_WAIT",
)


@pytest.fixture
def home(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """A clean world: no flexium env vars, an empty working directory and an empty home."""
    for name in ENV_VARS:
        monkeypatch.delenv(name, raising=False)
    work = tmp_path / "work"
    home_dir = tmp_path / "home"
    work.mkdir()
    home_dir.mkdir()
    monkeypatch.chdir(work)
    monkeypatch.setenv("HOME", str(home_dir))
    return home_dir


def write_rc(directory: Path, text: str) -> Path:
    path = directory / ".flexiumrc"
    path.write_text(text, encoding="utf-8")
    return path


# -- defaults and priority ----------------------------------------------------------------------


def test_defaults_are_local_mode(home: Path) -> None:
    config = load_config()
    assert config.orchestrator is None
    assert config.server is None
    assert config.local_mode
    assert config.device == "cuda:0"
    assert config.token is None
    assert config.log_level == "INFO"
    assert config.address is None
    assert config.config_file is None
    assert config.fast_path is True and config.safe_point_wait == 5.0
    assert dict(config.sources) == {
        "orchestrator": "default",
        "device": "default",
        "token": "default",
        "log_level": "default",
        "fast_path": "default",
        "safe_point_wait": "default",
        "priority": "default",
    }


def test_spec_example(home: Path) -> None:
    config = load_config(orchestrator="gpu-server.example.com/myworkspace", device="cuda:2")
    assert config.orchestrator == "gpu-server.example.com/myworkspace"
    assert config.server == "gpu-server.example.com/myworkspace"
    assert config.device == "cuda:2"
    assert not config.local_mode
    assert config.address == ServerAddress(
        host="gpu-server.example.com", port=8080, workspace="myworkspace", scheme="http"
    )
    assert config.address.base_url == "http://gpu-server.example.com:8080"
    assert config.sources["orchestrator"] == "parameter"
    assert config.sources["device"] == "parameter"


def test_env_vars_used_when_no_parameters(home: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("FLEXIUM_SERVER", "localhost:8080/team")
    monkeypatch.setenv("GPU_DEVICE", "cuda:1")
    monkeypatch.setenv("FLEXIUM_TOKEN", "tok_abc123")
    monkeypatch.setenv("FLEXIUM_LOG_LEVEL", "debug")
    monkeypatch.setenv("FLEXIUM_FAST_PATH", "off")
    monkeypatch.setenv("FLEXIUM_SAFE_POINT_WAIT", "0.5")
    monkeypatch.setenv("FLEXIUM_PRIORITY", "high")
    config = load_config()
    assert config.orchestrator == "localhost:8080/team"
    assert config.device == "cuda:1"
    assert config.token == "tok_abc123"
    assert config.log_level == "DEBUG"
    assert config.fast_path is False and config.safe_point_wait == 0.5 and config.priority == 90
    assert dict(config.sources) == {
        "orchestrator": "FLEXIUM_SERVER",
        "device": "GPU_DEVICE",
        "token": "FLEXIUM_TOKEN",
        "log_level": "FLEXIUM_LOG_LEVEL",
        "fast_path": "FLEXIUM_FAST_PATH",
        "safe_point_wait": "FLEXIUM_SAFE_POINT_WAIT",
        "priority": "FLEXIUM_PRIORITY",
    }


def test_parameters_beat_env_vars(home: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("FLEXIUM_SERVER", "env-host/envws")
    monkeypatch.setenv("GPU_DEVICE", "cuda:1")
    monkeypatch.setenv("FLEXIUM_TOKEN", "envtoken")
    config = load_config("param-host/paramws", "cuda:3", token="paramtoken")
    assert (config.orchestrator, config.device, config.token) == ("param-host/paramws", "cuda:3", "paramtoken")
    assert config.sources["orchestrator"] == config.sources["device"] == config.sources["token"] == "parameter"


def test_env_vars_beat_rc_file(home: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    write_rc(home, "server: rc-host/rcws\ndevice: cuda:4\ntoken: rctoken\nlog_level: error\n")
    monkeypatch.setenv("GPU_DEVICE", "cuda:1")
    config = load_config()
    assert config.device == "cuda:1"
    assert config.sources["device"] == "GPU_DEVICE"
    assert config.orchestrator == "rc-host/rcws"
    assert config.token == "rctoken"
    assert config.log_level == "ERROR"
    rc = str(home / ".flexiumrc")
    assert config.sources["orchestrator"] == config.sources["token"] == config.sources["log_level"] == rc
    assert config.config_file == rc


def test_empty_env_var_counts_as_unset(home: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    write_rc(home, "server: rc-host/rcws\n")
    monkeypatch.setenv("FLEXIUM_SERVER", "")
    assert load_config().orchestrator == "rc-host/rcws"


def test_local_rc_file_wins_over_home_and_only_one_is_read(home: Path) -> None:
    write_rc(home, "server: home-host/homews\ndevice: cuda:5\n")
    local = write_rc(Path.cwd(), "server: local-host/localws\n")
    config = load_config()
    assert config.orchestrator == "local-host/localws"
    assert config.device == "cuda:0"  # not merged with ~/.flexiumrc
    assert config.sources["device"] == "default"
    assert config.config_file == str(local.absolute())


def test_null_values_in_rc_file_fall_through(home: Path) -> None:
    write_rc(home, "server:\ndevice: ~\n")
    config = load_config()
    assert config.local_mode
    assert config.device == "cuda:0"


def test_a_key_set_twice_in_the_rc_file_is_refused_naming_both_lines(home: Path) -> None:
    write_rc(home, "server: one-host/ws\ndevice: cuda:1\nserver: other-host/ws\n")
    with pytest.raises(ConfigError, match=r"sets 'server' twice \(lines 1 and 3\); keep the one you mean"):
        load_config()


def test_empty_rc_file_is_fine(home: Path) -> None:
    write_rc(home, "# nothing yet\n")
    assert load_config().local_mode


def test_config_is_frozen_and_hides_token(home: Path) -> None:
    config = load_config(token="secret-token-123")
    with pytest.raises(dataclasses.FrozenInstanceError):
        config.device = "cuda:1"  # type: ignore[misc]
    with pytest.raises(TypeError):
        config.sources["device"] = "x"  # type: ignore[index]
    assert "secret-token-123" not in repr(config)
    assert isinstance(config, FlexiumConfig)


# -- validation -----------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        (
            "gpu-server.example.com/myworkspace",
            ("http://gpu-server.example.com:8080", "myworkspace", "gpu-server.example.com", 8080, "http"),
        ),
        ("localhost:8080/ws", ("http://localhost:8080", "ws", "localhost", 8080, "http")),
        ("http://10.0.0.5:9000/team-a", ("http://10.0.0.5:9000", "team-a", "10.0.0.5", 9000, "http")),
        (
            "HTTPS://gpu-server.example.com/ws/",
            ("https://gpu-server.example.com:443", "ws", "gpu-server.example.com", 443, "https"),  # TLS: 443
        ),
        ("https://[::1]:8443/my_ws", ("https://[::1]:8443", "my_ws", "::1", 8443, "https")),
        ("  flexium_server:80/ws.1  ", ("http://flexium_server:80", "ws.1", "flexium_server", 80, "http")),
    ],
)
def test_parse_server_address(text: str, expected: tuple[object, ...]) -> None:
    address = parse_server_address(text)
    assert (address.base_url, address.workspace, address.host, address.port, address.scheme) == expected
    assert str(address) == f"{address.base_url}/{address.workspace}"


@pytest.mark.parametrize(
    ("text", "reason"),
    [
        ("gpu-server.example.com", "has no workspace"),
        ("gpu-server.example.com/", "has no workspace"),
        ("localhost:8080", "has no workspace"),
        ("ftp://host/ws", "scheme 'ftp'"),
        ("host:99999/ws", "port '99999' is not a number"),
        ("host:abc/ws", "port 'abc' is not a number"),
        ("host:/ws", "port '' is not a number"),
        ("/ws", "has no host"),
        ("bad host/ws", "blank"),
        ("host/a/b", "workspace 'a/b' is not a valid name"),
        ("host/-ws", "workspace '-ws' is not a valid name"),
        ("host/MyWorkspace", "workspace 'MyWorkspace' is not a valid name"),
        ("[::zz]:80/ws", "invalid IPv6 host"),
        ("user@host/ws", "user name"),
        ("host..name/ws", "invalid host"),
        ("", "is empty"),
    ],
)
def test_parse_server_address_rejects(text: str, reason: str) -> None:
    with pytest.raises(ConfigError) as info:
        parse_server_address(text)
    message = str(info.value)
    assert reason in message
    assert "host[:port]/workspace" in message
    assert "gpu-server:8080/myworkspace" in message


def test_bad_server_from_env_names_the_variable(home: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("FLEXIUM_SERVER", "localhost:8080")
    with pytest.raises(
        ConfigError, match=r"'localhost:8080' \(from environment variable FLEXIUM_SERVER\) has no workspace"
    ):
        load_config()


def test_bad_server_parameter_names_the_parameter(home: Path) -> None:
    with pytest.raises(ConfigError, match=r"passed in code as orchestrator="):
        load_config(orchestrator="nohost")


def test_empty_server_parameter_is_an_error(home: Path) -> None:
    with pytest.raises(ConfigError, match="is empty"):
        load_config(orchestrator="")


@pytest.mark.parametrize(
    ("text", "canonical"),
    [
        ("cuda:0", "cuda:0"),
        ("cuda:7", "cuda:7"),
        (" CUDA:01 ", "cuda:1"),
        ("cpu", "cpu"),
        ("CPU", "cpu"),
        ("0", "cuda:0"),  # GPU_DEVICE=0: a bare index, as torch.cuda.set_device takes it
        (" 3 ", "cuda:3"),
        (2, "cuda:2"),  # `device: 2` in .flexiumrc
    ],
)
def test_validate_device(text: str | int, canonical: str) -> None:
    assert validate_device(text) == canonical


@pytest.mark.parametrize("text", ["cuda", "cuda:-1", "gpu:0", "cuda:x", "-1", "", "mps"])
def test_validate_device_rejects(text: str) -> None:
    with pytest.raises(ConfigError, match=r"expected 'cuda:N' or N with N >= 0 \(e.g. 'cuda:1' or 1\) or 'cpu'"):
        validate_device(text)


def test_bare_cuda_gets_a_hint() -> None:
    with pytest.raises(ConfigError, match=r"name the GPU: 'cuda:0'"):
        validate_device("cuda")


def test_torch_device_is_accepted() -> None:
    torch = pytest.importorskip("torch")
    assert validate_device(torch.device("cuda", 2)) == "cuda:2"


def test_bad_device_from_env_names_the_variable(home: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("GPU_DEVICE", "gpu1")
    with pytest.raises(ConfigError, match=r"device 'gpu1' \(from environment variable GPU_DEVICE\)"):
        load_config()


def test_device_wrong_type_parameter(home: Path) -> None:
    with pytest.raises(ConfigError, match=r"must be a string like 'cuda:0' or 'cpu', not 1.5 \(float\)"):
        load_config(device=1.5)  # type: ignore[arg-type]


def test_bad_log_level(home: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("FLEXIUM_LOG_LEVEL", "verbose")
    with pytest.raises(ConfigError) as info:
        load_config()
    message = str(info.value)
    assert "'verbose'" in message and "FLEXIUM_LOG_LEVEL" in message
    assert "DEBUG" in message and "WARNING" in message


@pytest.mark.parametrize(("text", "canonical"), [("warn", "WARNING"), ("Fatal", "CRITICAL"), ("notset", "NOTSET")])
def test_log_level_aliases(home: Path, monkeypatch: pytest.MonkeyPatch, text: str, canonical: str) -> None:
    monkeypatch.setenv("FLEXIUM_LOG_LEVEL", text)
    assert load_config().log_level == canonical


def test_bad_token_is_never_echoed(home: Path) -> None:
    with pytest.raises(ConfigError) as info:
        load_config(token="abc def-secret")
    assert "def-secret" not in str(info.value)
    assert "dashboard" in str(info.value)


# -- rc file problems -----------------------------------------------------------------------------


def test_malformed_yaml_names_file_and_line(home: Path) -> None:
    rc = write_rc(home, "server: host/ws\ndevice: [cuda:0\n")
    with pytest.raises(ConfigError) as info:
        load_config()
    message = str(info.value)
    assert str(rc) in message
    assert "line 3" in message or "line 2" in message
    assert "not valid YAML" in message


def test_malformed_yaml_line_is_exact(home: Path) -> None:
    rc = write_rc(home, "server: host/ws\ndevice: cuda:0\n  bad: indentation\n")
    with pytest.raises(ConfigError, match=rf"{str(rc)}, line 3 is not valid YAML"):
        load_config()


@pytest.mark.parametrize(("text", "kind"), [("- server\n- device\n", "list"), ("just text\n", "str"), ("42\n", "int")])
def test_top_level_must_be_a_mapping(home: Path, text: str, kind: str) -> None:
    rc = write_rc(home, text)
    with pytest.raises(ConfigError, match=rf"{str(rc)} must be a YAML mapping.*top level is a {kind}"):
        load_config()


def test_wrong_value_type_in_rc_names_file_line_and_key(home: Path) -> None:
    rc = write_rc(home, "server: host/ws\ndevice: [0]\n")
    with pytest.raises(ConfigError) as info:
        load_config()
    message = str(info.value)
    assert f"(from {rc}, line 2, key 'device')" in message
    assert "not [0] (list)" in message
    write_rc(home, "device: 1\n")  # a bare index is cuda:N
    assert load_config().device == "cuda:1"


def test_numeric_token_in_rc_says_quote_it(home: Path) -> None:
    write_rc(home, "token: 12345\n")
    with pytest.raises(ConfigError, match=r"quote it"):
        load_config()


def test_server_wrong_type_in_rc(home: Path) -> None:
    rc = write_rc(home, "server:\n  host: x\n")
    with pytest.raises(ConfigError, match=rf"server address \(from {rc}, line 2, key 'server'\) must be a string"):
        load_config()


def test_bad_server_in_rc_names_the_file(home: Path) -> None:
    rc = write_rc(home, "device: cuda:0\nserver: just-a-host\n")
    with pytest.raises(ConfigError, match=rf"'just-a-host' \(from {rc}, line 2, key 'server'\) has no workspace"):
        load_config()


def test_unknown_key_is_a_warning_not_an_error(home: Path, capsys: pytest.CaptureFixture[str]) -> None:
    rc = write_rc(home, "sever: host/ws\ndevice: cuda:1\n")
    config = load_config()
    assert config.device == "cuda:1"
    assert config.local_mode
    err = capsys.readouterr().err
    assert "[flexium] WARNING: ignoring unknown key 'sever'" in err
    assert str(rc) in err
    assert "did you mean 'server'?" in err


def test_unreadable_rc_file(home: Path) -> None:
    (home / ".flexiumrc").mkdir()
    with pytest.raises(ConfigError, match=r"cannot read config file .*\.flexiumrc"):
        load_config()


def test_unknown_key_warning_shows_even_without_any_logging_setup(
    home: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    root = logging.getLogger()
    saved = root.handlers[:]
    root.handlers.clear()
    try:
        write_rc(home, "colour: blue\n")
        load_config()
    finally:
        root.handlers[:] = saved
    assert "unknown key 'colour'" in capsys.readouterr().err


# -- logging ---------------------------------------------------------------


def test_configure_logging_levels(capsys: pytest.CaptureFixture[str]) -> None:
    logger = _logging.get_logger()
    saved = logger.level
    try:
        _logging.configure_logging("debug")
        assert logger.level == logging.DEBUG
        _logging.get_logger("unit").debug("detail %d", 7)
        _logging.get_logger("unit").info("plain")
        _logging.configure_logging("WARN")
        assert logger.level == logging.WARNING
        _logging.get_logger("unit").info("hidden")
        with pytest.raises(ValueError, match="unknown log level 'loud'"):
            _logging.configure_logging("loud")
    finally:
        logger.setLevel(saved)
    err = capsys.readouterr().err
    assert "[flexium] DEBUG: detail 7\n" in err
    assert "[flexium] plain\n" in err
    assert "hidden" not in err


def test_logger_has_one_prefix_handler_and_does_not_propagate() -> None:
    _logging.configure_logging()
    _logging.configure_logging()
    logger = logging.getLogger("flexium")
    handlers = [h for h in logger.handlers if isinstance(h, _logging._StderrHandler)]
    assert len(handlers) == 1
    assert not logger.propagate


def test_fast_path_and_safe_point_wait_from_the_rc_file(home: Path) -> None:
    (Path.cwd() / ".flexiumrc").write_text("fast_path: false\nsafe_point_wait: 2.5\n")
    config = load_config()
    assert config.fast_path is False and config.safe_point_wait == 2.5
    assert config.sources["fast_path"].endswith(".flexiumrc")


@pytest.mark.parametrize("value", ["maybe", "2", ""])
def test_a_bad_fast_path_switch_names_its_source(home: Path, monkeypatch: pytest.MonkeyPatch, value: str) -> None:
    (Path.cwd() / ".flexiumrc").write_text(f"fast_path: '{value}'\n")
    with pytest.raises(ConfigError, match=r"fast path switch .* line 1, key 'fast_path'.*use true or false"):
        load_config()


@pytest.mark.parametrize("value", ["0", "-1", "soon", "7200", "nan"])
def test_a_bad_safe_point_wait_names_its_source(home: Path, monkeypatch: pytest.MonkeyPatch, value: str) -> None:
    monkeypatch.setenv("FLEXIUM_SAFE_POINT_WAIT", value)
    with pytest.raises(ConfigError, match=r"safe point wait .*FLEXIUM_SAFE_POINT_WAIT.*seconds above 0"):
        load_config()


def test_the_host_copier_switch_reads_like_the_others(monkeypatch: pytest.MonkeyPatch) -> None:
    from flexium.engine.fast.host_copier import copier_enabled

    monkeypatch.delenv("FLEXIUM_HOST_COPIER", raising=False)
    assert copier_enabled() is True
    for value, expected in (("0", False), ("off", False), ("True", True), ("1", True), (" ", True)):
        monkeypatch.setenv("FLEXIUM_HOST_COPIER", value)
        assert copier_enabled() is expected, value
    monkeypatch.setenv("FLEXIUM_HOST_COPIER", "maybe")
    with pytest.raises(
        ConfigError,
        match=r"host copier switch 'maybe' \(from environment variable "
        r"FLEXIUM_HOST_COPIER\) is not valid; use true or false",
    ):
        copier_enabled()


def test_a_torchrun_rank_defaults_to_its_local_rank_gpu(monkeypatch: pytest.MonkeyPatch) -> None:
    from flexium.config import resolve_device

    monkeypatch.delenv("GPU_DEVICE", raising=False)
    monkeypatch.setenv("LOCAL_RANK", "1")
    assert resolve_device() == "cuda:1"
    assert resolve_device("cuda:0") == "cuda:0"  # a setting wins
    monkeypatch.delenv("LOCAL_RANK")
    assert resolve_device() == "cuda:0"


def test_a_priority_by_name_or_number_and_a_bad_one_named_by_its_source(
    home: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    assert load_config().priority == 50
    assert load_config(priority="low").priority == 10 and load_config(priority=70).priority == 70
    (Path.cwd() / ".flexiumrc").write_text("priority: 20\n")
    assert load_config().priority == 20
    monkeypatch.setenv("FLEXIUM_PRIORITY", "urgent")
    with pytest.raises(
        ConfigError, match=r"priority 'urgent' \(from environment variable FLEXIUM_PRIORITY\) is not valid"
    ):
        load_config()
    with pytest.raises(ConfigError, match="low, normal, high or a number 0-100"):
        load_config(priority=101)
