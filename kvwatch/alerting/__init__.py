"""The alert rules (``rules``: one definition for Prometheus, Grafana and the daemon) and the
daemon's fast path to Alertmanager: the counter alerts evaluated on the samples /metrics serves
(``evaluate``), posted by one send loop per Alertmanager (``notify``)."""
