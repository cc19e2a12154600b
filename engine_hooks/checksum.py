"""Adler-32, bit-identical to zlib's, over bytes and torch tensors.

CPU data goes through zlib-ng in place; many scattered chunks (a page table's pages) go through
one native loop (:func:`adler32_addresses`, ``engine_hooks/_pageloop.c``) that calls zlib-ng per
chunk (a contiguous CPU tensor is read through a zero-copy
buffer over its storage). Tensors on an accelerator are checksummed where they live by
:func:`adler32_torch`, which only moves the 4-byte result to the host; the same code runs on CPU
tensors, which is how the tests check it against zlib.
"""

from __future__ import annotations

import ctypes
import importlib.util
from collections.abc import Callable, Sequence
from functools import cache

import numpy as np
import torch
from zlib_ng import zlib_ng

BASE = 65521
# Columns per block in adler32_torch: weights are reduced mod BASE, so a uint8 times a weight
# fits int32, and a block's sum fits int64 with room to spare.
_BLOCK_COLUMNS = 1 << 20
# Elements converted to int32 at once (bounds the temporary memory to 64 MiB).
_BATCH_ELEMENTS = 1 << 24

Bytes = bytes | bytearray | memoryview


def tensor_buffer(tensor: torch.Tensor) -> memoryview:
    """A zero-copy byte view of a contiguous CPU tensor's storage.

    The view does not keep the tensor alive: the caller must hold the tensor while using it.
    """
    if tensor.device.type != "cpu":
        raise ValueError("tensor_buffer needs a CPU tensor")
    if not tensor.is_contiguous():
        raise ValueError("tensor_buffer needs a contiguous tensor")
    nbytes = tensor.numel() * tensor.element_size()
    if nbytes == 0:
        return memoryview(b"")
    array = (ctypes.c_ubyte * nbytes).from_address(tensor.data_ptr())
    return memoryview(array).cast("B")


def adler32(data: Bytes | torch.Tensor, value: int = 1) -> int:
    """Adler-32 of ``data`` continuing from ``value``, exactly as ``zlib.adler32``.

    ``data`` is any bytes-like object or a tensor of any dtype (its raw bytes, in memory order
    for a contiguous tensor, in logical order otherwise).
    """
    if isinstance(data, torch.Tensor):
        if data.device.type != "cpu":
            return adler32_torch(data, value)
        tensor = data if data.is_contiguous() else data.contiguous()
        view = tensor_buffer(tensor)  # valid while `tensor` is referenced, to the end of this call
        if len(view) == 0:
            return _reduced(value)
        return int(zlib_ng.adler32(view, value))
    if len(data) == 0:
        return _reduced(value)  # zlib-ng returns an out-of-range start value as is; zlib reduces
    return zlib_ng.adler32(data, value)


def _reduced(value: int) -> int:
    return (value & 0xFFFF) % BASE | (((value >> 16) & 0xFFFF) % BASE) << 16


def adler32_combine(adler1: int, adler2: int, len2: int) -> int:
    """The Adler-32 of A+B from adler32(A), adler32(B) and len(B), as zlib's ``adler32_combine``."""
    if len2 < 0:
        raise ValueError("len2 must be >= 0")
    rem = len2 % BASE
    sum1 = adler1 & 0xFFFF
    sum2 = (rem * sum1) % BASE
    sum1 += (adler2 & 0xFFFF) + BASE - 1
    sum2 += ((adler1 >> 16) & 0xFFFF) + ((adler2 >> 16) & 0xFFFF) + BASE - rem
    if sum1 >= BASE:
        sum1 -= BASE
    if sum1 >= BASE:
        sum1 -= BASE
    if sum2 >= BASE << 1:
        sum2 -= BASE << 1
    if sum2 >= BASE:
        sum2 -= BASE
    return sum1 | (sum2 << 16)


