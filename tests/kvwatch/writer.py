"""The real SpoolWriter, from kvspool (torch-free, so producer subprocesses start fast)."""

from __future__ import annotations

from types import ModuleType

import kvspool.writer


def spool_module() -> ModuleType:
    return kvspool.writer
