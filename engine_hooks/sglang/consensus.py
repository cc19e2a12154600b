"""One verdict per request across the ranks of SGLang's attention-TP group.

With tensor parallelism every rank's scheduler runs its own plugin on its own shard of the KV
heads and admits the same batch (SGLang keeps the ranks in lockstep: the decode transfer queue
MIN-reduces its poll states over the same group, ``poll_and_all_reduce``). A check that fails on
one rank's shard must fail the request on every rank: a request finished on one rank alone
leaves the others waiting in the next step's collectives, the hang SGLang's own
``--disaggregation-enable-kv-checksum`` shows at TP > 1.

So, once per admission batch (``process_prebuilt``), never per token, the ranks MAX-reduce one
flag per request (it failed a check in ``enforce`` on this rank) over the group's CPU (gloo)
group, SGLang's ``attn_tp_cpu_group``, and each rank fails every request that any rank failed.
The collective runs on every rank for every batch whatever this rank's checks did (they are
guarded one by one; see ``hooks_disagg.before_process_prebuilt``), and only when some detector
is in ``enforce``, a setting every rank reads from the same environment: its count never differs
between ranks.
"""

from __future__ import annotations

import importlib
import logging
from collections.abc import Sequence
from typing import Any

import torch
import torch.distributed as dist

logger = logging.getLogger("kvwatch.sglang")


class Consensus:
    """The attention-TP group of this scheduler (None: one rank, nothing to agree)."""

    def __init__(self, group: Any = None, size: int = 1, rank: int = 0) -> None:
        self.group = group if size > 1 else None
        self.size = size
        self.rank = rank

    @property
    def slice(self) -> tuple[int, int]:
        """This rank's shard of the KV heads, as (group size, rank): what a seal covers."""
        return (self.size, self.rank) if self.group is not None else (1, 0)

    @classmethod
    def resolve(cls) -> Consensus:
        """This process's attention-TP group as SGLang built it (0.5.23: the runtime context's
        ``attn_tp_group``; earlier: ``dp_attention.get_attention_tp_group()``), read once the
        first request arrives; one rank when there is none (no distributed set-up)."""
        for module, path in (
            ("sglang.srt.runtime_context", ("get_parallel", "attn_tp_group")),
            ("sglang.srt.layers.dp_attention", ("get_attention_tp_group",)),
        ):
            try:
                getter = getattr(importlib.import_module(module), path[0])
                group = getattr(getter(), path[1]) if len(path) > 1 else getter()
            except Exception:  # not built in this process (or not this release's name)
                continue
            size = int(getattr(group, "world_size", 1) or 1)
            rank = int(getattr(group, "rank_in_group", 0) or 0)
            return cls(getattr(group, "cpu_group", None), size, rank)
        if dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1:
            # Several ranks and no group of SGLang's to agree over: each rank's verdict is its
            # own (an enforce failure on one shard may finish the request on that rank alone).
            logger.error(
                "kvwatch: SGLang's attention-TP group was not found in a %d-rank process group;"
                " the ranks' verdicts are not agreed (this SGLang release is not one kvwatch"
                " knows)",
                dist.get_world_size(),
            )
        return cls()

    @property
    def active(self) -> bool:
        return self.group is not None

    def agree(self, failed: Sequence[bool]) -> list[bool]:
        """Per request of the batch: whether any rank failed it (one small all-reduce)."""
        if self.group is None or not failed:
            return list(failed)
        flags = torch.tensor([int(f) for f in failed], dtype=torch.int32)
        dist.all_reduce(flags, op=dist.ReduceOp.MAX, group=self.group)
        return [bool(f) for f in flags.tolist()]
