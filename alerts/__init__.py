"""kvwatch's alerts: one source for Prometheus rules and Grafana alert rules,
``kvwatch.alerting.rules`` (re-exported here as ``definitions``).

``python -m alerts.generate`` writes ``alerts/kvwatch.rules.yml`` (Prometheus) and
``alerts/grafana/kvwatch-alert-rules.json`` (Grafana-managed alert provisioning).
"""
