"""The alert rules (``rules``: one definition for Prometheus, Grafana and the daemon) and the
daemon's fast path to Alertmanager: the counter alerts evaluated on the samples /metrics serves
(``evaluate``, their annotations rendered by ``templates``), posted by one send loop per
Alertmanager (``notify``)."""
