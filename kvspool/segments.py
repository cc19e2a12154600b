"""Whole-segment reading, for tools and tests (the daemon tails segments incrementally)."""

from __future__ import annotations

import os
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import msgspec

from kvspool.framing import SEGMENT_SUFFIX, iter_frames
from kvspool.schema import SchemaError, decode_payload


@dataclass
class SpoolContents:
    records: list[dict[str, Any]] = field(default_factory=list)
    #: Damaged or unreadable frames by reason ("crc", "framing", "oversize", "torn", "schema", ...).
    errors: Counter[str] = field(default_factory=Counter)

    def events(self, **match: Any) -> list[dict[str, Any]]:
        return [
            r
            for r in self.records
            if r["type"] == "event" and all(r.get(k) == v for k, v in match.items())
        ]

    def ranks(self) -> dict[str, int]:
        """Each producer's TP rank, from its hello."""
        return {r["producer"]: int(r["rank"]) for r in self.records if r["type"] == "hello"}

    def latest_counters(
        self, rank: int | None = None
    ) -> dict[str, dict[tuple[tuple[str, str], ...], float]]:
        """Each producer's last snapshot, summed over producers (those of TP ``rank`` when
        given): {name: {labels: value}}."""
        ranks = self.ranks() if rank is not None else {}
        last: dict[str, dict[str, Any]] = {}
        for record in self.records:
            if record["type"] == "counters" and (
                rank is None or ranks.get(record["producer"]) == rank
            ):
                last[record["producer"]] = record
        out: dict[str, dict[tuple[tuple[str, str], ...], float]] = {}
        for record in last.values():
            for name, labels, value in record["counters"]:
                key = tuple(sorted(labels.items()))
                series = out.setdefault(name, {})
                series[key] = series.get(key, 0) + value
        return out


def read_segment(
    path: str | os.PathLike[str], contents: SpoolContents | None = None
) -> SpoolContents:
    """Decode every frame of one segment file, as plain dicts; an incomplete frame counts as
    ``torn``, and every intact frame after damage is read."""
    contents = contents if contents is not None else SpoolContents()
    data = Path(path).read_bytes()
    for frame in iter_frames(data, final=True):
        if frame.payload is None:
            contents.errors[frame.error or "framing"] += 1
            continue
        try:
            contents.records.append(msgspec.to_builtins(decode_payload(frame.payload)))
        except SchemaError as exc:
            contents.errors[exc.reason] += 1
    return contents


def read_spool(directory: str | os.PathLike[str]) -> SpoolContents:
    """Decode every segment in a spool directory, in name order."""
    contents = SpoolContents()
    for path in sorted(Path(directory).glob(f"*{SEGMENT_SUFFIX}")):
        read_segment(path, contents)
    return contents
