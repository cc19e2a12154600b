"""The alert rules (``rules``: one definition for Prometheus, Grafana and the daemon) and the
daemon's fast path to Alertmanager (``pager``)."""
