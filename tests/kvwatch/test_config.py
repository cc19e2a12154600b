from __future__ import annotations

import os
import re
import tomllib
from pathlib import Path

import pytest

from kvwatch.config import (
    DEFAULT_LISTEN,
    KNOWN_SETTINGS,
    Config,
    ConfigError,
    check_retention,
    from_mapping,
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
        ('poll_interval = "fast"\n', "poll_interval: not a duration"),
    ],
)
def test_bad_config_is_a_clear_error(tmp_path: Path, text: str, message: str) -> None:
    path = tmp_path / "kvwatch.toml"
    path.write_text(text)
    with pytest.raises(ConfigError, match=message):
        load(path)


def test_durations_and_log_flags() -> None:
    assert parse_duration("90s") == 90
    assert parse_duration("15m") == 900
    assert parse_duration("1h") == 3600
    assert parse_duration("250ms") == 0.25
    flag = parse_log_flag("decode:vllm:/var/log/d.log")
    assert (flag.role, flag.engine, flag.path) == ("decode", "vllm", "/var/log/d.log")
    assert parse_log_flag("prefill:/p.log").path == "/p.log"
    assert parse_log_flag("/only.log").role == "other"
    assert parse_log_flag("prefill:/a:b.log").path == "/a:b.log"


@pytest.mark.parametrize("value", ["30", 30, "0", 0.5, True])
def test_a_duration_without_a_unit_is_refused(value: object) -> None:
    with pytest.raises(ConfigError, match=r"retention: .*(no unit|not a duration)"):
        parse_duration(value, setting="retention")


def test_short_retention_needs_confirmation() -> None:
    config = load(None)
    config.retention = 30.0  # what "--retention 30s" gives
    with pytest.raises(ConfigError, match="within the hour; pass --allow-short-retention"):
        check_retention(config, allow_short=False)
    check_retention(config, allow_short=True)
    config.retention = 0.0
    with pytest.raises(ConfigError, match="more than 0"):
        check_retention(config, allow_short=True)
    config.retention = 3600.0
    check_retention(config, allow_short=False)


@pytest.mark.parametrize(
    ("flag", "message"),
    [
        ("prefill:sgl:/x.log", "unknown engine 'sgl' (did you mean 'sglang'?)"),
        ("prefil:sglang:/x.log", "unknown role 'prefil' (did you mean 'prefill'?)"),
        ("warmup:/x.log", "unknown role 'warmup' (one of: decode, other, prefill, unified)"),
        ("x.log", "expected ROLE:ENGINE:PATH"),
        ("prefill:sglang:", "empty path"),
    ],
)
def test_log_flags_are_validated(flag: str, message: str) -> None:
    with pytest.raises(ConfigError) as caught:
        parse_log_flag(flag)
    assert message in str(caught.value)


@pytest.mark.parametrize(
    ("text", "message"),
    [
        ('retension = "30d"\n', "unknown setting 'retension' (did you mean 'retention'?)"),
        ("retention = 30\n", "retention: 30 has no unit"),
        ('nvml = "false"\n', "nvml: expected true or false"),
        ("quarantine_max = '3'\n", "quarantine_max: expected a whole number"),
        ("journal = 5\n", "journal: expected a string"),
        ("allowed_users = 'root'\n", "allowed_users: expected a list"),
        ("[[logs]]\npath = '/x'\nrole = 'decod'\n", "(did you mean 'decode'?)"),
        ("[[logs]]\npath = '/x'\nengnie = 'vllm'\n", "(did you mean 'engine'?)"),
        ('listen = "29321"\n', "expected HOST:PORT or :PORT"),
        ("incidents_log_max_bytes = '64MiB'\n", "incidents_log_max_bytes: expected a whole"),
        ("incidents_log_max_bytes = 100\n", "incidents_log_max_bytes: must be at least 4096"),
        ("incidents_log_keep = -1\n", "incidents_log_keep: must be at least 0, got -1"),
        ("incidents_log = 1\n", "incidents_log: expected a string"),
        ('poll_interval = "0s"\n', "poll_interval: must be at least 10ms, got 0ms"),
    ],
)
def test_config_values_are_checked(tmp_path: Path, text: str, message: str) -> None:
    path = tmp_path / "kvwatch.toml"
    path.write_text(text)
    with pytest.raises(ConfigError) as caught:
        load(path)
    assert message in str(caught.value) and str(path) in str(caught.value)


def test_config_that_is_not_utf8(tmp_path: Path) -> None:
    path = tmp_path / "kvwatch.toml"
    path.write_bytes(b'journal = "/var/lib/\xff.db"\n')
    with pytest.raises(ConfigError, match="is not UTF-8"):
        load(path)


def test_colon_port_means_every_interface() -> None:
    assert parse_listen(":29400") == ("0.0.0.0", 29400)


def test_allowed_users_take_names_and_numeric_uids(tmp_path: Path) -> None:
    path = tmp_path / "kvwatch.toml"
    # A uid as a string (as --allowed-user passes it) needs no passwd entry: 54321 has none.
    path.write_text("allowed_users = ['root', '54321', 65534]\n")
    assert load(path).uids() == [0, 54321, 65534]


def test_the_incidents_log_defaults_beside_the_journal(tmp_path: Path) -> None:
    path = tmp_path / "kvwatch.toml"
    path.write_text('journal = "/srv/kv/journal.db"\n')
    assert load(path).incidents_log_path == "/srv/kv/incidents.jsonl"
    path.write_text('incidents_log = "/logs/i.jsonl"\nincidents_log_keep = 2\n')
    config = load(path)
    assert config.incidents_log_path == "/logs/i.jsonl" and config.incidents_log_keep == 2
    path.write_text('incidents_log = "off"\n')
    assert load(path).incidents_log_path is None


