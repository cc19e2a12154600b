"""SGLang's ``--disaggregation-enable-kv-checksum`` digest, transliterated from its CUDA kernel
(SGLang 0.5.23: ``sglang/kernels/jit/csrc/elementwise/adler32_checksum.cuh``, driven by
``sglang/kernels/ops/memory/adler32.py`` and ``sglang/srt/disaggregation/checksum.py``), so
the tests can run it on CPU memory and compare it with kvwatch's seal.

SGLang's items are ``(kv_data_ptrs[i] + page * kv_item_lens[i], kv_item_lens[i])`` for every
buffer ``i`` (outer) and every page of the request (inner, in page-table order). Each item is
summed by one thread (``adler32_compute``: a byte head up to 16-byte alignment, 16-byte vectors,
a byte tail; sums kept in uint64, reduced mod 65521 every 4096 vectors); the per-item states
``(a, b, len)`` are merged with ``adler32_combine`` in item order (a warp-shuffle tree and a
second kernel: an ordered reduction of an associative operation, which a left fold equals).
"""

from __future__ import annotations

import ctypes
from collections.abc import Sequence

import numpy as np

MOD = 65521
U64 = (1 << 64) - 1


def compute(ptr: int, nbytes: int) -> tuple[int, int, int]:
    """``adler32_compute`` over ``nbytes`` at address ``ptr`` (read in place)."""
    data = np.frombuffer((ctypes.c_ubyte * nbytes).from_address(ptr), dtype=np.uint8)
    total = weighted = 0
    offset = 0
    while offset < nbytes and (ptr + offset) & 15:
        total += int(data[offset])
        weighted += (nbytes - offset) * int(data[offset])
        offset += 1
    count = (nbytes - offset) // 16
    vectors = data[offset : offset + 16 * count].reshape(count, 16).astype(np.uint64)
    words = vectors.reshape(count, 4, 4)  # little-endian bytes x0..x3 of four uint32 words
    word_sums = words.sum(axis=2)
    within = (3 * words[:, :, 0] + 2 * words[:, :, 1] + words[:, :, 2]).sum(axis=1)
    within += 12 * word_sums[:, 0] + 8 * word_sums[:, 1] + 4 * word_sums[:, 2]
    vector_sums = word_sums.sum(axis=1)
    for i in range(count):
        base = offset + i * 16
        total = (total + int(vector_sums[i])) & U64
        weighted = (weighted + (nbytes - base - 15) * int(vector_sums[i]) + int(within[i])) & U64
        if (i & 4095) == 4095:
            total %= MOD
            weighted %= MOD
    offset += count * 16
    while offset < nbytes:
        total += int(data[offset])
        weighted += (nbytes - offset) * int(data[offset])
        offset += 1
    return (1 + total) % MOD, (nbytes % MOD + weighted) % MOD, nbytes


def combine(left: tuple[int, int, int], right: tuple[int, int, int]) -> tuple[int, int, int]:
    """``adler32_combine`` of SGLang's kernel."""
    a = (left[0] + right[0] - 1 + MOD) % MOD
    b = (left[1] + right[1] + (right[2] % MOD) * ((left[0] - 1 + MOD) % MOD)) % MOD
    return a, b, left[2] + right[2]


def digest(data_ptrs: Sequence[int], item_lens: Sequence[int], pages: Sequence[int]) -> int:
    """``KvChecksumComputer.compute`` for these KV buffers and page indices."""
    state = (1, 0, 0)  # adler32_identity
    for ptr, item_len in zip(data_ptrs, item_lens, strict=True):
        for page in pages:
            state = combine(state, compute(ptr + page * item_len, item_len))
    return (state[1] << 16) | state[0]
