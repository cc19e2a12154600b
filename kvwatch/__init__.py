"""kvwatch: the daemon and CLI that turn engine_hooks' spool into metrics, a journal and pages.

Never imports torch: the daemon installs and runs without it.
"""

__version__ = "0.1.0"
