"""kvwatch inside vLLM: :class:`KVWatchConnector`, a v1 KV connector that seals each prefill's
KV blocks and verifies them on decode before they are read, with vLLM's real block pool and KV
tensors. Load it with ``kv_connector_module_path="engine_hooks.vllm"`` (see README.md here).

This package imports vLLM; the rest of ``engine_hooks`` does not.
"""

from engine_hooks.vllm.connector import KVWatchConnector

__all__ = ["KVWatchConnector"]
