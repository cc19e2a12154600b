"""SGLang's own load_plugins() finds kvwatch by its entry point; the hooks attach, or refuse."""

from __future__ import annotations

import importlib.metadata
import logging
from typing import Any

import pytest

from engine_hooks.sglang import compat

REQUIRED_HOOKED = (
    compat.ALLOCATOR + ".__init__",
    compat.ALLOCATOR + ".alloc",
    compat.ALLOCATOR + ".alloc_extend",
    compat.ALLOCATOR + ".alloc_decode",
    compat.ALLOCATOR + "._release_page_ids",
    compat.PREFILL_QUEUE + ".add",
    compat.DECODE_QUEUE + ".add",
)


def test_entry_point_is_declared() -> None:
    eps = importlib.metadata.entry_points(group="sglang.srt.plugins")
    assert [ep.value for ep in eps if ep.name == "kvwatch"] == ["engine_hooks.sglang:register"]


def test_load_plugins_attaches_the_hooks_to_the_real_classes(sglang_plugins: Any) -> None:
    from sglang.srt.disaggregation.decode import DecodePreallocQueue
    from sglang.srt.disaggregation.prefill import PrefillBootstrapQueue
    from sglang.srt.mem_cache.allocator.paged import PagedTokenToKVPoolAllocator
    from sglang.srt.plugins.hook_registry import HookRegistry

    import engine_hooks.sglang as plugin

    assert set(REQUIRED_HOOKED) <= set(plugin.attached)
    assert set(REQUIRED_HOOKED) <= HookRegistry._patched
    for method in ("alloc", "alloc_extend", "alloc_decode", "_release_page_ids", "__init__"):
        assert hasattr(getattr(PagedTokenToKVPoolAllocator, method), "__wrapped__"), method
    assert hasattr(PrefillBootstrapQueue.add, "__wrapped__")
    assert hasattr(DecodePreallocQueue.add, "__wrapped__")


def test_every_hook_point_of_this_release_attached(sglang_plugins: Any) -> None:
    import engine_hooks.sglang as plugin

    support = compat.check()
    assert support.ok, support.missing_required
    if compat.version_tuple(support.version) >= (0, 5, 22):
        # v0.5.22+: SGLang's own checksum and kv-canary are there to harvest.
        assert not support.missing_optional, support.missing_optional
        assert set(compat.OPTIONAL) <= set(plugin.attached)


def test_refuses_cleanly_with_one_line_when_a_hook_point_is_missing(
    sglang_plugins: Any, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    from sglang.srt.plugins.hook_registry import HookRegistry

    import engine_hooks.sglang as plugin

    before = {target: len(hooks) for target, hooks in HookRegistry._hooks.items()}
    missing = compat.ALLOCATOR + ".alloc_from_the_future"
    monkeypatch.setattr(compat, "REQUIRED", (*compat.REQUIRED, missing))
    with caplog.at_level(logging.INFO, logger="kvwatch.sglang"):
        assert plugin.register() is False
    lines = [r for r in caplog.records if r.name == "kvwatch.sglang"]
    assert len(lines) == 1
    assert "not supported" in lines[0].getMessage()
    assert "alloc_from_the_future" in lines[0].getMessage()
    after = {target: len(hooks) for target, hooks in HookRegistry._hooks.items()}
    assert after == before
    assert plugin.attached == []
    monkeypatch.undo()
    plugin.attached.extend(t for t, _, _, _ in plugin.HOOKS if t in HookRegistry._patched)


def test_mode_off_registers_nothing(
    sglang_plugins: Any, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    import engine_hooks.sglang as plugin

    monkeypatch.setenv("KVWATCH_MODE", "off")
    saved = list(plugin.attached)
    with caplog.at_level(logging.INFO, logger="kvwatch.sglang"):
        assert plugin.register() is False
    assert [r.getMessage() for r in caplog.records if r.name == "kvwatch.sglang"] == [
        "kvwatch: KVWATCH_MODE=off, SGLang plugin not loaded"
    ]
    plugin.attached[:] = saved


def test_a_bad_setting_is_one_error_line_and_rides_on_every_hello(
    sglang_plugins: Any, tmp_path: Any, caplog: pytest.LogCaptureFixture
) -> None:
    """A misspelt mode runs as log, a unit on a number runs as the default, an unknown
    per-detector variable is named: one error line each (variable, value, valid ones, what runs),
    and the hello SGLang's own allocator start writes carries the mode, scrub and the settings
    that were invalid, so the daemon shows the engine misconfigured."""
    from engine_hooks.detectors import Mode
    from engine_hooks.sglang import runtime
    from engine_hooks.sglang.config import from_env
    from tests.sglang import sgl

    spool = tmp_path / "spool"
    spool.mkdir()
    env = {
        "KVWATCH_MODE": "enforse",
        "KVWATCH_MODE_CANARYY": "log",
        "KVWATCH_FLUSH_INTERVAL": "1s",
        "KVWATCH_SCRUB": "on_free",
        "KVWATCH_SPOOL": str(spool),
    }
    with caplog.at_level(logging.ERROR, logger="kvwatch.sglang"):
        settings = from_env(env)
    assert settings.mode is Mode.LOG and settings.flush_interval == 1.0
    lines = caplog.messages
    assert len(lines) == 3 and all("\n" not in line for line in lines), lines
    assert (
        "KVWATCH_MODE='enforse' is not valid (valid: off|log|enforce); running as log" in lines[0]
    )
    assert "'KVWATCH_MODE_CANARYY' is not a kvwatch setting" in lines[1]
    assert "KVWATCH_FLUSH_INTERVAL='1s' is not valid" in lines[2]
    rt = runtime.reset(settings)
    try:
        sgl.allocator(sgl.mha_pool())  # SGLang's own allocator: its hooked __init__ starts them
        contents = sgl.spool(rt)
    finally:
        rt.close()
    hellos = [r for r in contents.records if r["type"] == "hello"]
    assert hellos, contents.records
    for hello in hellos:
        assert (hello["mode"], hello["scrub"]) == ("log", "on_free"), hello
        assert list(hello["config_errors"]) == ["mode", "option", "flush_interval"], hello
    clean = from_env({"KVWATCH_MODE": "enforce", "KVWATCH_MODE_CANARY": "log"})
    assert clean.config_errors == () and clean.modes() == {"default": "enforce", "canary": "log"}
