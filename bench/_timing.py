"""What the bench scripts share to time a call: the best of several runs."""

from __future__ import annotations

import time
from collections.abc import Callable


def best_seconds(fn: Callable[[], object], repeat: int) -> float:
    """The least wall time of ``fn`` over ``repeat`` runs: the run the machine disturbed least."""
    best = float("inf")
    for _ in range(repeat):
        start = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - start)
    return best
