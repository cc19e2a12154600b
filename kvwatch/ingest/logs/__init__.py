"""The engines' own logs: what a log line says (``parse``) and the files tailed (``watch``)."""
