from __future__ import annotations

import shutil

from prometheus_client import CollectorRegistry, generate_latest

from kvwatch.expose.metrics import KvwatchCollector
from kvwatch.ingest.nvml import Nvml
from kvwatch.store.state import State


def test_nvml_reports_up_or_down_without_errors() -> None:
    nvml = Nvml(True)
    registry = CollectorRegistry(auto_describe=False)
    registry.register(KvwatchCollector(State(), nvml))
    for _ in range(3):  # no error per scrape on a node without a GPU
        text = generate_latest(registry).decode()
    has_driver = shutil.which("nvidia-smi") is not None
    if nvml.up:
        rows = nvml.memory()
        assert rows and all(total > 0 and used + free <= total + 1 for _, total, used, free in rows)
        assert 'kvwatch_gpu_memory_bytes{gpu="0",state="total"}' in text
        assert "kvwatch_nvml_up 1.0" in text
    else:
        assert not has_driver, "nvidia-smi is here but NVML did not come up"
        assert nvml.memory() == []
        assert "kvwatch_nvml_up 0.0" in text
        assert 'kvwatch_collector_success{collector="nvml"} 1.0' in text
    nvml.close()


def test_nvml_disabled() -> None:
    nvml = Nvml(False)
    assert not nvml.up and nvml.memory() == []
