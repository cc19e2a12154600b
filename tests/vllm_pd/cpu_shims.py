"""Test-bed shims for the vLLM PD bed on a CPU-only machine.

Loaded the way vLLM loads any plugin: the ``vllm.general_plugins`` entry point ``cpu_bed`` (a
dist-info that tests/vllm_pd/setup_env.sh writes into build/vllm-pd-site, on the servers'
PYTHONPATH only), which vLLM runs in every process it starts: API server, engine core, worker.
Nothing here is part of kvwatch or its connector.
"""

from __future__ import annotations

import logging

from tests.nixl_cpu import progress_delay

logger = logging.getLogger("kvwatch.vllm_pd.cpu_bed")


def register() -> None:
    try:
        progress_delay()
    except ImportError as error:  # NIXL not installed: the shared-storage bed needs no shim
        logger.info("cpu_bed: progress_delay skipped (%s)", error)
