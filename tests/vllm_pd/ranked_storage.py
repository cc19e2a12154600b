# mypy: allow-subclassing-any, disable-error-code="import-not-found"
"""``RankedExampleConnector``: vLLM's shared-storage connector with the TP rank in its paths.

vLLM 0.32's ``ExampleConnector`` names a stored prompt by its tokens' hash alone
(``_generate_foldername_debug``): at tensor parallelism every rank writes its own shard of the
heads to the same files, the last writer wins, and each decode rank loads whichever shard that
was. kvwatch's per-head seal catches it on the rank that loads another rank's heads (the TP bed's
``test_shared_storage_mixes_tp_shards``): a bug of the transport, not a finding to silence. For
clean traffic at TP > 1 the bed moves KV with this subclass, which keeps one folder per rank, so
only a same-width pair can use it (a heterogeneous pair needs NIXL's head-slice reads).
"""

from __future__ import annotations

import os
from typing import Any

from vllm.distributed.kv_transfer.kv_connector.v1.example_connector import ExampleConnector


def _tp_rank() -> int:
    try:
        from vllm.distributed.parallel_state import get_tensor_model_parallel_rank

        return int(get_tensor_model_parallel_rank())
    except Exception:  # the scheduler's process has no TP group: it asks for rank 0's folder
        return 0


class RankedExampleConnector(ExampleConnector):
    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self._tp_rank = _tp_rank()

    def _generate_foldername_debug(
        self, token_ids: Any, mm_hashes: list[str], create_folder: bool = False
    ) -> str:
        folder = f"{super()._generate_foldername_debug(token_ids, mm_hashes)}-tp{self._tp_rank}"
        if create_folder:
            os.makedirs(folder, exist_ok=True)
        return folder
