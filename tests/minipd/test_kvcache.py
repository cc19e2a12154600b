"""minipd's own record of whose KV each slot holds (the blast-radius tests' ground truth)."""

from __future__ import annotations

import torch

from minipd.kvcache import PageOwners, make_owners, request_number


def test_a_whole_page_copy_carries_its_tail_and_reads_name_other_requests() -> None:
    prefill = PageOwners(make_owners(4 * 4, shared=False), 4)
    decode = PageOwners(make_owners(8 * 4, shared=True), 4)
    for rid in ("a", "b", "reader"):
        decode.named(rid)
    prefill.wrote(torch.arange(0, 4), "a")  # page 0: four of a's tokens
    prefill.wrote(torch.arange(0, 1), "reader")  # then one of the reader's, over a's first
    decode.wrote(torch.arange(8, 16), "b")  # decode pages 2 and 3: b's own tokens
    decode.copied(prefill, [0], [5])  # the reader's page 0 sent whole into decode's page 5
    read = torch.tensor([20, 21, 22, 23, 8, 9, 10, 30])  # page 5, two of b's page 2, page 7
    assert decode.held(read, "reader") == {"a": (1, 3), "b": (1, 3)}
    assert decode.held(torch.tensor([31]), "reader") == {}  # never written
    assert request_number("a") != request_number("b") and request_number("a") > 0
