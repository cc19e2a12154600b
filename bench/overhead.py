"""kvwatch's cost inside minipd: the same seeded workload with ``--kvwatch off``, ``log`` and
``enforce``, in one run, as ratios to ``off``.

Run: ``python bench/overhead.py [--requests N] [--concurrency C] [--rounds R]
[--scrub-rounds S] [--side-rounds N --side-windows W --window-s T] [--device cuda]``.

Prints, per mode, end-to-end throughput (generated tokens/s and prompt+generated tokens/s
through the router) and decode step time (the mean step, and the time inside steps per
generated token, which does not depend on how requests happened to batch; both include the
per-step page-tag check of the whole batch and page allocations inside steps), each as a ratio
to ``off``. Wall-clock ratios swing by 10-20% on a machine that other work shares, so it
also prints two direct measures: the share of decode step CPU time spent in the per-step hooks
(page tags of the batch, canary and tag bump of pages allocated in a step), and all hooks'
own time in both workers (kvwatch's ``hook_seconds``, wall time inside the hooks, so an upper
bound: it includes waits for the GIL) per generated token, as a share of the CPU per token that
``off`` needs.
Modes are interleaved over ``--rounds`` rounds and each figure is the median over rounds, so
drift on a shared machine hits all modes alike. Targets (issue 3): all detectors at most 3% of
end-to-end throughput; page tags plus canaries at most 1% of decode step time.

Scrub (issue 17): the hooks' scrub of scattered pages in bytes per second against a plain
memset (``zero_()``) of the same number of pages in one run, on the host and, with
``--device cuda``, on the GPU (interleaved rounds); and, over ``--scrub-rounds`` rounds,
end-to-end generated tokens/s of minipd with ``--kvwatch log`` and ``--kvwatch-scrub``
``on_free`` and ``on_reserve`` as ratios to scrub ``off`` (target: on_reserve >= 0.99x); and,
over ``--side-rounds`` rounds, scrub ``off`` and ``on_reserve`` served side by side under the
same load, which resolves a 1% difference that sequential rounds cannot (docs/scrub.md).
"""

from __future__ import annotations

import argparse
import contextlib
import gc
import io
import random
import statistics
import subprocess
import tempfile
import threading
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from contextlib import ExitStack
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from minipd.launch import generate, get, start, stop

MODES = ("off", "log", "enforce")


@dataclass
class Run:
    wall: float
    generated: int
    prompt: int
    step_seconds: float
    steps: int
    step_hook_seconds: float
    step_cpu_seconds: float
    step_hook_cpu_seconds: float
    decode_tokens: int  # running requests summed over decode steps (one token each per step)
    cpu_seconds: float  # all three processes
    hook_seconds: float  # every hook in prefill and decode (kvwatch's own hook_seconds)

    @property
    def tokens_per_s(self) -> float:
        return self.generated / self.wall

    @property
    def all_tokens_per_s(self) -> float:
        return (self.generated + self.prompt) / self.wall

    @property
    def step_ms(self) -> float:
        return 1000 * self.step_seconds / max(1, self.steps)

    @property
    def decode_us_per_token(self) -> float:
        """All time inside decode steps over the tokens they made: the same work in every mode
        (each token is one attention over its context), however the batches fell."""
        return 1e6 * self.step_seconds / max(1, self.generated)

    @property
    def hook_share(self) -> float:
        return self.step_hook_cpu_seconds / max(1e-12, self.step_cpu_seconds)

    @property
    def hook_us_per_token(self) -> float:
        return 1e6 * self.hook_seconds / max(1, self.generated)

    @property
    def host_us_per_running_request(self) -> float:
        """The per-step hooks' CPU time (the batch's tag check and the canary and tag work on
        pages allocated in the step) per decode step per running request."""
        return 1e6 * self.step_hook_cpu_seconds / max(1, self.decode_tokens)

    @property
    def step_cpu_ms(self) -> float:
        return 1000 * self.step_cpu_seconds / max(1, self.steps)

    @property
    def cpu_us_per_token(self) -> float:
        """CPU time of router, prefill and decode per generated token: the cost of serving,
        which other load on the machine does not inflate as it inflates wall time."""
        return 1e6 * self.cpu_seconds / max(1, self.generated)


