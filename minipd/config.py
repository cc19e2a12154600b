"""Everything a minipd process needs to know, passed to each role at spawn."""

from __future__ import annotations

import math
from dataclasses import dataclass, field

from minipd.releases import Release, release
from minipd.tokenizer import DIGITS, PIECE_BYTES


def head_dim_for(context_length_tokens: int) -> int:
    """The model's head size: twice the number of binary rotary frequencies that keep every
    position of the context apart (and room for a token's digits in the value)."""
    frequencies = max(8, int(context_length_tokens).bit_length())
    return 2 * max(frequencies, math.ceil(DIGITS / 2))


@dataclass(frozen=True, slots=True)
class Faults:
    """Injected faults. Each names the 1-based transfer (prefill) or completion (decode) it
    hits; 0 means never."""

    late_write: int = 0
    late_write_delay: float = 1.0
    drop_page: int = 0
    bit_flip: int = 0
    double_free: int = 0


@dataclass(frozen=True, slots=True)
class ServeConfig:
    host: str = "127.0.0.1"
    port: int = 8000
    prefill_port: int = 0
    decode_port: int = 0
    version: str = "0.5.22"
    prefill_pool_tokens: int = 16384
    decode_pool_tokens: int = 16384
    page_size: int = 16
    context_length: int = 32768
    max_running_requests: int = 64
    layers: int = 2
    device: str = "cpu"
    transfer_timeout: float = 30.0
    kv_hold_timeout: float = 30.0
    deferred_release: bool | None = None  # None: as the release does
    kvwatch: str = "off"
    kvwatch_spool: str | None = None
    kvwatch_scrub: str = "off"  # off | on_free | on_reserve: engine_hooks.Scrub
    log_dir: str | None = None
    tokenizer_piece_bytes: int = PIECE_BYTES
    ffn_width: int = 0  # a feed-forward block of this width per layer (0: attention only)
    faults: Faults = field(default_factory=Faults)

    @property
    def release(self) -> Release:
        return release(self.version)

    @property
    def defers_release(self) -> bool:
        if self.deferred_release is None:
            return self.release.deferred_release
        return self.deferred_release

    @property
    def head_dim(self) -> int:
        # Positions up to the context plus a generous generation budget stay distinct.
        return head_dim_for(self.context_length + 65536)

    @property
    def kvwatch_on(self) -> bool:
        """Whether the hooks are installed: for the detectors, or only to scrub pages."""
        return self.kvwatch != "off" or self.kvwatch_scrub != "off"
