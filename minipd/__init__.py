"""minipd: a small, faithful prefill/decode (PD) disaggregated engine with kvwatch inside.

``python -m minipd serve`` starts a router, a prefill worker and a decode worker as three OS
processes; ``python -m minipd demo`` replays the incident's incident against it. See README.md.
"""

__version__ = "0.1.0"