def workload(seed: int, requests: int, min_words: int, max_words: int) -> list[tuple[str, int]]:
    rng = random.Random(seed)
    items = []
    for i in range(requests):
        words = rng.randint(min_words, max_words)
        items.append((" ".join(f"w{i}-{j}" for j in range(words)), rng.randint(16, 64)))
    return items


def start_minipd(
    mode: str, args: argparse.Namespace, scrub: str
) -> tuple[subprocess.Popen[str], str]:
    workdir = Path(tempfile.mkdtemp(prefix=f"minipd-bench-{mode}-{scrub}-"))
    (workdir / "spool").mkdir()  # as the daemon's install would: the hooks never create it
    serve = [
        "--kvwatch", mode, "--kvwatch-spool", str(workdir / "spool"),
        "--kvwatch-scrub", scrub,
        "--pool-tokens", str(args.pool_tokens), "--context-length", str(args.context_length),
        "--page-size", str(args.page_size), "--layers", str(args.layers),
    ]  # fmt: skip
    return start(serve, workdir)


def run_once(
    mode: str, args: argparse.Namespace, items: list[tuple[str, int]], scrub: str = "off"
) -> Run:
    proc, url = start_minipd(mode, args, scrub)
    try:
        generate(url, "warm up", 4)
        before = get(url, "/stats")
        started = time.perf_counter()
        with ThreadPoolExecutor(args.concurrency) as pool:
            replies = list(pool.map(lambda item: generate(url, *item), items))
        wall = time.perf_counter() - started
        after = get(url, "/stats")
    finally:
        stop(proc)
    if any(status != 200 for status, _ in replies):
        raise SystemExit(f"{mode}: a request failed")
    return Run(
        wall=wall,
        generated=sum(r["meta_info"]["completion_tokens"] for _, r in replies),
        prompt=sum(r["meta_info"]["prompt_tokens"] for _, r in replies),
        step_seconds=delta(before, after, "decode", "step_seconds"),
        steps=int(delta(before, after, "decode", "steps")),
        step_hook_seconds=delta(before, after, "decode", "step_hook_seconds"),
        step_cpu_seconds=delta(before, after, "decode", "step_cpu_seconds"),
        step_hook_cpu_seconds=delta(before, after, "decode", "step_hook_cpu_seconds"),
        decode_tokens=int(delta(before, after, "decode", "tokens")),
        cpu_seconds=served_cpu(before, after),
        hook_seconds=sum(
            float(after[role]["hook_seconds"].get(hook, 0.0))
            - float(before[role]["hook_seconds"].get(hook, 0.0))
            for role in ("prefill", "decode")
            for hook in after[role]["hook_seconds"]
        ),
    )


def delta(before: dict[str, Any], after: dict[str, Any], role: str, name: str) -> float:
    return float(after[role][name]) - float(before[role][name])


def served_cpu(before: dict[str, Any], after: dict[str, Any]) -> float:
    """CPU seconds of router, prefill and decode between two ``/stats`` replies."""
    roles = ("router", "prefill", "decode")
    return sum(delta(before, after, role, "process_cpu_seconds") for role in roles)


