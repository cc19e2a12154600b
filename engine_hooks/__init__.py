"""engine_hooks: kvwatch's detectors, run inside a paged-KV prefill/decode engine.

Public API:

- :func:`adler32`, :func:`adler32_combine`: zlib-exact Adler-32 over bytes and tensors.
- :class:`PagedKVPool`: an engine's KV pool as per-layer tensors grouped into pages.
- :class:`KVWatch`: the detectors wired to the engine's hook points; :class:`Mode`,
  :class:`Verdict`, :class:`Seal`, :class:`Ticket`, :class:`PoolReport`; :class:`Scrub`, when
  pages are zeroed; :func:`page_digests_digest`, a page seal composed of its parts' digests.
- :class:`SpoolWriter`: the never-blocking, never-raising record writer.
- :mod:`engine_hooks.labels`: the catalogue's labels as enums (``Detector``, ``Skip``, ``Hook``,
  ``Kind``), which the adapters name; :class:`engine_hooks.guard.Guard`, the one never-raise
  guard of every hook.

This package never imports the daemon (``kvwatch``); the wire format lives in ``kvspool``.
"""

from engine_hooks.checksum import adler32, adler32_combine, adler32_torch
from engine_hooks.detectors import Mode, PoolReport, Seal, Verdict, page_digests_digest
from engine_hooks.pool import Layout, PagedKVPool
from engine_hooks.spool import DEFAULT_SPOOL_DIR, SpoolWriter
from engine_hooks.watch import KVWatch, Scrub, Ticket

__all__ = [
    "DEFAULT_SPOOL_DIR",
    "KVWatch",
    "Layout",
    "Mode",
    "PagedKVPool",
    "PoolReport",
    "Scrub",
    "Seal",
    "SpoolWriter",
    "Ticket",
    "Verdict",
    "adler32",
    "adler32_combine",
    "adler32_torch",
    "page_digests_digest",
]