class AdlerState:
    """A running Adler-32 held as two int64 tensors on the data's device (no host sync).

    ``fold_rows`` appends the rows of a 2-D uint8 tensor, in row order, as if their bytes were
    concatenated; :meth:`value` reads the 4-byte result (the only device-to-host transfer).
    """

    def __init__(self, device: torch.device, value: int = 1) -> None:
        value = _reduced(value)
        self.a = torch.tensor(value & 0xFFFF, dtype=torch.int64, device=device)
        self.b = torch.tensor(value >> 16, dtype=torch.int64, device=device)
        self._weights: dict[int, torch.Tensor] = {}

    def _weight(self, n: int) -> torch.Tensor:
        # (n - i) mod BASE for i in [0, n): the weight of byte i in a block of n bytes.
        weight = self._weights.get(n)
        if weight is None:
            weight = torch.arange(n, 0, -1, dtype=torch.int64, device=self.a.device)
            weight = (weight % BASE).to(torch.int32)
            self._weights[n] = weight
        return weight

    def fold_rows(self, rows: torch.Tensor) -> None:
        if rows.dim() != 2 or rows.dtype != torch.uint8:
            raise ValueError("fold_rows takes a 2-D uint8 tensor")
        count, width = rows.shape
        if count == 0 or width == 0:
            return
        if width > _BLOCK_COLUMNS:
            # Split each row into column blocks; the blocks of one row stay in order.
            pad = (-width) % _BLOCK_COLUMNS
            if pad:
                for r in range(count):  # rare: rows larger than a block and not a multiple
                    for start in range(0, width, _BLOCK_COLUMNS):
                        self.fold_rows(rows[r : r + 1, start : start + _BLOCK_COLUMNS])
                return
            rows = rows.reshape(count * (width // _BLOCK_COLUMNS), _BLOCK_COLUMNS)
            count, width = rows.shape
        step = max(1, _BATCH_ELEMENTS // width)
        for start in range(0, count, step):
            self._fold_block(rows[start : start + step])

    def _fold_block(self, rows: torch.Tensor) -> None:
        count, width = rows.shape
        data = rows.to(torch.int32)
        sums = data.sum(dim=1, dtype=torch.int64) % BASE  # S_r
        weighted = (data * self._weight(width)).sum(dim=1, dtype=torch.int64) % BASE  # W_r
        # Bytes after row r within this block, mod BASE.
        after = torch.arange(count - 1, -1, -1, dtype=torch.int64, device=rows.device)
        after = (after * width) % BASE
        total = (count * width) % BASE
        b = self.b + total * self.a + weighted.sum() + ((sums * after) % BASE).sum()
        self.a = (self.a + sums.sum()) % BASE
        self.b = b % BASE

    def value(self) -> int:
        return int(((self.b << 16) | self.a).item())


def adler32_torch(tensor: torch.Tensor, value: int = 1) -> int:
    """Adler-32 of a tensor's raw bytes computed with torch ops on the tensor's own device."""
    flat = tensor.contiguous().reshape(-1).view(torch.uint8)
    state = AdlerState(flat.device, value)
    width = min(_BLOCK_COLUMNS, max(1, flat.numel()))
    full = flat.numel() // width * width
    state.fold_rows(flat[:full].reshape(-1, width))
    if full < flat.numel():
        state.fold_rows(flat[full:].reshape(1, -1))
    return state.value()


def adler32_chunks(chunks: Sequence[Bytes], value: int = 1) -> int:
    """Adler-32 over the concatenation of ``chunks`` without concatenating them."""
    update = zlib_ng.adler32
    for chunk in chunks:
        value = update(chunk, value)
    return value


#: ``(value, addresses, lengths, count) -> value``: the native loop, bound to zlib-ng.
AddressLoop = Callable[[int, np.ndarray, np.ndarray], int]


@cache
def native_loop() -> AddressLoop | None:
    """The compiled loop over chunk addresses (built with the package), or None without it."""
    spec = importlib.util.find_spec("engine_hooks._pageloop")
    if spec is None or spec.origin is None:
        return None
    loop = ctypes.CDLL(spec.origin).kvwatch_adler32_chunks
    loop.restype = ctypes.c_uint32
    loop.argtypes = [ctypes.c_void_p, ctypes.c_uint32, ctypes.c_void_p, ctypes.c_void_p]
    loop.argtypes.append(ctypes.c_size_t)
    # zlib-ng's own Adler-32 (its SIMD code), from the extension zlib_ng already loaded.
    adler = ctypes.cast(ctypes.CDLL(zlib_ng.__file__).zng_adler32_z, ctypes.c_void_p).value

    def run(value: int, addresses: np.ndarray, lengths: np.ndarray) -> int:
        return int(loop(adler, value, addresses.ctypes.data, lengths.ctypes.data, len(addresses)))

    return run


@cache
def native_read() -> Callable[[np.ndarray, np.ndarray], int] | None:
    """The native read pass over chunk addresses (bench/checksum.py's baseline), or None."""
    spec = importlib.util.find_spec("engine_hooks._pageloop")
    if spec is None or spec.origin is None:
        return None
    read = ctypes.CDLL(spec.origin).kvwatch_read_chunks
    read.restype = ctypes.c_uint64
    read.argtypes = [ctypes.c_void_p, ctypes.c_void_p, ctypes.c_size_t]

    def run(addresses: np.ndarray, lengths: np.ndarray) -> int:
        return int(read(addresses.ctypes.data, lengths.ctypes.data, len(addresses)))

    return run


def adler32_addresses(addresses: np.ndarray, lengths: np.ndarray, value: int = 1) -> int:
    """Adler-32 over the chunks at ``addresses`` (uint64 array) of ``lengths`` bytes, in order,
    in one native call. The caller keeps the memory alive and valid."""
    if len(addresses) != len(lengths):
        raise ValueError("addresses and lengths differ in length")
    if not lengths.any():
        return _reduced(value)
    loop = native_loop()
    if loop is None:  # a source tree without the built extension: one Python call per chunk
        chunks = [
            memoryview((ctypes.c_ubyte * int(n)).from_address(int(a))).cast("B")
            for a, n in zip(addresses, lengths, strict=True)
        ]
        return adler32_chunks(chunks, value)
    return loop(
        value & 0xFFFFFFFF,
        np.ascontiguousarray(addresses, dtype=np.uint64),
        np.ascontiguousarray(lengths, dtype=np.uint64),
    )