def request_hooks(prompt: int, page_size: int, requests: int, scrub: str = "off") -> float:
    """Host CPU of every hook over one request's life in minipd's shapes (2 layers of K and V,
    head_dim 128, fp32, CPU tensors, log mode): prefill ``on_alloc``, ``seal``, ``on_free``;
    decode ``on_alloc``, ``on_reserve``, ``verify_admit``, ``on_free``. Baseline, in the same
    loop: the whole-page copy of the same KV from prefill's pool into decode's (the transfer).
    Returns the hooks' ms per request."""
    import torch

    from engine_hooks import KVWatch, PagedKVPool

    torch.set_num_threads(1)
    num_pages = 4096
    need = -(-prompt // page_size)

    def pool() -> PagedKVPool:
        return PagedKVPool(
            [torch.randn((num_pages * page_size, 1, 128)) for _ in range(4)], page_size
        )

    src_pool, dst_pool = pool(), pool()
    prefill = KVWatch(src_pool, role="prefill", engine="bench", mode="log", scrub=scrub)
    decode = KVWatch(dst_pool, role="decode", engine="bench", mode="log", scrub=scrub)
    prefill.on_free(list(range(num_pages)))
    decode.on_free(list(range(num_pages)))
    total = copy = 0.0
    for i in range(requests + 1):
        base = (i * need) % (num_pages - need - 7)
        src = list(range(base, base + need))
        dst = list(range(base + 7, base + 7 + need))[::-1]
        started = time.thread_time()
        decode.on_alloc(dst, f"r{i}")
        ticket = decode.on_reserve(f"r{i}", dst)
        prefill.on_alloc(src, f"r{i}")
        copy_started = time.thread_time()
        for s, d in zip(src, dst, strict=True):
            for sv, dv in zip(src_pool.page(s), dst_pool.page(d), strict=True):
                dv.copy_(sv)
        copied = time.thread_time() - copy_started
        assert ticket is not None
        dst_pool.mark_written(dst, ticket.tags)
        seal = prefill.seal(f"r{i}", src)
        prefill.on_free(src, f"r{i}")
        assert decode.verify_admit(ticket, seal) == []
        decode.on_free(dst, f"r{i}")
        if i:  # the first request warms up
            total += time.thread_time() - started
            copy += copied
    hooks = total - copy
    if scrub == "off":
        print(
            f"hooks over a {prompt}-token request's life ({need} pages of {page_size} tokens): "
            f"{1e3 * hooks / requests:.2f} ms host CPU per request; the page copy itself "
            f"{1e3 * copy / requests:.2f} ms ({hooks / copy:.2f}x the copy)"
        )
    prefill.close()
    decode.close()
    return 1e3 * hooks / requests


def request_hooks_scrub(prompt: int, page_size: int, requests: int, rounds: int) -> None:
    """:func:`request_hooks` with each scrub, interleaved rounds: the scrub's own host CPU per
    request (best round of each), against the hooks with scrub off."""
    best = {"off": 1e9, "on_free": 1e9, "on_reserve": 1e9}
    for _ in range(rounds):
        for scrub in list(best):
            with contextlib.redirect_stdout(io.StringIO()):
                best[scrub] = min(best[scrub], request_hooks(prompt, page_size, requests, scrub))
    print(
        f"scrub over a {prompt}-token request's life, host CPU per request, best of {rounds} "
        f"interleaved rounds: hooks with scrub off {best['off']:.2f} ms; "
        + "; ".join(
            f"{m} {best[m]:.2f} ms (scrub {best[m] - best['off']:+.2f} ms)"
            for m in ("on_free", "on_reserve")
        )
    )


def step_hooks_at_batch(
    batch: int, context: int, page_size: int, steps: int, rounds: int, *, batched: bool = False
) -> dict[str, float]:
    """The per-step hooks alone at a large batch on CPU tensors, the way minipd's decode step
    calls them: the batch's tag check every step, and a new page (``on_alloc`` + ``extend``)
    for each request whose context crosses a page boundary; ``batched``, the way SGLang's
    does: one ``on_alloc`` for the step's new pages (``alloc_decode``) and one
    ``extend_each``. Host CPU per step per running request in ``log`` and ``enforce``, against
    the baseline of the same loop with no hook called (the engine's own bookkeeping of the
    bench), rounds interleaved. Returns the hooks' us per step per running request by mode
    (best round less the baseline's)."""
    import numpy as np
    import torch

    from engine_hooks import KVWatch, PagedKVPool

    torch.set_num_threads(1)
    per_request = -(-(context + steps) // page_size) + 1
    num_pages = batch * per_request + 1
    results: dict[str, list[float]] = {"none": [], "log": [], "enforce": []}
    for _ in range(rounds):
        for mode, times in results.items():
            pool = PagedKVPool([torch.zeros((num_pages * page_size, 1, 128))], page_size)
            watch = KVWatch(pool, role="decode", engine="bench", mode=mode.replace("none", "off"))
            watch.on_free(list(range(num_pages)))  # at start every page is free, as in minipd
            free = list(np.random.default_rng(0).permutation(np.arange(1, num_pages)).tolist())
            tickets = []
            for r in range(batch):
                pages = [free.pop() for _ in range(-(-context // page_size))]
                watch.on_alloc(pages, f"r{r}")
                ticket = watch.on_reserve(f"r{r}", pages)
                assert ticket is not None
                watch._state.own_writes(ticket.pages)  # type: ignore[union-attr]
                tickets.append(ticket)
            hooks = mode != "none"
            lengths = [context + r % page_size for r in range(batch)]  # boundaries spread out
            # The setup's allocations owe the interpreter a full collection (~0.2 s once torch
            # is loaded): taken here, or it lands in whichever round is timed next.
            gc.collect()
            started = time.thread_time()
            for _ in range(steps):
                if hooks:
                    verdicts = watch.check_batch(tickets)
                    assert not verdicts
                starting, pages = [], []
                for r, ticket in enumerate(tickets):
                    lengths[r] += 1
                    if lengths[r] % page_size == 0:
                        page = [free.pop()]
                        if hooks and not batched:
                            watch.on_alloc(page, ticket.request_id)
                            watch.extend(ticket, page)
                        starting.append(ticket)
                        pages += page
                if hooks and batched and pages:
                    watch.on_alloc(pages)
                    watch.extend_each(starting, pages)
            times.append(1e6 * (time.thread_time() - started) / (steps * batch))
            watch.close()
    base = min(results["none"])

    def spread(values: list[float]) -> str:
        return f"{min(values):.2f} us (rounds {min(values):.2f}-{max(values):.2f})"

    shape = "one on_alloc + extend_each a step" if batched else "on_alloc + extend per page"
    print(
        f"per-step hooks at batch {batch} ({shape}), {context}-token contexts, page {page_size}, "
        f"{steps} steps, CPU tensors, {rounds} interleaved rounds; host CPU per step per "
        f"running request, best of the rounds: the loop without hooks {spread(results['none'])}; "
        + "; ".join(
            f"{m} {spread(v)}, hooks {min(v) - base:.2f} us"
            for m, v in results.items()
            if m != "none"
        )
    )
    return {m: min(v) - base for m, v in results.items() if m != "none"}


def scrub_bandwidth(device: str, pages: int, batch: int, rounds: int, layers: int) -> None:
    """The hooks' scrub (``PageState.scrub``: scattered pages, every buffer; on a GPU one
    Triton launch) against a plain memset: ``zero_()`` of a contiguous run of as many pages in
    every buffer (the bandwidth floor), and ``zero_()`` of the same pages one at a time;
    interleaved rounds, bytes per second, best round of each."""
    import torch

    from engine_hooks import PagedKVPool
    from engine_hooks.pagestate import page_state

    torch.set_num_threads(1)
    dev = torch.device(device)
    page_size, head_dim = 16, 128  # minipd's page, a common head size: 8 KiB per page, fp32
    pool = PagedKVPool(
        [torch.ones((pages * page_size, 1, head_dim), device=dev) for _ in range(2 * layers)],
        page_size,
    )
    state = page_state(pool)
    rng = random.Random(0)
    runs = [rng.sample(range(pages), batch) for _ in range(8)]
    index = [state.index(r) for r in runs]
    starts = [(i * batch) % (pages - batch) for i in range(len(runs))]

    def sync() -> None:
        if dev.type == "cuda":
            torch.cuda.synchronize(dev)

    def scrub(i: int) -> None:
        state.scrub(index[i % len(index)])

    def memset(i: int) -> None:  # as many runs as the scrub has page sets: the same bytes
        at = starts[i % len(starts)]
        for view in pool.page_views:
            view[at : at + batch].zero_()

    def per_page(i: int) -> None:  # the same pages, one zero_() each
        for view in pool.page_views:
            for page in runs[i % len(runs)]:
                view[page].zero_()

    nbytes = batch * pool.page_bytes
    fns = {"scrub": scrub, "memset": memset, "per_page": per_page}
    best = _best_rates(fns, rounds, nbytes, sync)
    how = "host arrays" if dev.type == "cpu" else "torch fills"
    if getattr(state, "kernels", False):
        how = "one Triton launch"
    print(
        f"scrub of {batch} scattered pages ({nbytes / 2**20:.1f} MiB, {2 * layers} buffers, "
        f"{device}, {how}): "
        f"{best['scrub'] / 1e9:.2f} GB/s; memset of as many contiguous pages (zero_()): "
        f"{best['memset'] / 1e9:.2f} GB/s, ratio {best['scrub'] / best['memset']:.2f}x; "
        f"zero_() of the same pages one by one: {best['per_page'] / 1e9:.2f} GB/s, ratio "
        f"{best['scrub'] / best['per_page']:.2f}x (best of {rounds} interleaved rounds)"
    )


def _best_rates(
    fns: dict[str, Callable[[int], None]], rounds: int, nbytes: int, sync: Callable[[], None]
) -> dict[str, float]:
    """Each function's best bytes per second over interleaved rounds of 20 calls each."""
    best = dict.fromkeys(fns, 0.0)
    for _ in range(rounds):
        for name, fn in fns.items():
            fn(0)  # warm (a first launch compiles the kernel)
            sync()
            reps = 20
            started = time.perf_counter()
            for i in range(reps):
                fn(i)
            sync()
            best[name] = max(best[name], reps * nbytes / (time.perf_counter() - started))
    return best


def scrub_throughput(args: argparse.Namespace, items: list[tuple[str, int]]) -> None:
    """minipd with ``--kvwatch log`` and each scrub, interleaved rounds: tokens/s ratios."""
    modes = ("off", "on_free", "on_reserve")
    runs: dict[str, list[Run]] = {m: [] for m in modes}
    for round_no in range(args.scrub_rounds):
        for scrub in modes[round_no % 3 :] + modes[: round_no % 3]:
            run = run_once("log", args, items, scrub)
            runs[scrub].append(run)
            print(
                f"scrub round {round_no + 1} {scrub:<10} {run.tokens_per_s:8.1f} gen tok/s "
                f"cpu {run.cpu_us_per_token:.0f} us/tok",
                flush=True,
            )
    print(f"\nscrub, --kvwatch log, per-round ratio to scrub off, median (range) of "
          f"{args.scrub_rounds} rounds")  # fmt: skip
    print_round_ratios(runs, modes[1:])
    # Wall ratios swing by 10-30% on a shared machine; the scrub's own cost is the extra time
    # inside the hooks (which do the scrub) per generated token, against off's CPU per token.
    base_hooks = statistics.median(r.hook_us_per_token for r in runs["off"])
    base_cpu = statistics.median(r.cpu_us_per_token for r in runs["off"])
    cells = []
    for m in modes[1:]:
        extra = statistics.median(r.hook_us_per_token for r in runs[m]) - base_hooks
        cells.append(f"{m} {extra:+.2f} us ({100 * extra / base_cpu:+.3f}% of off's CPU)")
    print(f"{'time inside hooks per token vs scrub off':<44}" + "   ".join(cells))


SIDE_MODES = ("off", "on_reserve")


def _side_stats(url: str) -> dict[str, Any]:
    # The router asks each role with a 5 s timeout; a busy decode loop can miss it.
    for _ in range(10):
        reply = get(url, "/stats")
        if all("process_cpu_seconds" in reply.get(r, {}) for r in ("prefill", "decode")):
            return reply
        time.sleep(0.2)
    raise SystemExit(f"side by side: no stats from {url}: {reply}")


def side_by_side_round(
    args: argparse.Namespace, items: list[tuple[str, int]], round_no: int
) -> tuple[dict[str, list[float]], dict[str, float], dict[str, float]]:
    """One round of :func:`scrub_side_by_side`: generated tokens per window of each scrub,
    each one's CPU seconds (router, prefill, decode) over the counted windows, and its seconds
    inside the hooks that scrub (decode's ``reserve``, prefill's ``seal`` for the tail)."""
    done = threading.Event()
    failed: list[int] = []

    def client(url: str, first: int) -> None:
        i = first
        while not done.is_set():
            status, _ = generate(url, *items[i % len(items)])
            if status != 200:
                failed.append(status)
            i += args.concurrency

    def read(urls: dict[str, str], w: int) -> dict[str, dict[str, Any]]:
        order = SIDE_MODES[w % 2 :] + SIDE_MODES[: w % 2]  # neither is always read first
        return {m: _side_stats(urls[m]) for m in order}

    counts: dict[str, list[float]] = {m: [] for m in SIDE_MODES}
    with ExitStack() as stack:
        urls: dict[str, str] = {}
        for scrub in SIDE_MODES[round_no % 2 :] + SIDE_MODES[: round_no % 2]:
            proc, urls[scrub] = start_minipd("log", args, scrub)
            stack.callback(stop, proc)
        clients = [
            threading.Thread(target=client, args=(urls[m], k), daemon=True)
            for k in range(args.concurrency)
            for m in SIDE_MODES
        ]
        for thread in clients:
            thread.start()
            stack.callback(thread.join, 120)
        stack.callback(done.set)  # runs first: clients stop, then the joins, then the servers
        time.sleep(args.window_s)  # both at steady load before anything counts
        first = last = read(urls, 0)
        for w in range(args.side_windows):
            time.sleep(args.window_s)
            now = read(urls, w + 1)
            for m in SIDE_MODES:
                counts[m].append(delta(last[m], now[m], "decode", "tokens"))
            last = now
    if failed:
        raise SystemExit(f"side by side: {len(failed)} requests failed")
    cpu = {m: served_cpu(first[m], last[m]) for m in SIDE_MODES}
    scrubbing = {
        m: sum(
            float(last[m][role]["hook_seconds"].get(hook, 0.0))
            - float(first[m][role]["hook_seconds"].get(hook, 0.0))
            for role, hook in (("decode", "reserve"), ("prefill", "seal"))
        )
        for m in SIDE_MODES
    }
    return counts, cpu, scrubbing


def scrub_side_by_side(args: argparse.Namespace, items: list[tuple[str, int]]) -> None:
    """Scrub ``off`` and ``on_reserve`` served at the same time, each by its own minipd under
    the same closed-loop load (``--concurrency`` clients cycling through the workload), their
    generated tokens counted over the same windows. Whatever else the machine runs slows both
    alike, so the ratio resolves a cost that sequential runs' 10-40% swings hide. Each round
    starts both anew (the start order turns), warms up for one window, then counts
    ``--side-windows`` windows of ``--window-s`` seconds."""
    windows: list[float] = []
    rounds: list[float] = []
    cpu_ratios: list[float] = []
    shares: list[float] = []
    for round_no in range(args.side_rounds):
        counts, cpu, scrubbing = side_by_side_round(args, items, round_no)
        ratios = [r / o for r, o in zip(counts["on_reserve"], counts["off"], strict=True)]
        windows += ratios
        made = {m: sum(counts[m]) for m in SIDE_MODES}
        rounds.append(made["on_reserve"] / made["off"])
        cpu_ratios.append((cpu["on_reserve"] / made["on_reserve"]) / (cpu["off"] / made["off"]))
        # The scrub's own time: what the hooks that scrub take per generated token beyond the
        # same hooks with scrub off, as a share of off's CPU per generated token. It is wall time
        # in the hooks: on a quiet machine an upper bound on the scrub's work (a CPU-bound engine
        # loses at most that share of tokens/s); waits for a core inflate either side under load.
        extra = scrubbing["on_reserve"] / made["on_reserve"] - scrubbing["off"] / made["off"]
        shares.append(extra / (cpu["off"] / made["off"]))
        print(
            f"side by side round {round_no + 1}: generated tokens off {made['off']:.0f}, "
            f"on_reserve {made['on_reserve']:.0f} in {args.side_windows} x "
            f"{args.window_s:.0f} s; ratio {rounds[-1]:.4f} (windows "
            f"{min(ratios):.3f}-{max(ratios):.3f}); CPU per generated token ratio "
            f"{cpu_ratios[-1]:.4f}; scrub's own time {100 * shares[-1]:+.3f}% of off's CPU "
            f"per generated token",
            flush=True,
        )
    mean = statistics.fmean(windows)
    half = 1.96 * statistics.stdev(windows) / len(windows) ** 0.5 if len(windows) > 1 else 0.0
    print(
        f"\nscrub on_reserve / off served side by side, generated tokens/s: "
        f"{len(windows)} windows of {args.window_s:.0f} s over {args.side_rounds} rounds, "
        f"mean {mean:.4f} (95% CI {mean - half:.4f}-{mean + half:.4f}), median "
        f"{statistics.median(windows):.4f}; per round {', '.join(f'{r:.4f}' for r in rounds)}; "
        f"CPU per generated token, per round {', '.join(f'{c:.4f}' for c in cpu_ratios)} "
        f"(target: tokens/s >= 0.99x)"
    )
    print(
        f"scrub's own time inside the hooks per generated token, share of off's CPU per "
        f"generated token: median {100 * statistics.median(shares):+.3f}% (rounds "
        f"{100 * min(shares):+.3f}% to {100 * max(shares):+.3f}%): tokens/s of a CPU-bound "
        f"engine >= {1 - max(shares):.4f}x by the largest round"
    )


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(allow_abbrev=False, description=__doc__.splitlines()[0])
    parser.add_argument("--requests", type=int, default=96)
    parser.add_argument("--concurrency", type=int, default=16)
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--seed", type=int, default=1)
    parser.add_argument("--min-words", type=int, default=200)
    parser.add_argument("--max-words", type=int, default=4000)
    parser.add_argument("--pool-tokens", type=int, default=262144)
    parser.add_argument("--context-length", type=int, default=32768)
    parser.add_argument("--page-size", type=int, default=16)
    parser.add_argument("--layers", type=int, default=2)
    parser.add_argument("--batch", type=int, default=256, help="the per-step hooks alone")
    parser.add_argument("--batch-context", type=int, default=2000)
    parser.add_argument("--batch-steps", type=int, default=64)
    parser.add_argument("--batch-rounds", type=int, default=3)
    parser.add_argument("--device", default="cpu", help="where the scrub bandwidth runs")
    parser.add_argument("--scrub-pages", type=int, default=256, help="pages per scrub")
    parser.add_argument(
        "--scrub-rounds", type=int, default=0, help="minipd rounds of the scrub modes (0: none)"
    )
    parser.add_argument(
        "--side-rounds", type=int, default=0,
        help="rounds of scrub off and on_reserve served side by side (0: none)",
    )  # fmt: skip
    parser.add_argument("--side-windows", type=int, default=6, help="counted windows per round")
    parser.add_argument("--window-s", type=float, default=10.0, help="seconds per window")
    return parser


def main() -> int:
    args = _parser().parse_args()
    request_hooks(4000, args.page_size, 20)
    step_hooks_at_batch(
        args.batch, args.batch_context, args.page_size, args.batch_steps, args.batch_rounds
    )
    scrub_bandwidth(args.device, 4096, args.scrub_pages, 5, args.layers)
    request_hooks_scrub(4000, args.page_size, 10, 3)
    items = workload(args.seed, args.requests, args.min_words, args.max_words)
    if args.scrub_rounds:
        scrub_throughput(args, items)
    if args.side_rounds:
        scrub_side_by_side(args, items)
    if args.rounds == 0:
        return 0
    runs: dict[str, list[Run]] = {mode: [] for mode in MODES}
    for round_no in range(args.rounds):
        # The order turns each round, so no mode always runs first (after a cold start) or
        # next to the same neighbour.
        for mode in MODES[round_no % len(MODES) :] + MODES[: round_no % len(MODES)]:
            run = run_once(mode, args, items)
            runs[mode].append(run)
            print(
                f"round {round_no + 1} {mode:<7} {run.tokens_per_s:8.1f} gen tok/s "
                f"{run.all_tokens_per_s:8.0f} tok/s  step {run.step_ms:.2f} ms "
                f"(cpu {run.step_cpu_ms:.2f}) x{run.steps}  decode {run.decode_us_per_token:.0f} "
                f"us/tok  cpu {run.cpu_us_per_token:.0f} us/tok  "
                f"hooks {100 * run.hook_share:.2f}% of step cpu "
                f"{run.host_us_per_running_request:.2f} us/step/request",
                flush=True,
            )

    def median(mode: str, attr: str) -> float:
        return float(statistics.median(getattr(r, attr) for r in runs[mode]))

    print(
        f"\nworkload: {args.requests} requests, {args.min_words}-{args.max_words} words, "
        f"concurrency {args.concurrency}, seed {args.seed}, {args.layers} layers, "
        f"page {args.page_size}; medians of {args.rounds} rounds"
    )
    rows = [
        ("end-to-end generated tokens/s (wall)", "tokens_per_s"),
        ("end-to-end prompt+generated tokens/s (wall)", "all_tokens_per_s"),
        ("CPU us per generated token, 3 processes", "cpu_us_per_token"),
        ("decode step ms (wall, mean)", "step_ms"),
        ("decode step ms (CPU, mean)", "step_cpu_ms"),
        ("decode us per generated token (wall)", "decode_us_per_token"),
    ]
    print(f"{'median':<44}" + "".join(f"{m:>10}{m + '/off':>12}" for m in MODES[1:]) + "  off")
    for label, attr in rows:
        base = median("off", attr)
        cells = "".join(f"{median(m, attr):10.2f}{median(m, attr) / base:12.3f}" for m in MODES[1:])
        print(f"{label:<44}{cells}  {base:.2f}")
    shares = "".join(f"{100 * median(m, 'hook_share'):9.2f}%{'':12}" for m in MODES[1:])
    print(f"{'tags+canaries share of decode step CPU':<44}{shares}")
    off_cpu = median("off", "cpu_us_per_token")
    direct = "".join(
        f"{100 * median(m, 'hook_us_per_token') / off_cpu:9.2f}%{'':12}" for m in MODES[1:]
    )
    print(f"{'all hooks (wall inside), share of off CPU':<44}{direct}  (upper bound)")
    per_request = "".join(
        f"{median(m, 'host_us_per_running_request'):10.2f}{'':12}" for m in MODES[1:]
    )
    print(f"{'per-step hooks, host us per running request':<44}{per_request}")
    # Ratios paired within a round (the same minutes of a shared machine), then the median.
    print(f"\nper-round ratio to off, median (range) of {args.rounds} rounds")
    print_round_ratios(runs, MODES[1:])
    return 0


def print_round_ratios(runs: dict[str, list[Run]], modes: tuple[str, ...]) -> None:
    """Each mode's ratio to ``off`` paired within a round, median (range) over the rounds."""
    for label, attr in (("generated tokens/s (wall)", "tokens_per_s"),
                        ("CPU us per generated token", "cpu_us_per_token")):  # fmt: skip
        cells = []
        for m in modes:
            pairs = zip(runs[m], runs["off"], strict=True)
            ratios = [getattr(r, attr) / getattr(o, attr) for r, o in pairs]
            cells.append(
                f"{m} {statistics.median(ratios):.3f} ({min(ratios):.3f}-{max(ratios):.3f})"
            )
        print(f"{label:<44}" + "   ".join(cells))


if __name__ == "__main__":
    raise SystemExit(main())
