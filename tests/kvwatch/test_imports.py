from __future__ import annotations

import subprocess
import sys

MODULES = (
    "kvwatch.cli",
    "kvwatch.daemon",
    "kvwatch.spool_reader",
    "kvwatch.journal",
    "kvwatch.metrics",
    "kvwatch.logparse",
    "kvwatch.logwatch",
    "kvwatch.nvml",
    "kvwatch.checklogs",
    "kvwatch.incidents",
    "kvwatch.incidents_log",
    "kvwatch.config",
)


def test_the_daemon_never_imports_torch_or_the_hooks() -> None:
    code = (
        f"import sys\nfor m in {MODULES!r}: __import__(m)\n"
        "bad = [m for m in sys.modules if m.split('.')[0] in ('torch', 'engine_hooks', 'numpy')]\n"
        "assert not bad, bad\n"
    )
    subprocess.run([sys.executable, "-c", code], check=True)
