"""kvwatch's Grafana dashboards as code (grafana-foundation-sdk).

``python -m dashboards.generate`` writes the committed JSON (``dashboards/*.json``) that Grafana
imports or provisions as-is; a test regenerates it and fails on any difference.
"""
