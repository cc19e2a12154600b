"""``kvwatch check-logs``: the incident's pool-versus-context check, as a deploy gate.

Reads each node's engine log (or pasted start-up lines, one node per line, each starting with its
role and a colon), and prints per node and role: the KV pool, the context length, the unsafe band
(prompt lengths that pass the context check but do not fit the pool: context - pool) and its share
of the window. Exit status: 0 when no node has a band, 1 when any has, 2 when a file has no
start-up line to check (or cannot be read). Within one file the last start-up of each role and
rank wins (a restart replaces the values before it); over tensor-parallel ranks the smallest pool
counts.
"""

from __future__ import annotations

import argparse
import json
import sys
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any, TextIO

from kvspool.catalogue import unsafe_band
from kvwatch.commands.clihelp import add_command
from kvwatch.commands.common import ROLES
from kvwatch.ingest.logs.parse import LogParser

EXIT_OK = 0
EXIT_BAND = 1
EXIT_UNCHECKED = 2


@dataclass(frozen=True, slots=True)
class Row:
    node: str
    role: str
    engine: str
    ranks: int
    pool_tokens: int | None
    context_length_tokens: int | None
    band_tokens: int | None
    band_share: float | None  # of the context window
    error: str | None = None


def _role_from_name(path: str) -> str | None:
    name = Path(path).name.lower()
    for role in ("prefill", "decode"):
        if role in name:
            return role
    return None


def check_text(node: str, lines: list[str], role: str | None = None) -> list[Row]:
    parser = LogParser(role if role is not None else _role_from_name(node))
    for line in lines:
        parser.feed(line)
    by_role: dict[str, list[Row]] = {}
    for view in parser.views.values():
        if view.pool_tokens is None or view.context_length_tokens is None:
            continue
        band = unsafe_band(view.context_length_tokens, view.pool_tokens)
        share = band / view.context_length_tokens if view.context_length_tokens else 0.0
        row = Row(
            node,
            view.role or "unknown",
            view.engine,
            1,
            view.pool_tokens,
            view.context_length_tokens,
            band,
            share,
        )
        by_role.setdefault(row.role, []).append(row)
    rows: list[Row] = []
    for role_name, ranks in sorted(by_role.items()):
        worst = max(ranks, key=lambda r: (r.band_tokens or 0, -(r.pool_tokens or 0)))
        rows.append(
            Row(
                node,
                role_name,
                worst.engine,
                len(ranks),
                min(r.pool_tokens or 0 for r in ranks),
                max(r.context_length_tokens or 0 for r in ranks),
                worst.band_tokens,
                worst.band_share,
            )
        )
    if not rows:
        found = "no start-up line with both the KV pool and the context length"
        rows.append(Row(node, role or "unknown", "other", 0, None, None, None, None, found))
    return rows


def check_files(paths: list[str], role: str | None = None) -> list[Row]:
    rows: list[Row] = []
    for path in paths:
        try:
            if path == "-":
                text = sys.stdin.read()
            else:
                text = Path(path).read_text(encoding="utf-8", errors="replace")
        except OSError as exc:
            rows.append(Row(path, "unknown", "other", 0, None, None, None, None, exc.strerror))
            continue
        rows.extend(check_text("<stdin>" if path == "-" else path, text.splitlines(), role))
    return rows


def exit_status(rows: list[Row]) -> int:
    if any(r.band_tokens for r in rows):
        return EXIT_BAND
    if any(r.error for r in rows):
        return EXIT_UNCHECKED
    return EXIT_OK


def _n(value: int | None) -> str:
    return "-" if value is None else f"{value:,}"


def render(rows: list[Row], out: TextIO, *, as_json: bool) -> None:
    if as_json:
        payload = {"ok": exit_status(rows) == EXIT_OK, "nodes": [asdict(r) for r in rows]}
        out.write(json.dumps(payload, indent=2) + "\n")
        return
    table = [("NODE", "ROLE", "ENGINE", "POOL", "CONTEXT", "UNSAFE BAND", "SHARE", "VERDICT")]
    for r in rows:
        if r.error:
            verdict = f"UNCHECKED: {r.error}"
        elif r.band_tokens:
            assert r.pool_tokens is not None and r.context_length_tokens is not None
            verdict = (
                f"UNSAFE: prompts of {r.pool_tokens + 1:,}..{r.context_length_tokens:,} tokens"
                " pass the context check but do not fit the pool"
            )
        else:
            verdict = "ok"
        share = "-" if r.band_share is None else f"{r.band_share:.1%}"
        table.append(
            (
                r.node,
                r.role,
                r.engine,
                _n(r.pool_tokens),
                _n(r.context_length_tokens),
                _n(r.band_tokens),
                share,
                verdict,
            )
        )
    widths = [max(len(row[i]) for row in table) for i in range(7)]
    for row in table:
        cells = [
            c.ljust(w) if i < 3 else c.rjust(w)
            for i, (c, w) in enumerate(zip(row[:7], widths, strict=True))
        ]
        out.write("  ".join([*cells, row[7]]) + "\n")


def smallest_band_from_files(paths: list[str]) -> tuple[int, int]:
    """(pool, context) to aim a probe with: the smallest pool and the smallest context over every
    node the logs describe. A prompt longer than that pool and no longer than that context passes
    every node's context check and fits no pool's smallest node. ValueError when no log says.
    """
    rows = [r for r in check_files(paths) if r.pool_tokens is not None and r.context_length_tokens]
    if not rows:
        raise ValueError("no start-up line with both the KV pool and the context length")
    pools = [r.pool_tokens for r in rows if r.pool_tokens is not None]
    contexts = [r.context_length_tokens for r in rows if r.context_length_tokens is not None]
    return min(pools), min(contexts)


# -- the command ------------------------------------------------------------------------------


def run(args: argparse.Namespace) -> int:
    rows = check_files(args.files, role=args.role)
    render(rows, sys.stdout, as_json=args.json)
    return exit_status(rows)


def add_parser(commands: Any) -> argparse.ArgumentParser:
    check = add_command(
        commands,
        "check-logs",
        help="gate a deploy on KV pool >= context length on every node (exit 1 if not)",
        description="Read engine start-up logs and print, per node and role, the KV pool, the "
        "context length and the unsafe band between them. Exit 0: no band; 1: a band; 2: a "
        "file without a start-up line, or unreadable.",
        examples=[
            "kvwatch check-logs /var/log/sglang/prefill.log /var/log/sglang/decode.log",
            "kubectl logs deploy/decode | kvwatch check-logs --role decode -",
        ],
    )
    check.add_argument("files", nargs="+", metavar="FILE", help="engine logs ('-' for stdin)")
    check.add_argument(
        "--role",
        choices=sorted(ROLES),
        help="role for lines without a 'prefill:'/'decode:' prefix (default: from the file name)",
    )
    check.add_argument("--json", action="store_true", help="a JSON array, for machines")

    return check
