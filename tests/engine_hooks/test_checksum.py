"""adler32 and adler32_combine match zlib for bytes, CPU tensors and the device path."""

from __future__ import annotations

import random
import zlib

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from engine_hooks import adler32, adler32_combine, adler32_torch, checksum
from engine_hooks.checksum import tensor_buffer

MIB = 1 << 20
lengths = st.one_of(
    st.integers(0, 64),
    st.integers(0, 70_000),  # across zlib's NMAX (5552) and the 16-bit sums
    st.integers(MIB - 3, MIB + 3),  # around the device path's block width
    st.integers(0, 5 * MIB),
)
start_values = st.one_of(st.just(1), st.integers(0, 0xFFFFFFFF))


def payload(length: int, seed: int, fill: int | None) -> bytes:
    if fill is not None:
        return bytes([fill]) * length
    return random.Random(seed).randbytes(length)


@settings(max_examples=60, deadline=None)
@given(lengths, st.integers(0, 2**32), st.sampled_from([None, None, 0xFF, 0x00]), start_values)
def test_bytes_match_zlib(length: int, seed: int, fill: int | None, value: int) -> None:
    data = payload(length, seed, fill)
    assert adler32(data, value) == zlib.adler32(data, value)
    assert adler32(memoryview(data), value) == zlib.adler32(data, value)


DTYPES = [torch.uint8, torch.int8, torch.bfloat16, torch.float16, torch.float32, torch.int64]
FP8 = [getattr(torch, name) for name in ("float8_e4m3fn", "float8_e5m2") if hasattr(torch, name)]


@settings(max_examples=40, deadline=None)
@given(st.integers(0, 600_000), st.integers(0, 2**32), st.sampled_from(DTYPES + FP8), start_values)
def test_cpu_tensor_matches_zlib(nbytes: int, seed: int, dtype: torch.dtype, value: int) -> None:
    raw = payload(nbytes, seed, None)
    size = torch.empty((), dtype=dtype).element_size()
    raw = raw[: len(raw) // size * size]
    tensor = (
        torch.frombuffer(bytearray(raw), dtype=torch.uint8).view(dtype)
        if raw
        else (torch.empty(0, dtype=dtype))
    )
    assert adler32(tensor, value) == zlib.adler32(raw, value)


@settings(max_examples=40, deadline=None)
@given(lengths, st.integers(0, 2**32), st.sampled_from([None, 0xFF]), start_values)
def test_device_path_matches_zlib(length: int, seed: int, fill: int | None, value: int) -> None:
    data = payload(length, seed, fill)
    tensor = (
        torch.frombuffer(bytearray(data), dtype=torch.uint8)
        if data
        else torch.empty(0, dtype=torch.uint8)
    )
    assert adler32_torch(tensor, value) == zlib.adler32(data, value)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, *FP8])
def test_device_path_on_other_dtypes_and_shapes(dtype: torch.dtype) -> None:
    tensor = torch.randn(7, 33, 5).to(dtype)
    expected = zlib.adler32(bytes(tensor.view(torch.uint8).reshape(-1).tolist()))
    assert adler32_torch(tensor) == expected
    assert adler32(tensor) == expected


def test_non_contiguous_tensor_is_read_in_logical_order() -> None:
    tensor = torch.arange(64, dtype=torch.int32).reshape(8, 8).t()
    expected = zlib.adler32(bytes(tensor.contiguous().view(torch.uint8).reshape(-1).tolist()))
    assert adler32(tensor) == expected
    assert adler32_torch(tensor) == expected


def test_cpu_tensor_is_read_in_place() -> None:
    tensor = torch.zeros(4096, dtype=torch.uint8)
    view = tensor_buffer(tensor)
    tensor[10] = 7  # a later write shows through the view: it is the tensor's own storage
    assert view[10] == 7
    assert adler32(tensor) == zlib.adler32(bytes(view))


@settings(max_examples=200, deadline=None)
@given(st.binary(max_size=20_000), st.integers(0, 20_000), start_values)
def test_combine_matches_zlib(data: bytes, split: int, value: int) -> None:
    split = min(split, len(data))
    left, right = data[:split], data[split:]
    combined = adler32_combine(zlib.adler32(left, value), zlib.adler32(right), len(right))
    assert combined == zlib.adler32(data, value)


def test_combine_with_large_lengths_and_all_ff() -> None:
    left, right = b"\xff" * (3 * MIB + 1), b"\xff" * (2 * MIB + 7)
    combined = adler32_combine(zlib.adler32(left), zlib.adler32(right), len(right))
    assert combined == zlib.adler32(left + right)


@pytest.mark.parametrize("value", [65521, 65535, 0xFFFFFFFF, 0xFFF1FFF1, 65521 << 16])
def test_out_of_range_start_values_on_empty_data(value: int) -> None:
    assert adler32(b"", value) == zlib.adler32(b"", value)
    assert adler32(torch.empty(0, dtype=torch.uint8), value) == zlib.adler32(b"", value)
    assert adler32_torch(torch.empty(0, dtype=torch.uint8), value) == zlib.adler32(b"", value)


def test_combine_rejects_negative_length() -> None:
    with pytest.raises(ValueError):
        adler32_combine(1, 1, -1)


def test_native_loop_is_built() -> None:
    """The package builds engine_hooks/_pageloop.c; a missing build is a failure, not a skip."""
    assert checksum.native_loop() is not None


@settings(max_examples=60, deadline=None)
@given(st.lists(st.tuples(st.integers(0, 9000), st.integers(0, 9000)), max_size=40), start_values)
def test_address_loop_matches_zlib(spans: list[tuple[int, int]], value: int) -> None:
    memory = torch.randint(0, 256, (18_000,), dtype=torch.uint8)
    memory[:3000] = 0xFF
    base = memory.data_ptr()
    addresses = np.array([base + start for start, _ in spans], dtype=np.uint64)
    lengths = np.array([n for _, n in spans], dtype=np.uint64)
    raw = memory.numpy().tobytes()
    expected = zlib.adler32(b"".join(raw[s : s + n] for s, n in spans), value)
    assert checksum.adler32_addresses(addresses, lengths, value) == expected


def test_address_loop_without_the_native_build(monkeypatch: pytest.MonkeyPatch) -> None:
    memory = torch.randint(0, 256, (4096,), dtype=torch.uint8)
    addresses = np.array([memory.data_ptr() + 100, memory.data_ptr()], dtype=np.uint64)
    lengths = np.array([900, 50], dtype=np.uint64)
    native = checksum.adler32_addresses(addresses, lengths, 7)
    monkeypatch.setattr(checksum, "native_loop", lambda: None)
    assert checksum.adler32_addresses(addresses, lengths, 7) == native
    raw = memory.numpy().tobytes()
    assert native == zlib.adler32(raw[100:1000] + raw[:50], 7)
