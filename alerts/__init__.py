"""kvwatch's alerts: one source (``definitions``) for Prometheus rules and Grafana alert rules.

``python -m alerts.generate`` writes ``alerts/kvwatch.rules.yml`` (Prometheus) and
``alerts/grafana/kvwatch-alert-rules.json`` (Grafana-managed alert provisioning).
"""
