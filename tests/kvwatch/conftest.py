from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest

from kvwatch.ingest.spool.reader import SpoolReader
from kvwatch.store.journal import Journal
from kvwatch.store.state import State


@pytest.fixture
def spool(tmp_path: Path) -> Path:
    directory = tmp_path / "spool"
    directory.mkdir()
    return directory


@pytest.fixture
def journal(tmp_path: Path) -> Iterator[Journal]:
    j = Journal(tmp_path / "journal.db")
    yield j
    j.close()


@pytest.fixture
def state(journal: Journal) -> State:
    return journal.load()


@pytest.fixture
def reader(spool: Path, journal: Journal, state: State) -> SpoolReader:
    # The daemon's node (its setting): spoolgen's producers say the same in their hello.
    return SpoolReader(
        spool, journal, state, idle_grace=3600.0, quarantine_dir=spool / "q", node="node-a"
    )
