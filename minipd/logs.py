"""Per-role logging to stderr and ``--log-dir/<role>.log``, and SGLang's startup line."""

from __future__ import annotations

import logging
import sys
from pathlib import Path
from typing import TYPE_CHECKING

if TYPE_CHECKING:  # the router logs too, and never loads torch
    import torch


def setup(role: str, log_dir: str | None) -> logging.Logger:
    logger = logging.getLogger(f"minipd.{role}")
    logger.setLevel(logging.INFO)
    logger.propagate = False
    fmt = logging.Formatter(f"[%(asctime)s {role}] %(message)s", "%Y-%m-%d %H:%M:%S")
    handlers: list[logging.Handler] = [logging.StreamHandler(sys.stderr)]
    if log_dir:
        Path(log_dir).mkdir(parents=True, exist_ok=True)
        handlers.append(logging.FileHandler(Path(log_dir) / f"{role}.log"))
    for handler in handlers:
        handler.setFormatter(fmt)
        logger.addHandler(handler)
    return logger


def available_memory_gb(device: torch.device) -> float:
    """Free memory where the pool lives: the GPU's, or the host's MemAvailable on CPU."""
    if device.type == "cuda":
        import torch

        free, _ = torch.cuda.mem_get_info(device)
        return free / 2**30
    try:
        for line in Path("/proc/meminfo").read_text().splitlines():
            if line.startswith("MemAvailable:"):
                return int(line.split()[1]) / 2**20
    except OSError:
        pass
    return 0.0


def startup_line(
    pool_tokens: int, context_length: int, max_running_requests: int, device: torch.device
) -> str:
    """The scheduler's start-up line, with SGLang's field names, so that log checks (the
    incident's grep, ``kvwatch check-logs``) read minipd as they read SGLang."""
    return (
        f"max_total_num_tokens={pool_tokens}, chunked_prefill_size=-1, "
        f"max_prefill_tokens={pool_tokens}, max_running_requests={max_running_requests}, "
        f"context_len={context_length}, available_gpu_mem={available_memory_gb(device):.2f} GB"
    )
