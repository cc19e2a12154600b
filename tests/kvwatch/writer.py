"""engine_hooks' real SpoolWriter, loaded without the engine_hooks package (and so without torch).

``engine_hooks/__init__.py`` imports torch; ``engine_hooks/spool.py`` itself needs only kvspool and
the standard library. Loading the module from its file keeps producer subprocesses fast.
"""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path
from types import ModuleType

SPOOL_PY = Path(__file__).resolve().parents[2] / "engine_hooks" / "spool.py"


def spool_module() -> ModuleType:
    name = "_kvwatch_tests_spool_writer"
    module = sys.modules.get(name)
    if module is None:
        spec = importlib.util.spec_from_file_location(name, SPOOL_PY)
        assert spec is not None and spec.loader is not None
        module = importlib.util.module_from_spec(spec)
        sys.modules[name] = module
        spec.loader.exec_module(module)
    return module
