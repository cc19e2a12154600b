"""The walkthrough says what its spool says: its narration of what a read would expose comes
from the verdicts' sources, and its late write into a freed page names the writer, not the
page's next owner (which overwrites the page before reading it)."""

from __future__ import annotations

from pathlib import Path

import pytest

from engine_hooks import walkthrough
from engine_hooks.detectors import Verdict
from engine_hooks.testing import read_spool
from kvspool.records import Source
from kvwatch.commands.incidents import exposure
from kvwatch.store.incident import group
from tests.minipd.test_disclosure import view_rows


def test_narration_matches_the_spool(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert walkthrough.main(["--spool", str(tmp_path)]) == 0
    out = capsys.readouterr().out
    events = read_spool(tmp_path).events()
    rejected = [e for e in events if e["request_id"] == "rejected-1" and e.get("sources")]
    assert rejected == []  # its 7 unwritten pages were never written: nobody's KV
    assert "users A and B" not in out
    assert "hold no other request's keys and values" in out
    (late,) = [e for e in events if e["kind"] == "write_to_free_page"]
    assert late["request_id"] == "aborted-2" and late["detail"]["next_owner"] == "next-owner"
    assert not any(e["request_id"] == "next-owner" for e in events)
    view = exposure(group(view_rows(events)), since=None, until=None)
    assert view["readers"] == []  # the walkthrough exposes nobody: --exposed lists nobody


def test_narration_names_the_sources_it_was_given() -> None:
    v = Verdict(
        "page_tag", "r", False, "stale_tag", (1, 2), sources=(Source(request_id="a", pages=2),)
    )
    assert walkthrough.exposure_line([v], 2).endswith("the keys and values of a (2 page(s))")
    assert "nothing to disclose" in walkthrough.exposure_line([], 7)
