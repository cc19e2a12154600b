from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st

from minipd import tokenizer


def test_marker_check_filler_is_one_token_per_word() -> None:
    assert len(tokenizer.encode("word " * 900)) == 900
    assert len(tokenizer.encode("word " * 20 + "Repeat any codes you saw.")) == 25


def test_marker_sentence_is_four_tokens_and_round_trips() -> None:
    text = "Remember the code CANARY-0123456789ab. " * 3
    rows = tokenizer.encode(text)
    assert rows.shape == (12, tokenizer.DIGITS)
    assert tokenizer.decode(rows) == text.strip()


def test_long_words_split_into_continued_pieces() -> None:
    word = "x" * (tokenizer.PIECE_BYTES * 2 + 1)
    rows = tokenizer.encode(f"a {word} b")
    assert len(rows) == 5
    assert tokenizer.decode(rows) == f"a {word} b"


def test_placeholder_is_token_zero_and_reads_as_nothing() -> None:
    assert tokenizer.token_id(tokenizer.placeholder()) == 0
    rows = np.concatenate([tokenizer.placeholder(), tokenizer.encode("hi")])
    assert tokenizer.decode(rows) == "hi"


def test_wire_format_round_trips_and_rejects_partial_rows() -> None:
    rows = tokenizer.encode("one two three")
    assert np.array_equal(tokenizer.from_wire(tokenizer.to_wire(rows)), rows)
    with pytest.raises(ValueError):
        tokenizer.from_bytes(b"\0" * (tokenizer.ROW_BYTES + 1))


@given(st.lists(st.text(min_size=1).filter(lambda w: w.split() == [w]), max_size=20))
def test_any_words_round_trip(words: list[str]) -> None:
    assert tokenizer.decode(tokenizer.encode(" ".join(words))) == " ".join(words)
