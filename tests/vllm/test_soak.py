"""Clean traffic through vLLM's own scheduler and runner connector code: zero findings.

Thousands of requests of mixed lengths sharing prefixes (prefix-cache hits on both engines),
mixed output lengths, aborts on both engines in every state (waiting, waiting for the remote
KV, running), and a decode pool small enough that vLLM preempts running requests; in enforce
mode, so a false finding would also fail a request.
"""

from __future__ import annotations

import random
from pathlib import Path

import pytest
from harness import BLOCK_SIZE, VOCAB, pair
from vllm.v1.engine import FinishReason


@pytest.mark.parametrize(
    ("runner", "transport", "requests"),
    [("v1", "async", 3000), ("v2", "async", 2000), ("v1", "sync", 1000), ("v2", "sync", 1000)],
)
def test_clean_soak(tmp_path: Path, model: str, runner: str, transport: str, requests: int) -> None:
    rng = random.Random(f"{runner}-{transport}")
    # ExampleConnector (a debug connector) cannot resume a preempted request under vLLM 0.32:
    # it then loads a file keyed by the prompt and the outputs so far, which does not exist. The
    # synchronous soak gets a pool without preemption; the asynchronous one preempts.
    blocks = 40 if transport == "async" else 400
    p = pair(tmp_path, model, transport, mode="enforce", runner=runner, num_blocks=blocks)
    prefixes = [[rng.randrange(1, VOCAB) for _ in range(rng.randrange(0, 13))] for _ in range(12)]
    sent = aborted = 0
    for _ in range(requests * 20):
        if sent >= requests and p.idle():
            break
        for _ in range(min(rng.randrange(0, 4), requests - sent)):
            prefix = rng.choice(prefixes)
            suffix = [rng.randrange(1, VOCAB) for _ in range(rng.randrange(1, 28))]
            if transport == "sync" and (len(prefix) + len(suffix) - 1) % BLOCK_SIZE == 0:
                # ExampleConnector looks a prompt up by its first (n-2)//B*B tokens but loads
                # the file of its first (n-1)//B*B: for these lengths they differ, and a shorter
                # prompt with the same prefix makes it load a file that does not exist.
                suffix.append(1)
            p.serve(f"r{sent}", prefix + suffix, max_tokens=rng.randrange(1, 9))
            sent += 1
        if rng.random() < 0.06:
            node = rng.choice((p.prefill, p.decode))
            live = [r for r, q in node.scheduler.requests.items() if not q.is_finished()]
            if live:
                node.abort(rng.choice(live))
                aborted += 1
        p.step()
    assert sent == requests and p.idle()
    verdicts = p.prefill.kvwatch.verdicts + p.decode.kvwatch.verdicts
    assert verdicts == []
    for node in (p.prefill, p.decode):
        stats = node.child("worker").watch._stats
        bad = [key for key in stats.values if key[0] in ("mismatches", "hook_errors")]
        assert bad == []
    served = [o for o in p.decode.finished.values() if o.finish_reason == FinishReason.LENGTH]
    assert not [o for o in p.decode.finished.values() if o.finish_reason == FinishReason.ERROR]
    checked = p.decode.stat("verifications", "checksum")
    assert aborted > requests // 100
    assert p.decode.preempted > requests // 100 or transport == "sync"
    # Every request decode loaded from prefill was checked (a sync loader skips prompts shorter
    # than two blocks, and prefix hits can cover a whole prompt).
    assert checked > len(served) * (0.9 if transport == "async" else 0.5), (checked, len(served))
