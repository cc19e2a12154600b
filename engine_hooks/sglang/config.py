"""The plugin's settings, read once per process from the environment."""

from __future__ import annotations

import logging
import os
from dataclasses import dataclass

from engine_hooks import Mode
from engine_hooks.options import Options
from engine_hooks.scrub import Scrub
from engine_hooks.spool import DEFAULT_SPOOL_DIR
from engine_hooks.takers import DEFAULT_FREED_WATCH_S
from kvspool.catalogue import HOOKED_DETECTORS

logger = logging.getLogger("kvwatch.sglang")


@dataclass(frozen=True, slots=True)
class Settings:
    mode: Mode
    detector_modes: dict[str, Mode]
    spool: str
    flush_interval: float
    step_check: bool
    role: str
    #: When pages are overwritten so a stale read reads nothing: ``KVWATCH_SCRUB``.
    scrub: Scrub = Scrub.OFF
    #: How long an aborted transfer's pages released on a timeout are watched for the requests
    #: that take them: ``KVWATCH_FREED_WATCH_S`` (see :mod:`engine_hooks.sglang.drain`).
    freed_watch_s: float = DEFAULT_FREED_WATCH_S
    #: The settings that were invalid (catalogue SETTING names), each run with its fallback.
    config_errors: tuple[str, ...] = ()

    @property
    def off(self) -> bool:
        return self.mode is Mode.OFF and all(m is Mode.OFF for m in self.detector_modes.values())

    @property
    def enforcing(self) -> bool:
        """Some detector fails requests (the TP ranks then agree on each: consensus.py)."""
        return Mode.ENFORCE in (self.mode, *self.detector_modes.values())

    def modes(self) -> dict[str, Mode | str]:
        out: dict[str, Mode | str] = {"default": self.mode}
        out.update(self.detector_modes)
        return out


def from_env(environ: dict[str, str] | None = None) -> Settings:
    """The settings from ``environ`` (the process's), each checked (:mod:`engine_hooks.options`):
    a bad value is one error line here and a config error on the engine's hellos."""
    env = dict(os.environ if environ is None else environ)
    check = Options(logger)
    mode = check.mode("mode", "KVWATCH_MODE", env.get("KVWATCH_MODE", "log"), Mode.LOG)
    # A per-detector override names a hooked detector: ``KVWATCH_MODE_CANARY=enforce``.
    overrides = {f"KVWATCH_MODE_{name.upper()}": name for name in HOOKED_DETECTORS}
    per = {
        name: check.mode(f"mode_{name}", variable, env[variable], mode)
        for variable, name in overrides.items()
        if variable in env
    }
    check.unknown(
        (v for v in env if v.startswith("KVWATCH_MODE_") and v not in overrides),
        overrides,
        "",
    )
    interval = check.seconds(
        "flush_interval", "KVWATCH_FLUSH_INTERVAL", env.get("KVWATCH_FLUSH_INTERVAL", 1.0), 1.0, 0.1
    )
    freed_watch_s = check.seconds(
        "freed_watch_s",
        "KVWATCH_FREED_WATCH_S",
        env.get("KVWATCH_FREED_WATCH_S", DEFAULT_FREED_WATCH_S),
        DEFAULT_FREED_WATCH_S,
        0.0,
    )
    scrub = check.scrub("scrub", "KVWATCH_SCRUB", env.get("KVWATCH_SCRUB", "off"))
    step_check = check.flag(
        "step_check", "KVWATCH_STEP_CHECK", env.get("KVWATCH_STEP_CHECK", "1"), True
    )
    return Settings(
        mode=mode,
        detector_modes=per,
        spool=env.get("KVWATCH_SPOOL", DEFAULT_SPOOL_DIR),
        flush_interval=interval,
        step_check=step_check,
        role=env.get("KVWATCH_ROLE", ""),
        scrub=scrub,
        freed_watch_s=freed_watch_s,
        config_errors=tuple(check.errors),
    )
