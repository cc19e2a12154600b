from __future__ import annotations

import pytest

from minipd.cli import build_parser, config_from, main
from minipd.config import ServeConfig
from minipd.releases import RELEASES, release


def serve_config(*argv: str) -> ServeConfig:
    return config_from(build_parser().parse_args(["serve", *argv]))


def test_release_table_turns_the_fixes_on_in_order() -> None:
    r19, r20, r21, r22 = (release(v) for v in ("0.5.19", "0.5.20", "0.5.21", "0.5.22"))
    assert not (r19.retire_aborted_prefill or r19.admission_checks_to_finish)
    assert r20.retire_aborted_prefill and not r20.admission_checks_to_finish
    assert not r20.deferred_release
    assert r21.admission_checks_to_finish and r21.deferred_release
    assert not r21.router_drops_decode_half and r22.router_drops_decode_half
    assert set(RELEASES) == {"0.5.19", "0.5.20", "0.5.21", "0.5.22"}
    with pytest.raises(ValueError):
        release("0.4.0")


def test_role_pools_default_to_pool_tokens() -> None:
    cfg = serve_config("--pool-tokens", "100", "--decode-pool-tokens", "500")
    assert (cfg.prefill_pool_tokens, cfg.decode_pool_tokens) == (100, 500)


def test_deferred_release_follows_the_release_unless_set() -> None:
    assert not serve_config("--release", "0.5.19").defers_release
    assert serve_config("--release", "0.5.19", "--deferred-release", "on").defers_release
    assert not serve_config("--deferred-release", "off").defers_release
    assert serve_config().defers_release  # 0.5.22 by default


def test_defaults_bind_loopback_with_kvwatch_off() -> None:
    cfg = serve_config()
    assert cfg.host == "127.0.0.1" and cfg.kvwatch == "off" and cfg.version == "0.5.22"


def test_fault_flags_name_the_request_they_hit() -> None:
    faults = serve_config("--fault-drop-page", "3", "--fault-late-write-delay", "0.5").faults
    assert (faults.drop_page, faults.late_write, faults.late_write_delay) == (3, 0, 0.5)


def test_unknown_command_is_an_error() -> None:
    with pytest.raises(SystemExit):
        main(["nope"])


@pytest.mark.parametrize(
    "argv",
    [["--page-size", "0"], ["--layers", "0"], ["--pool-tokens", "8"], ["--transfer-timeout", "0"]],
)
def test_nonsense_sizes_are_rejected_before_anything_starts(argv: list[str]) -> None:
    with pytest.raises(SystemExit) as exc:
        main(["serve", *argv])
    assert exc.value.code == 2


def test_scrub_flag_installs_the_hooks_even_with_the_detectors_off() -> None:
    assert serve_config().kvwatch_scrub == "off" and not serve_config().kvwatch_on
    cfg = serve_config("--kvwatch-scrub", "on_reserve")
    assert cfg.kvwatch_scrub == "on_reserve" and cfg.kvwatch == "off" and cfg.kvwatch_on
    assert serve_config("--kvwatch", "log", "--kvwatch-scrub", "on_free").kvwatch_scrub == "on_free"
    with pytest.raises(SystemExit):
        serve_config("--kvwatch-scrub", "always")
