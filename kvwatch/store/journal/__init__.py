"""The incident journal: SQLite in WAL mode, the daemon's durable memory (see ``connection``).

The only place with SQL, in three modules by job: ``tables`` (the rows, the columns derived
from the one Finding type, the schema and its migrations), ``writes`` (the batch one
transaction writes and the hot path's multi-row INSERTs) ``queries`` (findings with
their sources, acknowledgements, gaps, ``meta``) and ``connection`` (the :class:`Journal`:
opening, migrating, loading the state, commit and prune).
"""

from kvwatch.store.journal.connection import (
    MAX_RETIRED_PRODUCERS,
    RETIRED_GRACE,
    Journal,
    JournalError,
    acknowledge,
)
from kvwatch.store.journal.tables import (
    FINDING_COLUMNS,
    SCHEMA_VERSION,
    AckRow,
    ExposureRow,
    RejectRow,
)
from kvwatch.store.journal.writes import ROWS_PER_INSERT, Batch, Stored

__all__ = [
    "FINDING_COLUMNS",
    "MAX_RETIRED_PRODUCERS",
    "RETIRED_GRACE",
    "ROWS_PER_INSERT",
    "SCHEMA_VERSION",
    "AckRow",
    "Batch",
    "ExposureRow",
    "Journal",
    "JournalError",
    "RejectRow",
    "Stored",
    "acknowledge",
]
