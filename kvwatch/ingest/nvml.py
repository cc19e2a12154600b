"""GPU memory through NVML (nvidia-ml-py), read at scrape time.

On a node without an NVIDIA driver, :attr:`Nvml.up` is False: ``kvwatch_nvml_up 0`` and one log
line at start-up, not an error per scrape.
"""

from __future__ import annotations

import threading
from typing import Any

import structlog


class Nvml:
    def __init__(self, enabled: bool = True) -> None:
        self.log = structlog.get_logger("kvwatch.nvml")
        self._lock = threading.Lock()
        self._nvml: Any = None
        self._up = False
        if not enabled:
            self.log.info("nvml.disabled")
            return
        try:
            import pynvml

            pynvml.nvmlInit()
            count = pynvml.nvmlDeviceGetCount()
        except Exception as exc:  # no library, no driver, no device: all the same to us
            self.log.info("nvml.unavailable", error=str(exc) or type(exc).__name__)
            return
        self._nvml = pynvml
        self._up = True
        self.log.info("nvml.ready", gpus=count)

    @property
    def up(self) -> bool:
        return self._up

    def memory(self) -> list[tuple[str, int, int, int]]:
        """(gpu index, total, used, free) bytes for every GPU."""
        if not self._up:
            return []
        nvml = self._nvml
        rows: list[tuple[str, int, int, int]] = []
        with self._lock:
            for index in range(nvml.nvmlDeviceGetCount()):
                handle = nvml.nvmlDeviceGetHandleByIndex(index)
                info = nvml.nvmlDeviceGetMemoryInfo(handle)
                rows.append((str(index), int(info.total), int(info.used), int(info.free)))
        return rows

    def close(self) -> None:
        if self._up:
            self._up = False
            try:
                self._nvml.nvmlShutdown()
            except Exception as exc:
                self.log.info("nvml.shutdown_failed", error=str(exc))
