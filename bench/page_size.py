"""kvwatch's hooks at page size 1 (SGLang's default: a page is one token slot) against page size
16, in one run, alternating rounds, as ratios (issue 24).

Run: ``python bench/page_size.py [--rounds R] [--prompt T] [--batch B] [--context C]``.

Each round runs, for page size 1 and for page size 16 (the order turned every round), the two
host-CPU measures of ``bench/overhead.py`` in the shapes given: every hook over one request's
life (prefill ``on_alloc``, ``seal``, ``on_free``; decode ``on_alloc``, ``on_reserve``,
``verify_admit``, ``on_free``; ms per request, the page copy of the same KV not counted), and
the per-step hooks of a running batch as SGLang's decode step calls them (the batch's tag
check, one ``on_alloc`` for the pages the step started and one ``extend_each``: at page size
1, every request every step; us per step per running request, the loop without hooks not
counted). At page size 1 the per-step hooks also run a call per started page (``on_alloc`` +
``extend`` for each request, as before ``extend_each``), in the same rounds. Prints the median
of each over the rounds and the ratios to page 16 per round (median and range).
"""

from __future__ import annotations

import argparse
import statistics
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import overhead

SIZES = (1, 16)


def main() -> None:
    parser = argparse.ArgumentParser(allow_abbrev=False, description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--prompt", type=int, default=2000)
    parser.add_argument("--requests", type=int, default=4)
    parser.add_argument("--batch", type=int, default=32)
    parser.add_argument("--context", type=int, default=2000)
    parser.add_argument("--steps", type=int, default=32)
    args = parser.parse_args()
    life: dict[int, list[float]] = {p: [] for p in SIZES}
    step: dict[int, list[float]] = {p: [] for p in SIZES}
    per_page: list[float] = []  # page size 1, a call per started page
    for round_ in range(args.rounds):
        for page_size in SIZES if round_ % 2 == 0 else SIZES[::-1]:
            life[page_size].append(overhead.request_hooks(args.prompt, page_size, args.requests))
            shape = (args.batch, args.context, page_size, args.steps, 1)
            step[page_size].append(overhead.step_hooks_at_batch(*shape, batched=True)["log"])
            if page_size == 1:
                per_page.append(overhead.step_hooks_at_batch(*shape)["log"])

    def summary(name: str, unit: str, one: list[float], sixteen: list[float]) -> None:
        ratios = [a / b for a, b in zip(one, sixteen, strict=True)]
        print(
            f"{name}: page 1 {statistics.median(one):.2f} {unit}, page 16 "
            f"{statistics.median(sixteen):.2f} {unit}; ratio page 1 / page 16 "
            f"{statistics.median(ratios):.1f} (rounds {min(ratios):.1f}-{max(ratios):.1f})"
        )

    print(f"\n{args.rounds} alternating rounds, log mode, CPU tensors:")
    summary(f"hooks over a {args.prompt}-token request's life", "ms", life[1], life[16])
    where = f"batch {args.batch}, {args.context}-token contexts, per running request"
    summary(f"per-step hooks, one extend_each a step, {where}", "us", step[1], step[16])
    summary(f"per-step hooks, a call per started page, {where}", "us", per_page, step[16])


if __name__ == "__main__":
    main()
