"""SGLang 0.5.19's admission doors on the bed's SGLang 0.5.23: the release of the incident.

Loaded the way SGLang loads any plugin (entry point ``admit_0_5_19``, written into this bed's venv
only by setup_env.sh), never part of kvwatch. A prompt that passes the context check and not the
pool is rejected at intake: ``set_finish_with_abort`` sets ``to_finish`` and swaps the prompt for
a one-token stub. From 0.5.21 on, ``PrefillBootstrapQueue.add`` and ``DecodePreallocQueue.add``
first ask ``is_unadmitted_reject(req)`` and retire such a request (the client gets 400). 0.5.19's
two ``add`` bodies have no such check: the rest of each body is the same code. So this overlay
makes that one name, as the two doors' modules see it, say "admit"; nothing else changes
(``sglang.srt.disaggregation.utils.is_unadmitted_reject`` itself, which kvwatch reads to tell a
rejected request, stays the release's). README.md says why not the 0.5.19 modules themselves.
"""

from __future__ import annotations

import importlib
import logging
from typing import Any

logger = logging.getLogger("kvwatch.sglang_pd.admit_0_5_19")

DOORS = ("sglang.srt.disaggregation.prefill", "sglang.srt.disaggregation.decode")


def _admits_everything(req: Any) -> bool:
    """0.5.19's doors: no request is an unadmitted reject."""
    return False


def register() -> None:
    for name in DOORS:
        module = importlib.import_module(name)
        if not callable(getattr(module, "is_unadmitted_reject", None)):
            raise RuntimeError(f"admit_0_5_19: {name} has no is_unadmitted_reject to undo")
        module.is_unadmitted_reject = _admits_everything  # type: ignore[attr-defined]
    logger.warning("admit_0_5_19: the admission doors admit rejected requests (as 0.5.19)")
