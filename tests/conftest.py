"""Shared by every test directory: how ``make unit`` spreads its tests over two pytest-xdist
workers, then runs the timing-sensitive beds alone.

Under xdist a file's tests stay on one worker (module fixtures run once, and tests that read what
an earlier one left run in order), and the install tests share one worker, so that the wheel and
its venvs are built once. The beds that wait on real Prometheus and Alertmanager timings (a
fleet's rule evaluations, group waits, one page across replicas) are marked ``serial``: on two
cores beside another worker they missed their windows, so ``make unit`` runs them after the rest,
alone. Outside xdist (the engine stages) only the marker is added.
"""

from __future__ import annotations

import pytest

#: Files (or folders) whose tests run alone (``-m serial``), after the parallel run.
SERIAL = (
    "tests/fleet/",
    "tests/e2e/test_pipeline.py",
    "tests/kvwatch/alerting/test_pager.py",
    "tests/install/test_second_day.py",  # one test installs /etc/kvwatch/kvwatch.toml
)


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    xdist = config.pluginmanager.hasplugin("xdist") and config.getoption("dist", "no") != "no"
    for item in items:
        path = item.nodeid.split("::", 1)[0]
        if path.startswith(SERIAL):
            item.add_marker(pytest.mark.serial)
        if xdist:
            group = "tests/install" if path.startswith("tests/install/") else path
            item.add_marker(pytest.mark.xdist_group(group))
