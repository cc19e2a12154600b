"""The default model: a tiny deterministic attention-only transformer that recites its context.

Each layer has one head. A token's key is position-free (``(1, 0)`` pairs); rotary position is
applied when the key is read, by the slot's position in the request's page table, with binary
frequencies ``pi / 2**j`` so that the query for position ``i`` scores ``F`` at ``i`` and at most
``F - 2`` anywhere else. A token's value holds its token id (the tokenizer's 16-bit digits). At
decode step ``i`` every layer attends over the request's pages with a query for position ``i``;
the last layer's output, rounded, is the next token. So the reply recites the context in
page-table order: whatever the request's pages hold, written by it or not, comes back as text.
Scores that are not numbers (a canary stamp is NaN) are masked, as a kernel that skips padding.
"""

from __future__ import annotations

import math

import numpy as np
import torch

from minipd.kvcache import KVPool
from minipd.tokenizer import DIGITS, Rows

MODEL_NAME = "minipd-recite"
# Query scale: a wrong position loses at least 2 * SCALE nats, so attention is one-hot in fp32.
SCALE = 20.0
_MAX_DIGIT = 65535


class ReciteModel:
    def __init__(
        self, head_dim: int, device: torch.device, *, ffn_width: int = 0, layers: int = 1
    ) -> None:
        self.head_dim = head_dim
        self.frequencies = head_dim // 2
        self.device = device
        omega = math.pi / 2.0 ** np.arange(self.frequencies)
        self._omega = torch.tensor(omega, dtype=torch.float64)
        self._cos = torch.empty(0, self.frequencies)
        self._sin = torch.empty(0, self.frequencies)
        self._key = torch.zeros(head_dim, dtype=torch.float32, device=device)
        self._key[0::2] = 1.0
        # Optional feed-forward blocks, one per layer, run on every prompt token: prefill then
        # costs what a model of that width costs, as in a real engine (where a reply that comes
        # back faster than its prompt's prefill is a finding). Their output fills the value
        # dimensions the recitation does not read.
        self._ffn: list[tuple[torch.Tensor, torch.Tensor]] = []
        if ffn_width > 0 and head_dim > DIGITS:
            gen = torch.Generator().manual_seed(0)
            for _ in range(layers):
                w_in = torch.randn(head_dim, ffn_width, generator=gen)
                w_out = torch.randn(ffn_width, head_dim - DIGITS, generator=gen)
                scale = 1.0 / math.sqrt(ffn_width)
                self._ffn.append((w_in.to(device) * scale, w_out.to(device) * scale))

    def _rotary(self, positions: int) -> tuple[torch.Tensor, torch.Tensor]:
        if self._cos.shape[0] < positions:
            size = max(positions, 2 * self._cos.shape[0], 1024)
            angle = torch.arange(size, dtype=torch.float64).unsqueeze(1) * self._omega
            self._cos = torch.cos(angle).float().to(self.device)
            self._sin = torch.sin(angle).float().to(self.device)
        return self._cos[:positions], self._sin[:positions]

    def kv(self, rows: Rows) -> tuple[torch.Tensor, torch.Tensor]:
        """Keys and values of these tokens: ``[n, 1, head_dim]`` each (the same in every layer)."""
        n = rows.shape[0]
        values = torch.zeros(n, 1, self.head_dim, dtype=torch.float32, device=self.device)
        digits = torch.from_numpy(rows.astype(np.float32)).to(self.device)
        values[:, 0, :DIGITS] = digits
        hidden = values[:, 0, :] / _MAX_DIGIT
        for w_in, w_out in self._ffn:
            hidden = torch.cat([hidden[:, :DIGITS], torch.relu(hidden @ w_in) @ w_out], dim=1)
        if self._ffn:
            values[:, 0, DIGITS:] = hidden[:, DIGITS:]
        keys = self._key.expand(n, 1, self.head_dim)
        return keys, values

    def holds_token(self, pool: KVPool, slots: torch.Tensor) -> torch.Tensor:
        """Per slot, whether it holds a token's KV (every token's key is the same): a slot never
        written, zeroed or carrying a canary stamp does not."""
        keys = pool.keys(0).index_select(0, slots)[:, 0, :]
        return (keys == self._key).all(dim=1)

    def write(self, pool: KVPool, slots: torch.Tensor, rows: Rows) -> None:
        """Compute the KV of ``rows`` and store it at ``slots`` in every layer."""
        keys, values = self.kv(rows)
        for layer in range(pool.layers):
            pool.keys(layer).index_copy_(0, slots, keys)
            pool.values(layer).index_copy_(0, slots, values)

    def attend(self, pool: KVPool, layer: int, slots: torch.Tensor, target: int) -> torch.Tensor:
        """One head's paged attention over ``slots`` (the page table, in order)."""
        context = slots.numel()
        keys = pool.keys(layer).index_select(0, slots)[:, 0, :]
        values = pool.values(layer).index_select(0, slots)[:, 0, :]
        cos, sin = self._rotary(max(context, target + 1))
        k_even, k_odd = keys[:, 0::2], keys[:, 1::2]
        rot_even = k_even * cos[:context] - k_odd * sin[:context]
        rot_odd = k_even * sin[:context] + k_odd * cos[:context]
        scores = SCALE * (rot_even @ cos[target] + rot_odd @ sin[target])
        scores = torch.nan_to_num(scores, nan=-math.inf, posinf=-math.inf, neginf=-math.inf)
        weights = torch.softmax(scores, dim=0)
        return torch.nan_to_num(weights) @ torch.nan_to_num(values)

    def next_token(self, pool: KVPool, slots: torch.Tensor, target: int) -> Rows:
        """The next token of a request whose context sits at ``slots``: it recites position
        ``target`` of its context."""
        out = torch.zeros(self.head_dim)
        for layer in range(pool.layers):
            out = self.attend(pool, layer, slots, target)
        digits = out[:DIGITS].round().clamp(0, _MAX_DIGIT).to(torch.int64).cpu().numpy()
        return digits.astype(np.uint16).reshape(1, DIGITS)
