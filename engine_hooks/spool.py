"""The spool writer lives in kvspool (torch-free); the engine adapters import it from here."""

from kvspool.writer import DEFAULT_SPOOL_DIR, SpoolWriter

__all__ = ["DEFAULT_SPOOL_DIR", "SpoolWriter"]
