"""The plugin's settings, read once per process from the environment."""

from __future__ import annotations

import logging
import os
from dataclasses import dataclass

from engine_hooks import Mode
from engine_hooks.scrub import Scrub, parse_scrub
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


def _mode(text: str, default: Mode) -> Mode:
    try:
        return Mode(text.strip().lower())
    except ValueError:
        return default


def from_env(environ: dict[str, str] | None = None) -> Settings:
    env = dict(os.environ if environ is None else environ)
    mode = _mode(env.get("KVWATCH_MODE", "log"), Mode.LOG)
    # A per-detector override names a hooked detector: ``KVWATCH_MODE_CANARY=enforce``.
    per = {
        name: _mode(env[f"KVWATCH_MODE_{name.upper()}"], mode)
        for name in HOOKED_DETECTORS
        if f"KVWATCH_MODE_{name.upper()}" in env
    }
    try:
        interval = max(0.1, float(env.get("KVWATCH_FLUSH_INTERVAL", "1.0")))
    except ValueError:
        interval = 1.0
    try:
        freed_watch_s = max(0.0, float(env.get("KVWATCH_FREED_WATCH_S", DEFAULT_FREED_WATCH_S)))
    except ValueError:
        freed_watch_s = DEFAULT_FREED_WATCH_S
    scrub = parse_scrub(env.get("KVWATCH_SCRUB", "off").strip() or "off", "KVWATCH_SCRUB", logger)
    return Settings(
        mode=mode,
        detector_modes=per,
        spool=env.get("KVWATCH_SPOOL", DEFAULT_SPOOL_DIR),
        flush_interval=interval,
        step_check=env.get("KVWATCH_STEP_CHECK", "1").strip() not in ("0", "false", "no", "off"),
        role=env.get("KVWATCH_ROLE", ""),
        scrub=scrub,
        freed_watch_s=freed_watch_s,
    )
