"""Sources: what the daemon reads. The spool (``spool/``: the directory, frames, records into
the journal), the engines' logs (``logs/``: parse, watch) and NVML (read at scrape time)."""
