"""One decode rank of a two-rank TP group, in its own process, for ``test_tp_consensus.py``.

Each rank joins a gloo process group over loopback (the CPU group SGLang's decode transfer queue
all-reduces its polls over), publishes its ranks to SGLang's runtime context as SGLang's launcher
would, loads kvwatch through SGLang's own ``load_plugins()``, and serves requests through
SGLang's real classes (``Bed``): the door, ``_pre_alloc``, ``process_prebuilt``, the batch
result path. What a rank's transfer wrote is the test's choice, per rank: one rank's shard of a
request can be short while the other's is whole.
"""

from __future__ import annotations

import os
import time
import traceback
import types
import warnings
from multiprocessing.connection import Connection
from pathlib import Path
from typing import Any

import torch.distributed as dist

#: The requests, in order: (rid, bootstrap room, prompt tokens, pages written per rank; None
#: writes every reserved page).
Plan = list[tuple[str, int, int, dict[int, int | None]]]


def rank_main(rank: int, port: int, spool: str, mode: str, plan: Plan, out: Connection) -> None:
    try:
        out.send(("ok", _serve(rank, port, spool, mode, plan)))
    except BaseException:  # the parent reports the child's own traceback
        out.send(("error", traceback.format_exc()))
    finally:
        out.close()


def _serve(rank: int, port: int, spool: str, mode: str, plan: Plan) -> dict[str, Any]:
    os.environ["SGLANG_PLUGINS"] = "kvwatch"
    os.environ["KVWATCH_SPOOL"] = spool
    Path(spool).mkdir(parents=True, exist_ok=True)  # as the daemon's install would
    warnings.filterwarnings("ignore", category=UserWarning)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=2)
    from tests.sglang.sgl import published

    group = types.SimpleNamespace(cpu_group=dist.group.WORLD, world_size=2, rank_in_group=rank)
    ranks = dict(tp_rank=rank, attn_tp_rank=rank, pp_rank=0, pp_size=1, attn_tp_group=group)
    with published(**ranks):
        from engine_hooks.sglang import runtime
        from engine_hooks.sglang.config import from_env

        settings = from_env({"KVWATCH_MODE": mode, "KVWATCH_SPOOL": spool})
        rt = runtime.reset(settings)
        rt.context.rank = rank
        from tests.sglang.bed import Bed

        results: dict[str, Any] = {"finished": {}, "seconds": {}}
        with Bed(page_size=16, radix=False) as bed:
            for rid, room, tokens, written in plan:
                req = bed.request(rid, list(range(300, 300 + tokens)), room=room)
                assert bed.arrive(req)
                bed.reserve(req)
                bed.transfer(req, written=written.get(rank))
                started = time.monotonic()
                bed.admit([req])
                bed.run_until_idle()
                results["seconds"][rid] = time.monotonic() - started
                reason = req.finished_reason
                results["finished"][rid] = (
                    type(reason).__name__,
                    getattr(reason, "status_code", None),
                    len(req.output_ids),
                )
        rt.close()
        results["spool"] = str(Path(spool))
        dist.destroy_process_group()
        return results
