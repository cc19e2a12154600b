"""Helpers for testing code that uses engine_hooks: read back what the hooks spooled.

contents = read_spool(spool_dir)
assert contents.events(detector="canary", request_id="r1")
"""

from kvspool.segments import SpoolContents, read_segment, read_spool

__all__ = ["SpoolContents", "read_segment", "read_spool"]
