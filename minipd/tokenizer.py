"""A deterministic, open-vocabulary word tokenizer: one token per whitespace-separated word.

A token is a piece of a word of at most :data:`PIECE_BYTES` UTF-8 bytes (longer words become
several pieces, the later ones flagged as continuations), so ``"word " * N`` is ``N`` tokens and
the incident's ``CANARY-0123456789ab.`` is one token. A token is stored as :data:`DIGITS` unsigned
16-bit digits: digit 0 holds ``length | continuation << 5``, digits 1..12 the zero-padded bytes
(big-endian). Its token id is that 26-byte string read as one big-endian integer; id 0 is the
empty token, used as the scheduler's one-token placeholder and read back from never-written
slots. Decoding joins pieces into words and words with single spaces.
"""

from __future__ import annotations

import base64

import numpy as np
import numpy.typing as npt

PIECE_BYTES = 24
DIGITS = 1 + PIECE_BYTES // 2
ROW_BYTES = 2 * DIGITS
_CONTINUES = 1 << 5
_BIG_ENDIAN_U16 = np.dtype(">u2")

Rows = npt.NDArray[np.uint16]


def _word_bytes(word: str, piece_bytes: int = PIECE_BYTES) -> bytes:
    raw = word.encode()
    out = bytearray()
    for start in range(0, len(raw), piece_bytes):
        piece = raw[start : start + piece_bytes]
        meta = len(piece) | (_CONTINUES if start else 0)
        out += meta.to_bytes(2, "big") + piece.ljust(PIECE_BYTES, b"\0")
    return bytes(out)


def encode(text: str, piece_bytes: int = PIECE_BYTES) -> Rows:
    """The ``[tokens, DIGITS]`` uint16 rows of ``text``. A smaller ``piece_bytes`` (1 to
    ``PIECE_BYTES``) splits words into more tokens: a tokenizer that is not a word count."""
    if not 1 <= piece_bytes <= PIECE_BYTES:
        raise ValueError(f"piece_bytes must be in 1..{PIECE_BYTES}")
    cache: dict[str, bytes] = {}
    parts = []
    for word in text.split():
        packed = cache.get(word)
        if packed is None:
            packed = cache[word] = _word_bytes(word, piece_bytes)
        parts.append(packed)
    return from_bytes(b"".join(parts))


def decode(rows: Rows) -> str:
    """Text from token rows; empty tokens (placeholder, never-written slots) vanish."""
    data = to_bytes(rows)
    words: list[bytearray] = []
    for start in range(0, len(data), ROW_BYTES):
        meta = int.from_bytes(data[start : start + 2], "big")
        length = min(meta & (_CONTINUES - 1), PIECE_BYTES)
        if length == 0:
            continue
        piece = data[start + 2 : start + 2 + length]
        if meta & _CONTINUES and words:
            words[-1] += piece
        else:
            words.append(bytearray(piece))
    return " ".join(w.decode(errors="replace") for w in words)


def token_id(row: Rows) -> int:
    """The integer id of one token row (for display and documentation)."""
    return int.from_bytes(to_bytes(row.reshape(1, DIGITS)), "big")


def placeholder() -> Rows:
    """The one-token placeholder an aborted request is reduced to (token id 0)."""
    return np.zeros((1, DIGITS), dtype=np.uint16)


def to_bytes(rows: Rows) -> bytes:
    return np.ascontiguousarray(rows, dtype=_BIG_ENDIAN_U16).tobytes()


def from_bytes(data: bytes) -> Rows:
    if len(data) % ROW_BYTES:
        raise ValueError("token bytes are not a whole number of rows")
    return np.frombuffer(data, dtype=_BIG_ENDIAN_U16).reshape(-1, DIGITS).astype(np.uint16)


def to_wire(rows: Rows) -> str:
    return base64.b64encode(to_bytes(rows)).decode()


def from_wire(text: str) -> Rows:
    return from_bytes(base64.b64decode(text, validate=True))
