from __future__ import annotations

from pathlib import Path

import pytest

from kvwatch.config import (
    DEFAULT_LISTEN,
    ConfigError,
    load,
    parse_duration,
    parse_listen,
    parse_log_flag,
)


def test_defaults_bind_loopback() -> None:
    config = load(None)
    assert config.listen == DEFAULT_LISTEN
    assert parse_listen(config.listen) == ("127.0.0.1", 29321)


def test_toml_file(tmp_path: Path) -> None:
    path = tmp_path / "kvwatch.toml"
    path.write_text(
        'spool_dir = "/run/x"\n'
        'listen = "[::1]:9999"\n'
        'retention = "7d"\n'
        "nvml = false\n"
        "allowed_users = [0]\n"
        "[[logs]]\n"
        'path = "/var/log/p.log"\n'
        'role = "prefill"\n'
        'engine = "sglang"\n'
    )
    config = load(path)
    assert config.spool_dir == "/run/x"
    assert parse_listen(config.listen) == ("::1", 9999)
    assert config.retention == 7 * 86400
    assert config.nvml is False
    assert config.uids() == [0]
    assert config.logs[0].role == "prefill" and config.logs[0].engine == "sglang"
    assert config.quarantine == "/run/x/quarantine"


@pytest.mark.parametrize(
    ("text", "message"),
    [
        ("bogus = 1\n", "unknown setting"),
        ('retention = "soon"\n', "not a duration"),
        ('listen = "localhost"\n', "HOST:PORT"),
        ("[[logs]]\nrole = 'decode'\n", "needs a path"),
        ("allowed_users = ['no-such-user-kvwatch']\n", "no user"),
        ("= broken", "kvwatch.toml"),
    ],
)
def test_bad_config_is_a_clear_error(tmp_path: Path, text: str, message: str) -> None:
    path = tmp_path / "kvwatch.toml"
    path.write_text(text)
    with pytest.raises(ConfigError, match=message):
        load(path)


def test_durations_and_log_flags() -> None:
    assert parse_duration("90") == 90
    assert parse_duration("15m") == 900
    assert parse_duration("1h") == 3600
    assert parse_duration("250ms") == 0.25
    flag = parse_log_flag("decode:vllm:/var/log/d.log")
    assert (flag.role, flag.engine, flag.path) == ("decode", "vllm", "/var/log/d.log")
    assert parse_log_flag("prefill:/p.log").path == "/p.log"
    assert parse_log_flag("/only.log").role == "other"


def test_allowed_users_take_names_and_numeric_uids(tmp_path: Path) -> None:
    path = tmp_path / "kvwatch.toml"
    # A uid as a string (as --allowed-user passes it) needs no passwd entry: 54321 has none.
    path.write_text("allowed_users = ['root', '54321', 65534]\n")
    assert load(path).uids() == [0, 54321, 65534]
