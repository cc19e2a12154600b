"""Outputs people and Prometheus read: ``/metrics`` (``metrics``), the status page and its
server (``status``)."""
