"""kvwatch's hooks at page size 1 (SGLang's default: a page is one token slot) against page size
16, in one run, alternating rounds, as ratios (issue 24).

Run: ``python bench/page_size.py [--rounds R] [--prompt T] [--batch B] [--context C]``.

Each round runs, for page size 1 and for page size 16 (the order turned every round), the two
host-CPU measures of ``bench/overhead.py`` in the shapes given: every hook over one request's
life (prefill ``on_alloc``, ``seal``, ``on_free``; decode ``on_alloc``, ``on_reserve``,
``verify_admit``, ``on_free``; ms per request, the page copy of the same KV not counted), and
the per-step hooks of a running batch (the batch's tag check, and ``on_alloc`` + ``extend`` for
each request whose context starts a page: at page size 1, every request every step; us per step
per running request, the loop without hooks not counted). Prints the median of each over the
rounds and the ratio page 1 / page 16 per round (median and range).
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
    for round_ in range(args.rounds):
        for page_size in SIZES if round_ % 2 == 0 else SIZES[::-1]:
            life[page_size].append(overhead.request_hooks(args.prompt, page_size, args.requests))
            per_step = overhead.step_hooks_at_batch(
                args.batch, args.context, page_size, args.steps, 1
            )
            step[page_size].append(per_step["log"])

    def summary(name: str, unit: str, values: dict[int, list[float]]) -> None:
        ratios = [a / b for a, b in zip(values[1], values[16], strict=True)]
        print(
            f"{name}: page 1 {statistics.median(values[1]):.2f} {unit}, page 16 "
            f"{statistics.median(values[16]):.2f} {unit}; ratio page 1 / page 16 "
            f"{statistics.median(ratios):.1f} (rounds {min(ratios):.1f}-{max(ratios):.1f})"
        )

    print(f"\n{args.rounds} alternating rounds, log mode, CPU tensors:")
    summary(f"hooks over a {args.prompt}-token request's life", "ms", life)
    summary(
        f"per-step hooks, batch {args.batch}, {args.context}-token contexts, per running request",
        "us",
        step,
    )


if __name__ == "__main__":
    main()
