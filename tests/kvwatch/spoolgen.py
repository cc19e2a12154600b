"""Write spool segments the way engine_hooks' SpoolWriter does, with kvspool alone (no torch)."""

from __future__ import annotations

import os
import time
from pathlib import Path
from typing import Any

from kvspool import encode_frame, encode_payload
from kvwatch.store.journal import Journal

#: Recent, so that every record falls inside the daemon's clock window.
T0 = float(int(time.time()) - 3600)


class Producer:
    """Records of one producer, with sequence numbers from 1, written to named segments."""

    def __init__(
        self,
        directory: Path,
        name: str = "sglang-decode-r0-100-aaaa0001",
        *,
        role: str = "decode",
        engine: str = "sglang",
        model: str = "glm-5.3",
        version: str = "0.5.23",
        rank: int = 0,
        node: str = "node-a",
        t0: float = T0,
    ) -> None:
        self.t0 = t0
        self.directory = directory
        self.name = name
        self.seq = 0
        self.index = 0
        self.identity = {
            "engine": engine,
            "engine_version": version,
            "role": role,
            "model": model,
            "rank": rank,
            "pid": 100,
            "node": node,
        }

    @property
    def path(self) -> Path:
        return self.directory / f"{self.name}.{self.index:06d}.kvs"

    def record(self, kind: str, fields: dict[str, Any], *, skip: int = 0) -> dict[str, Any]:
        self.seq += 1 + skip
        out = {"v": 1, "type": kind, "producer": self.name}
        out.update(fields)
        out["seq"] = self.seq
        out["ts"] = self.t0 + self.seq
        return out

    def frame(self, kind: str, fields: dict[str, Any], *, skip: int = 0) -> bytes:
        return encode_frame(encode_payload(self.record(kind, fields, skip=skip)))

    def hello(self) -> bytes:
        return self.frame("hello", dict(self.identity))

    def event(
        self,
        request_id: str,
        detector: str = "canary",
        kind: str = "unwritten_page",
        pages: list[int] | None = None,
        instance: str | None = None,
        sources: list[dict[str, Any]] | None = None,
        other_sources: int = 0,
        other_source_pages: int = 0,
        stopped: bool = False,
        detail: dict[str, int | str] | None = None,
    ) -> bytes:
        """``stopped``: an enforce-mode finding whose request was failed before it read;
        ``detail``: more of the event's detail (a reader's peer)."""
        pages = [1, 2, 3, 4, 5, 6, 7] if pages is None else pages
        fields = {
            "detector": detector,
            "kind": kind,
            "mode": "enforce" if stopped else "log",
            "action": "enforced" if stopped else "logged",
            "request_id": request_id,
            "pages": pages,
            "pages_total": len(pages),
            "detail": {"unwritten": len(pages)}
            | ({"stopped_before_read": 1} if stopped else {})
            | (detail or {}),
        }
        if instance is not None:
            fields["instance"] = instance
        if sources or other_sources:
            fields["sources"] = sources or []
            fields["other_sources"] = other_sources
            fields["other_source_pages"] = other_source_pages
        return self.frame("event", fields)

    def counters(self, verifications: int, *, mismatches: int = 0) -> bytes:
        series: list[list[Any]] = [
            ["verifications", {"detector": "canary"}, verifications],
            ["verifications", {"detector": "checksum"}, verifications],
            ["verifications_skipped", {"detector": "page_tag", "reason": "mode_off"}, 2],
            ["hook_seconds", {"hook": "verify"}, 0.25],
            ["aborted_admissions", {"queue": "decode_prealloc"}, 1],
        ]
        if mismatches:
            series.append(
                ["mismatches", {"detector": "canary", "kind": "unwritten_page"}, mismatches]
            )
        return self.frame("counters", {"counters": series})

    def gauges(self, pool: int, context: int, page: int = 64) -> bytes:
        return self.frame(
            "gauges",
            {
                "gauges": [
                    ["kv_pool_tokens", {}, pool],
                    ["context_length_tokens", {}, context],
                    ["page_size_tokens", {}, page],
                ]
            },
        )

    def seal(self) -> bytes:
        return self.frame("seal", {"next_segment": f"{self.name}.{self.index + 1:06d}.kvs"})

    def append(self, *frames: bytes) -> None:
        fd = os.open(self.path, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o640)
        try:
            for frame in frames:
                os.write(fd, frame)
        finally:
            os.close(fd)


def seqs(journal: Journal, producer: str) -> list[int]:
    """The sequence numbers the journal holds for ``producer``, in commit order."""
    rows = journal.db.execute(
        "SELECT r.seq FROM records r JOIN producers p ON p.id = r.producer WHERE p.name = ?"
        " ORDER BY r.rowid",
        (producer,),
    )
    return [row[0] for row in rows]
