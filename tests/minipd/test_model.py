"""The model reads what the request's pages hold: its own tokens, or whoever wrote them last."""

from __future__ import annotations

import numpy as np
import torch

from minipd import tokenizer
from minipd.config import head_dim_for
from minipd.kvcache import FreeList, KVPool, PoolShape, copy_pages, make_buffers, pages_for
from minipd.model import ReciteModel

PAGE = 4
CPU = torch.device("cpu")


def make(tokens: int, context: int = 4096) -> tuple[KVPool, ReciteModel]:
    head_dim = head_dim_for(context)
    shape = PoolShape.for_tokens(tokens, PAGE, 2, head_dim)
    return KVPool(make_buffers(shape, CPU, shared=False), PAGE), ReciteModel(head_dim, CPU)


def recite(pool: KVPool, model: ReciteModel, pages: list[int], context: int, n: int) -> str:
    slots = pool.slots_of(pages, context)
    rows = [model.next_token(pool, slots, target=i) for i in range(n)]
    return tokenizer.decode(np.concatenate(rows))


def write(pool: KVPool, model: ReciteModel, pages: list[int], text: str) -> int:
    rows = tokenizer.encode(text)
    model.write(pool, pool.slots_of(pages, len(rows)), rows)
    return len(rows)


def test_recites_its_context_in_page_table_order() -> None:
    pool, model = make(64)
    pages = [9, 2, 7]  # not contiguous, not sorted
    n = write(pool, model, pages, "one two three four five six seven eight nine ten")
    assert recite(pool, model, pages, n, 10) == "one two three four five six seven eight nine ten"


def test_a_page_it_did_not_write_shows_up_in_the_reply() -> None:
    pool, model = make(64)
    free = FreeList(pool.num_pages)
    earlier = free.alloc(3)
    assert earlier is not None
    write(pool, model, earlier, "secret code of user a here ok")
    free.free(earlier)  # returned, not cleared
    free.pages.rotate(3)  # the next request gets the same pages back
    mine = free.alloc(3)
    assert mine == earlier
    write(pool, model, mine[:1], "x")  # the one-token placeholder writes one slot of one page
    reply = recite(pool, model, mine, 12, 8)
    assert reply.startswith("x code of user a here ok")


def test_nan_canary_in_first_layer_keys_does_not_break_the_readout() -> None:
    pool, model = make(64)
    pages = [0, 1]
    n = write(pool, model, pages, "a b c d e f g h")
    pool.keys(0)[4, 0, :4] = float("nan")  # a canary stamp: slot 0 of page 1, layer 0 K
    assert recite(pool, model, pages, n, 8) == "a b c d e f g h"


def test_attention_keeps_tens_of_thousands_of_positions_apart() -> None:
    context = 40_000
    pool, model = make(context, context)
    pages = list(range(pages_for(context, PAGE)))
    words = [f"t{i}" for i in range(context)]
    n = write(pool, model, pages, " ".join(words))
    slots = pool.slots_of(pages, n)
    for target in (0, 1, 4095, 4096, 32767, 39_999):
        row = model.next_token(pool, slots, target)
        assert tokenizer.decode(row) == words[target]


def test_copy_pages_moves_whole_pages_between_pools() -> None:
    src, model = make(64)
    dst, _ = make(64)
    write(src, model, [3, 4], "p q r s t u")
    copy_pages(src, [3, 4], dst, [10, 0])
    assert recite(dst, model, [10, 0], 6, 6) == "p q r s t u"
