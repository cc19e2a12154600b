"""The spool: every producer's segments tailed into the journal (``reader``), who may write them
(``owner``)."""
