"""kvwatch's seal on SGLang's metadata row (engine_hooks/sglang/hooks_seal.py), without SGLang.

The row is what SGLang's ``MetadataBuffers.bootstrap_room`` holds per request: 8 x uint64 on the
host, word 0 SGLang's own room. The seal must round-trip through the other seven words exactly,
never touch word 0, and a row without a seal (cleared by SGLang, or from a prefill without
kvwatch) must read as no seal, never as a seal of zeros.
"""

from __future__ import annotations

from types import SimpleNamespace

import torch

from engine_hooks.detectors import Seal, page_digests_digest
from engine_hooks.sglang import hooks_seal

ROOM = 0x7FFF_FFFF_FFFF_FFF1


def metadata(rows: int = 4) -> SimpleNamespace:
    buffers = SimpleNamespace(bootstrap_room=torch.zeros((rows, 8), dtype=torch.uint64))
    buffers.bootstrap_room[:, 0] = ROOM
    return buffers


def test_a_seal_with_page_digests_round_trips_beside_the_room() -> None:
    buffers = metadata()
    digests = (0xFFFF_FFFF, 1, 0x8000_0000)
    seal = Seal(3, page_digests_digest(digests), digests)
    words = hooks_seal._words(buffers, 2)
    assert words is not None
    hooks_seal.encode(words, seal)
    assert int(buffers.bootstrap_room[2, 0]) == ROOM  # SGLang's word untouched
    assert hooks_seal.decode(hooks_seal._words(buffers, 2)) == seal  # type: ignore[arg-type]
    assert hooks_seal.decode(hooks_seal._words(buffers, 1)) is None  # type: ignore[arg-type]


def test_over_nine_pages_one_digest_for_all() -> None:
    buffers = metadata()
    words = hooks_seal._words(buffers, 0)
    assert words is not None
    digests = tuple(range(11))
    hooks_seal.encode(words, Seal(11, 0xDEAD_BEEF, digests))
    assert hooks_seal.decode(words) == Seal(11, 0xDEAD_BEEF)


def test_a_cleared_or_unsealed_row_is_no_seal() -> None:
    buffers = metadata()
    words = hooks_seal._words(buffers, 3)
    assert words is not None
    hooks_seal.encode(words, Seal(2, 5, (1, 2)))
    hooks_seal.encode(words, None)  # prefill without a seal for this request
    assert hooks_seal.decode(words) is None
    buffers.bootstrap_room[3] = 0  # SGLang's clear_slot
    assert hooks_seal.decode(words) is None


def test_a_row_that_cannot_hold_a_seal_is_left_alone() -> None:
    narrow = SimpleNamespace(bootstrap_room=torch.zeros((2, 1), dtype=torch.uint64))
    assert hooks_seal._words(narrow, 0) is None
    assert hooks_seal._words(SimpleNamespace(), 0) is None


def test_the_writers_tp_slice_round_trips_and_a_first_version_row_still_reads() -> None:
    buffers = metadata()
    words = hooks_seal._words(buffers, 1)
    assert words is not None
    seal = Seal(2, page_digests_digest((7, 8)), (7, 8))
    hooks_seal.encode(words, seal, (2, 1))
    assert hooks_seal.decode_with_writer(words) == (seal, (2, 1))
    # A row a kvw1 writer left (no slice word, the page digests one word earlier).
    words[2:] = 0
    words[2:8] = (hooks_seal.MAGIC_V1, 2, seal.digest, 2, 7, 8)
    assert hooks_seal.decode_with_writer(words) == (seal, hooks_seal.ONE_RANK)


def test_nine_page_digests_fit_beside_the_slice() -> None:
    words = hooks_seal._words(metadata(), 0)
    assert words is not None
    nine = tuple(range(1, 10))
    hooks_seal.encode(words, Seal(9, page_digests_digest(nine), nine), (4, 3))
    assert hooks_seal.decode_with_writer(words) == (
        Seal(9, page_digests_digest(nine), nine),
        (4, 3),
    )
