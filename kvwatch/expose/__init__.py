"""Outputs people and Prometheus read: ``/metrics`` (``metrics``), the health model (``status``),
the status page (``page``) and the HTTP surface (``http``)."""
