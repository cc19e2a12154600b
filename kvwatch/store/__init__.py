"""The store: the one ``Incident`` shape (``incident``), the journal that holds all the SQL
(``journal``), the in-memory state (``state``) and the incidents log (``incidents_log``)."""
