"""``kvwatch incidents``: the affected requests, from the journal, for the disclosure team."""

from __future__ import annotations

import json
import time
from datetime import UTC, datetime
from typing import Any, TextIO

from kvwatch.journal import Journal

_COLUMNS = (
    "TIME (UTC)",
    "NODE",
    "ROLE",
    "ENGINE",
    "REQUEST",
    "INSTANCE",
    "DETECTOR",
    "KIND",
    "PAGES",
)
_SHOWN_PAGES = 8


def _pages(row: dict[str, Any]) -> str:
    pages = [str(p) for p in row["pages"][:_SHOWN_PAGES]]
    text = ",".join(pages)
    if row["pages_total"] > len(pages):
        text += f",... ({row['pages_total']} pages)"
    return text or "-"


def query(
    journal: Journal, *, since_seconds: float | None, detector: str | None
) -> list[dict[str, Any]]:
    since = None if since_seconds is None else time.time() - since_seconds
    return journal.incidents(since=since, detector=detector)


def render(rows: list[dict[str, Any]], out: TextIO, *, as_json: bool) -> None:
    if as_json:
        stamped = [{**row, "time_iso": _iso(row["time"])} for row in rows]
        out.write(json.dumps(stamped, sort_keys=True, indent=2) + "\n")
        return
    table = [_COLUMNS]
    for row in rows:
        table.append(
            (
                _iso(row["time"]),
                row["node"] or "-",
                row["role"] or "-",
                row["engine"] or "-",
                row["request_id"] or "-",
                row["instance"] or "-",
                row["detector"],
                row["kind"],
                _pages(row),
            )
        )
    widths = [max(len(r[i]) for r in table) for i in range(len(_COLUMNS) - 1)]
    for r in table:
        cells = [c.ljust(w) for c, w in zip(r[:-1], widths, strict=True)]
        out.write("  ".join([*cells, r[-1]]).rstrip() + "\n")
    out.write(f"{len(rows)} incident(s)\n")


def _iso(ts: float) -> str:
    return datetime.fromtimestamp(ts, UTC).strftime("%Y-%m-%dT%H:%M:%S.%fZ")
