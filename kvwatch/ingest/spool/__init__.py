"""The spool: every producer's segments tailed into the journal (``reader``, the poll loop, on
``frames``, ``poison``, ``apply``, ``directory`` and ``sink``: one job each), who may write
them (``owner``)."""
