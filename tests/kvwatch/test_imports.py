from __future__ import annotations

import subprocess
import sys

MODULES = (
    "kvwatch.cli",
    "kvwatch.daemon",
    "kvwatch.ingest.spool.reader",
    "kvwatch.store.journal",
    "kvwatch.expose.metrics",
    "kvwatch.ingest.logs.parse",
    "kvwatch.ingest.logs.watch",
    "kvwatch.ingest.nvml",
    "kvwatch.commands.check_logs",
    "kvwatch.store.incident",
    "kvwatch.store.incidents_log",
    "kvwatch.config",
)


def test_the_daemon_never_imports_torch_or_the_hooks() -> None:
    code = (
        f"import sys\nfor m in {MODULES!r}: __import__(m)\n"
        "bad = [m for m in sys.modules if m.split('.')[0] in ('torch', 'engine_hooks', 'numpy')]\n"
        "assert not bad, bad\n"
    )
    subprocess.run([sys.executable, "-c", code], check=True)
