"""Canary stamps: byte patterns that real KV data cannot hold.

A stamp is the first :data:`STAMP_BYTES` bytes of a page in the pool's first buffer, written as
elements that are NaN in the pool's KV dtype, with a payload derived from (page, generation,
purpose). Real keys and values are never NaN, so a page whose stamp is gone was written, and a
page whose stamp is intact was not. Pages are transferred whole, so a write covers the stamp.
"""

from __future__ import annotations

import struct
from enum import IntEnum
from functools import cache

import torch

STAMP_BYTES = 16


class Purpose(IntEnum):
    FREE = 0x5F3E  # stamped on free, must be intact at the next allocation
    RESERVED = 0x2C91  # stamped when decode reserves, must be gone at admit


def supported(kv_dtype: torch.dtype) -> bool:
    return element_size(kv_dtype) in _ENCODERS


@cache
def element_size(kv_dtype: torch.dtype) -> int:
    """Bytes per element of the KV dtype (uint8: fp8 stored as bytes)."""
    return 1 if kv_dtype == torch.uint8 else torch.empty((), dtype=kv_dtype).element_size()


def payload(pages: torch.Tensor, generations: torch.Tensor, purpose: Purpose) -> torch.Tensor:
    """A 48-bit mix of page id, generation and purpose, per page (int64, on the pages' device)."""
    mixed = pages * 0x9E3779B1 + generations * 0x85EBCA77 + int(purpose) * 0xC2B2AE3D
    mixed = mixed ^ (mixed >> 29)
    mixed = (mixed * 0x94D049BB) & ((1 << 48) - 1)
    return mixed ^ (mixed >> 17)


def _bits(value: torch.Tensor, count: int, width: int) -> torch.Tensor:
    shifts = torch.arange(count, device=value.device, dtype=torch.int64) * width
    return (value.unsqueeze(1) >> shifts) & ((1 << width) - 1)


def _encode_1(p: torch.Tensor) -> torch.Tensor:
    # fp8 (e4m3fn and e5m2) and uint8-stored fp8: 0x7F and 0xFF are NaN in both; the sign bit
    # carries one payload bit per byte.
    return (0x7F | (_bits(p, STAMP_BYTES, 1) << 7)).to(torch.uint8)


def _encode_2(p: torch.Tensor, kv_dtype: torch.dtype) -> torch.Tensor:
    if kv_dtype == torch.bfloat16:  # exponent 0xFF, mantissa 7 bits kept nonzero
        words = 0x7F80 | 0x40 | _bits(p, 8, 6)
    else:  # float16: exponent 0x1F, mantissa 10 bits kept nonzero
        words = 0x7C00 | 0x200 | _bits(p, 8, 6)
    return words.to(torch.int16).view(torch.uint8)


def _encode_4(p: torch.Tensor) -> torch.Tensor:
    # float32: exponent 0xFF, quiet bit set, 12 payload bits per element.
    words = 0x7FC00000 | _bits(p, 4, 12)
    return words.to(torch.int32).view(torch.uint8)


_ENCODERS = {1, 2, 4}


def stamps(
    pages: torch.Tensor, generations: torch.Tensor, purpose: Purpose, kv_dtype: torch.dtype
) -> torch.Tensor:
    """The ``[len(pages), STAMP_BYTES]`` uint8 stamps for these pages at these generations."""
    p = payload(pages, generations, purpose)
    size = element_size(kv_dtype)
    if size == 1:
        out = _encode_1(p)
    elif size == 2:
        out = _encode_2(p, kv_dtype)
    elif size == 4:
        out = _encode_4(p)
    else:
        raise ValueError(f"no canary encoding for {kv_dtype}")
    return out.reshape(len(pages), STAMP_BYTES)


# -- the same stamps computed with Python integers, for pools in host memory ------------------
# (a handful of small tensor ops costs tens of microseconds per call on a CPU; these cost one)

_MASK64 = (1 << 64) - 1


def _payload_int(page: int, generation: int, purpose: int) -> int:
    mixed = (page * 0x9E3779B1 + generation * 0x85EBCA77 + purpose * 0xC2B2AE3D) & _MASK64
    if mixed >= 1 << 63:  # int64 wrap-around, as in the tensor version
        mixed -= 1 << 64
    mixed = mixed ^ (mixed >> 29)
    mixed = (mixed * 0x94D049BB) & ((1 << 48) - 1)
    return mixed ^ (mixed >> 17)


# One byte of payload bits as eight fp8 stamp bytes (a table: this runs once per page).
_FP8_BYTES = [bytes(0x7F | (((v >> i) & 1) << 7) for i in range(8)) for v in range(256)]
_HALVES = struct.Struct("<8H")
_WORDS = struct.Struct("<4I")


def stamp_bytes(page: int, generation: int, purpose: Purpose, kv_dtype: torch.dtype) -> bytes:
    """One page's stamp, equal to ``stamps(...)[0]`` for that page."""
    p = _payload_int(page, generation, int(purpose))
    size = element_size(kv_dtype)
    if size == 1:
        return _FP8_BYTES[p & 0xFF] + _FP8_BYTES[(p >> 8) & 0xFF]
    if size == 2:
        base = 0x7F80 | 0x40 if kv_dtype == torch.bfloat16 else 0x7C00 | 0x200
        return _HALVES.pack(*[base | ((p >> shift) & 0x3F) for shift in range(0, 48, 6)])
    if size == 4:
        nan = 0x7FC00000
        return _WORDS.pack(
            nan | (p & 0xFFF), nan | (p >> 12 & 0xFFF), nan | (p >> 24 & 0xFFF), nan | (p >> 36)
        )
    raise ValueError(f"no canary encoding for {kv_dtype}")
