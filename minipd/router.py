"""The router: SGLang's native ``/generate``, the context check, and the PD handoff.

It tokenizes the prompt, enforces ``--context-length``, and drives the handoff: prefill's
bootstrap queue, then decode's reservation for the whole prompt (step 1), then prefill's
compute and send (step 2, which ends with prefill's "transfer complete" to decode), then waits
for decode's reply (step 3). It logs request ids and sizes, never text.
"""

from __future__ import annotations

import logging
import secrets
import threading
import time
from multiprocessing.queues import Queue

from minipd import httpjson, process, tokenizer
from minipd.config import ServeConfig
from minipd.httpjson import Body, call, error, message
from minipd.logs import setup

DEFAULT_MAX_NEW_TOKENS = 128
_WAIT_SECONDS = 3600.0


class Router:
    def __init__(
        self, cfg: ServeConfig, prefill_url: str, decode_url: str, logger: logging.Logger
    ) -> None:
        self.cfg = cfg
        self.prefill = prefill_url
        self.decode = decode_url
        self.log = logger
        self._count = 0
        self._lock = threading.Lock()

    def routes(self) -> dict[tuple[str, str], httpjson.Route]:
        return {
            ("GET", "/health"): self.health,
            ("GET", "/stats"): self.stats,
            ("POST", "/generate"): self.generate,
        }

    def health(self, body: Body) -> tuple[int, Body]:
        for url in (self.prefill, self.decode):
            status, _ = call(url, "/health", timeout=5)
            if status != 200:
                return error(503, "a worker is not healthy")
        return 200, {"status": "ok"}

    def stats(self, body: Body) -> tuple[int, Body]:
        _, prefill = call(self.prefill, "/stats", timeout=5)
        _, decode = call(self.decode, "/stats", timeout=5)
        router = {"process_cpu_seconds": time.process_time()}
        return 200, {"router": router, "prefill": prefill, "decode": decode}

    def _rid(self) -> str:
        with self._lock:
            self._count += 1
            return f"req-{self._count}-{secrets.token_hex(4)}"

    def generate(self, body: Body) -> tuple[int, Body]:
        started = time.monotonic()
        text = body.get("text")
        params = body.get("sampling_params") or {}
        if not isinstance(text, str) or not isinstance(params, dict):
            return error(400, "'text' must be a string and 'sampling_params' an object")
        try:
            max_new = int(params.get("max_new_tokens", DEFAULT_MAX_NEW_TOKENS))
            float(params.get("temperature", 0.0))  # accepted; the model is greedy
        except (TypeError, ValueError):
            return error(400, "invalid sampling_params")
        if max_new < 1:
            return error(400, "max_new_tokens must be >= 1")
        rows = tokenizer.encode(text, self.cfg.tokenizer_piece_bytes)
        n = len(rows)
        rid = self._rid()
        status, reply = self._handoff(rid, rows, max_new)
        self.log.info(
            "rid=%s prompt_tokens=%d max_new_tokens=%d status=%d completion_tokens=%s "
            "latency=%.3fs",
            rid,
            n,
            max_new,
            status,
            reply.get("meta_info", {}).get("completion_tokens", 0),
            time.monotonic() - started,
        )
        return status, reply

    def _handoff(self, rid: str, rows: tokenizer.Rows, max_new: int) -> tuple[int, Body]:
        n = len(rows)
        if n == 0:
            return error(400, "the prompt is empty")
        if n > self.cfg.context_length:
            return error(
                400,
                f"The input ({n} tokens) is longer than the model's context length "
                f"({self.cfg.context_length} tokens).",
            )
        # Prefill's bootstrap queue (where 0.5.21+ rejects a request that cannot fit).
        body = {"rid": rid, "tokens": tokenizer.to_wire(rows), "max_new_tokens": max_new}
        status, reply = call(self.prefill, "/bootstrap", body)
        if status != 200:
            return status, reply
        # Step 1: tell decode the prompt length; decode reserves pages for all of it.
        reserve = {"rid": rid, "prompt_tokens": n, "max_new_tokens": max_new}
        status, pages = call(self.decode, "/reserve", reserve, timeout=_WAIT_SECONDS)
        if status != 200:
            call(self.prefill, "/abort", {"rid": rid})
            return status, pages
        # Step 2: prefill computes the KV, writes decode's pages, sends "transfer complete".
        transfer = {
            "rid": rid,
            "dest_pages": pages["pages"],
            "dest_tags": pages["tags"],
            "decode_url": self.decode,
        }
        status, sent = call(self.prefill, "/transfer", transfer, timeout=_WAIT_SECONDS)
        if status != 200:
            if self.cfg.release.router_drops_decode_half:
                call(self.decode, "/abort", {"rid": rid, "drained": True})
            self.log.info("rid=%s prefill failed: %d %s", rid, status, message(sent)[:80])
            return status, sent
        # Step 3: decode admits and generates.
        status, out = call(self.decode, "/wait", {"rid": rid}, timeout=_WAIT_SECONDS)
        if status != 200:
            return status, out
        completion = int(out["completion_tokens"])
        return 200, {
            "text": tokenizer.decode(tokenizer.from_wire(str(out["output"]))),
            "meta_info": {
                "id": rid,
                "prompt_tokens": n,
                "completion_tokens": completion,
                "finish_reason": {"type": "length", "length": completion},
            },
        }


def main(
    cfg: ServeConfig,
    prefill_url: str,
    decode_url: str,
    ready: Queue[tuple[str, int]],
    parent_pid: int,
) -> None:
    process.die_with_parent(parent_pid)
    stop = process.stop_event()
    logger = setup("router", cfg.log_dir)
    router = Router(cfg, prefill_url, decode_url, logger)
    server = httpjson.JsonServer(cfg.host, cfg.port, router.routes())
    server.start()
    logger.info("router listening on http://%s:%d", cfg.host, server.port)
    ready.put(("router", server.port))
    process.wait(stop)
    server.stop()