EXAMPLE = Path(__file__).resolve().parents[2] / "deploy" / "kvwatch.toml"
# A commented setting of the example: "# key = value" (or a [[logs]] table header).
_COMMENTED = re.compile(r"^# (\[\[logs\]\]|[a-z_]+ = .*)$", flags=re.M)


def test_the_example_config_is_the_defaults_as_shipped() -> None:
    """deploy/kvwatch.toml loads as installed, and what it leaves uncommented is the default."""
    assert load(EXAMPLE) == Config()


def test_the_example_config_shows_every_setting_and_each_loads(tmp_path: Path) -> None:
    """Every setting the daemon accepts is in the example, and the example with every commented
    setting switched on loads (its users replaced by one that exists here)."""
    text = _COMMENTED.sub(r"\1", EXAMPLE.read_text())
    text = re.sub(r"^allowed_users = .*$", f"allowed_users = [{os.geteuid()}]", text, flags=re.M)
    shown = set(tomllib.loads(text))
    assert shown == KNOWN_SETTINGS - {"allowed_uids"}  # allowed_uids: allowed_users, resolved
    path = tmp_path / "kvwatch.toml"
    path.write_text(text)
    config = load(path)
    assert config.incidents_log_path == "/var/lib/kvwatch/incidents.jsonl"
    assert (config.incidents_log_max_bytes, config.incidents_log_keep) == (64 << 20, 5)
    assert config.node_name == "prefill-0"
    assert config.alertmanager_urls == [f"http://am-{i}:9093" for i in range(3)]
    assert config.alertmanager_enabled is True
    assert config.alertmanager_labels == {"cluster": "prod-eu"}
    assert (config.alertmanager_timeout, config.alertmanager_resend) == (10.0, 60.0)
    assert config.prometheus_scrape_interval == 15.0
    assert config.alertmanager_ca_file == "/etc/kvwatch/alertmanager-ca.crt"
    assert config.alertmanager_username == "kvwatch"
    assert config.alertmanager_password_file == "/etc/kvwatch/alertmanager.password"
    assert [log.role for log in config.logs] == ["prefill", "decode"]


@pytest.mark.parametrize(
    ("text", "message"),
    [
        # One bad number deleted the evidence: every quarantined segment went at once.
        ("quarantine_max = -3\n", "quarantine_max: must be at least 1, got -3 (from 1 to 100000)"),
        ("quarantine_max = 0\n", "quarantine_max: must be at least 1, got 0"),
        ("quarantine_max = 1000000\n", "quarantine_max: must be at most 100000, got 1000000"),
        (
            'retention = "1e30d"\n',
            "retention: must be at most 3650d, got 1e+30d (from 0s to 3650d)",
        ),
        ('retention = "-5d"\n', "retention: not a duration: '-5d' is negative"),
        ("retention = -5\n", "retention: not a duration: -5 is negative"),
        ('records_retention = "4000d"\n', "records_retention: must be at most 3650d, got 4000d"),
        ('poll_interval = "5m"\n', "poll_interval: must be at most 1m, got 5m (from 10ms to 1m)"),
        ('idle_grace = "0s"\n', "idle_grace: must be at least 100ms, got 0ms"),
        ('idle_grace = "2h"\n', "idle_grace: must be at most 1h, got 2h"),
        ('alertmanager_timeout = "0s"\n', "alertmanager_timeout: must be at least 100ms"),
        ('alertmanager_timeout = "1h"\n', "alertmanager_timeout: must be at most 5m, got 60m"),
        ('alertmanager_resend = "0s"\n', "alertmanager_resend: must be at least 1s, got 0s"),
        ('alertmanager_resend = "1d"\n', "alertmanager_resend: must be at most 1h, got 24h"),
        ('prometheus_scrape_interval = "2h"\n', "prometheus_scrape_interval: must be at most 1h"),
        ("incidents_log_max_bytes = 2199023255552\n", "must be at most 1099511627776"),
        ("incidents_log_keep = 5000\n", "incidents_log_keep: must be at most 1000, got 5000"),
        ("allowed_users = [-1]\n", "allowed_users: must be at least 0, got -1"),
        ("allowed_users = [4294967295]\n", "allowed_users: must be at most 4294967294"),
    ],
)
def test_every_numeric_setting_has_a_range(tmp_path: Path, text: str, message: str) -> None:
    path = tmp_path / "kvwatch.toml"
    path.write_text(text)
    with pytest.raises(ConfigError) as caught:
        load(path)
    assert message in str(caught.value) and "\n" not in str(caught.value)


def test_every_numeric_setting_is_in_the_ranges() -> None:
    """A numeric setting added later gets a range too (or this fails)."""
    from kvwatch.config import RANGES

    numeric = {f for f, v in vars(Config()).items() if type(v) in (int, float)}
    assert numeric == set(RANGES), numeric ^ set(RANGES)
    for name, allowed in RANGES.items():  # the defaults are inside their ranges
        allowed.check(name, getattr(Config(), name))


def test_the_range_ends_themselves_are_accepted() -> None:
    config = from_mapping(
        {"quarantine_max": 1, "poll_interval": "10ms", "idle_grace": "1h", "retention": "3650d"}
    )
    assert (config.quarantine_max, config.poll_interval, config.idle_grace) == (1, 0.01, 3600)


def test_records_retention_longer_than_retention_is_said() -> None:
    config = from_mapping({"retention": "30d", "records_retention": "60d"})
    (warning,) = check_retention(config, allow_short=False)
    assert "records_retention 60d is longer than retention 30d" in warning
    # Left at its default (2d), a retention of a day says nothing: the retention applies.
    assert check_retention(from_mapping({"retention": "1d"}), allow_short=False) == []
    assert check_retention(from_mapping({}), allow_short=False) == []
