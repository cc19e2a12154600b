"""SGLang 0.5.19's handling of a rejected prompt on the bed's SGLang 0.5.23: the incident's release.

Loaded the way SGLang loads any plugin (entry point ``admit_0_5_19``, written into this bed's venv
only by setup_env.sh), never part of kvwatch; only the 0.5.19 prefill of the incident deployment
loads it. A prompt that passes the context check and not the pool is rejected at intake:
``set_finish_with_abort`` sets ``to_finish`` and swaps the prompt for a one-token stub. Two later
fixes stop such a request; 0.5.19 has neither, and this overlay undoes both, for such a request
only:

- the admission doors: from 0.5.21, ``PrefillBootstrapQueue.add`` and ``DecodePreallocQueue.add``
  first ask ``is_unadmitted_reject(req)`` and retire it (the client gets 400). 0.5.19's ``add``
  bodies have no such check (the rest of each body is the same code): here that one name, as the
  two doors' modules see it, admits it;
- prefill's batch result: 0.5.23 asks ``is_aborted(req)`` after the forward and drops an aborted
  request's KV instead of sending it (``_retire_aborted_prefill_result``, which tells decode).
  0.5.19 sends it like any other (``send_kv_chunk``): here ``is_aborted``, as prefill's module
  sees it, is False for a request the overlay's door admitted, so its one page goes to decode.

``sglang.srt.disaggregation.utils`` itself is untouched: kvwatch reads its
``is_unadmitted_reject`` to tell a rejected request, as on any release. README.md says why not
0.5.19's own modules.
"""

from __future__ import annotations

import importlib
import logging
from typing import Any

logger = logging.getLogger("kvwatch.sglang_pd.admit_0_5_19")

PREFILL, DECODE = "sglang.srt.disaggregation.prefill", "sglang.srt.disaggregation.decode"
ADMITTED = "_bed_0_5_19_admitted_reject"  # set on a request the overlay's door admitted


def register() -> None:
    utils = importlib.import_module("sglang.srt.disaggregation.utils")
    rejected, aborted = utils.is_unadmitted_reject, utils.is_aborted

    def door(req: Any) -> bool:
        """0.5.19's doors: nothing is an unadmitted reject (the ones 0.5.23 would retire are
        marked, for the batch result below)."""
        if rejected(req):
            setattr(req, ADMITTED, True)
        return False

    def aborted_after_forward(req: Any) -> bool:
        return False if getattr(req, ADMITTED, False) else bool(aborted(req))

    for name in (PREFILL, DECODE):
        module = importlib.import_module(name)
        if not callable(getattr(module, "is_unadmitted_reject", None)):
            raise RuntimeError(f"admit_0_5_19: {name} has no is_unadmitted_reject to undo")
        module.is_unadmitted_reject = door  # type: ignore[attr-defined]
    prefill = importlib.import_module(PREFILL)
    if not callable(getattr(prefill, "is_aborted", None)):
        raise RuntimeError(f"admit_0_5_19: {PREFILL} has no is_aborted to undo")
    prefill.is_aborted = aborted_after_forward  # type: ignore[attr-defined]
    logger.warning("admit_0_5_19: rejected requests are admitted and sent on (as 0.5.19)")
