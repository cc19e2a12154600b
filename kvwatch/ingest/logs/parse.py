"""Read KV pool size and context length from SGLang and vLLM log lines.

Each line is read on its own (so interleaved lines and the two-line vLLM form need no pairing):

- SGLang scheduler start-up: ``max_total_num_tokens=681280, chunked_prefill_size=8192, ...,
  context_len=1048576, available_gpu_mem=12.34 GB`` after the logger's ``[time TP0]`` prefix.
- vLLM: ``GPU KV cache size: 1,234,567 tokens`` and ``Maximum concurrency for 131,072 tokens per
  request: 9.42x`` (one line or two), V0's ``# GPU blocks: N`` (times the block size), the model
  length from ``Using max model len N`` or ``max_seq_len=N``.

ANSI colours and thousands separators are stripped; a line may start with a role and a colon
(``prefill: ...``), as in the incident's check. A line that names one of these fields but cannot be
read raises :class:`LineError` for the caller to count.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from typing import Final

from kvspool.catalogue import unsafe_band

#: vLLM's default block size on CUDA, used for ``# GPU blocks`` when the log names none.
DEFAULT_VLLM_BLOCK_SIZE: Final = 16
#: Lines longer than this are not parsed (counted as ``long_line``).
MAX_LINE_CHARS: Final = 64 * 1024

_NUM = r"(\d[\d,_]*)"
ANSI: Final = re.compile(r"\x1b\[[0-9;?]*[ -/]*[@-~]|\x1b[@-Z\\-_]")
ROLE_PREFIX: Final = re.compile(r"^\s*(prefill|decode|unified)\s*:\s*", re.IGNORECASE)
_SG_POOL = re.compile(r"\bmax_total_num_tokens\s*=\s*" + _NUM)
_SG_CONTEXT = re.compile(r"\bcontext_len\s*=\s*" + _NUM)
_SG_PAGE = re.compile(r"\bpage_size\s*=\s*" + _NUM)
_TP = re.compile(r"\bTP\s*(\d{1,9})\b")
_VL_KV = re.compile(r"GPU KV cache size:\s*" + _NUM + r"\s*tokens", re.IGNORECASE)
_VL_CONCURRENCY = re.compile(r"Maximum concurrency for\s*" + _NUM + r"\s*tokens per request")
_VL_BLOCKS = re.compile(r"#\s*GPU blocks:\s*" + _NUM)
_VL_MAX_LEN = re.compile(r"Using max model len\s*" + _NUM)
_VL_SEQ_LEN = re.compile(r"\bmax_seq_len\s*=\s*" + _NUM)
_VL_BLOCK_SIZE = re.compile(r"\bblock_size\s*=\s*" + _NUM)
_VL_VERSION = re.compile(r"LLM engine \(v(\d[\w.+-]*)\)")
_MODEL = re.compile(r"\bmodel(?:_path)?\s*=\s*'([^']{1,200})'")
#: Words that mark a line as one we should be able to read.
_TRIGGERS: Final = (
    "max_total_num_tokens",
    "GPU KV cache size",
    "Maximum concurrency for",
    "GPU blocks:",
    "Using max model len",
)


class LineError(ValueError):
    """A line that names a field this module reads, but in a form it cannot read."""

    reason = "unparsed"


@dataclass(slots=True)
class Reading:
    """What one line said. ``None`` fields: the line did not say."""

    engine: str
    role: str | None = None
    rank: int = 0
    pool_tokens: int | None = None
    context_length_tokens: int | None = None
    page_size: int | None = None
    gpu_blocks: int | None = None
    block_size: int | None = None
    version: str | None = None
    model: str | None = None


def _int(text: str) -> int:
    if len(text) > 64:  # int() refuses > 4300 digits; no real count needs 64
        raise LineError("number too long")
    return int(text.replace(",", "").replace("_", ""))


def clean(line: str) -> str:
    return ANSI.sub("", line).rstrip("\r\n")


def _sglang(line: str, reading: Reading) -> bool:
    """SGLang's start-up line: the pool, and the context and rank beside it."""
    if (match := _SG_POOL.search(line)) is None:
        return False
    reading.engine = "sglang"
    reading.pool_tokens = _int(match.group(1))
    if (match := _SG_CONTEXT.search(line)) is not None:
        reading.context_length_tokens = _int(match.group(1))
    if (match := _TP.search(line)) is not None:
        reading.rank = int(match.group(1))
    return True


def _vllm(line: str, reading: Reading) -> bool:
    """vLLM's lines: each says one of the pool, the context, the blocks or the version."""
    found = False
    if (match := _VL_KV.search(line)) is not None:
        reading.engine = "vllm"
        reading.pool_tokens = _int(match.group(1))
        found = True
    if (match := _VL_CONCURRENCY.search(line)) is not None:
        reading.engine = "vllm"
        reading.context_length_tokens = _int(match.group(1))
        found = True
    if (match := _VL_BLOCKS.search(line)) is not None:
        reading.engine = "vllm"
        reading.gpu_blocks = _int(match.group(1))
        found = True
    if (match := _VL_MAX_LEN.search(line) or _VL_SEQ_LEN.search(line)) is not None:
        reading.engine = "vllm" if reading.engine == "other" else reading.engine
        reading.context_length_tokens = _int(match.group(1))
        found = True
    if (match := _VL_VERSION.search(line)) is not None:
        reading.engine = "vllm"
        reading.version = match.group(1)
        found = True
    return found


def parse_line(raw: str) -> Reading | None:
    """The fields of one log line, or None when it has none. Raises :class:`LineError`."""
    if len(raw) > MAX_LINE_CHARS:
        raise LineError("line too long")
    line = clean(raw)
    role: str | None = None
    prefix = ROLE_PREFIX.match(line)
    if prefix:
        role = prefix.group(1).lower()
        line = line[prefix.end() :]
    reading = Reading(engine="other", role=role)
    found = _sglang(line, reading)
    found = _vllm(line, reading) or found
    if found:
        if (match := _VL_BLOCK_SIZE.search(line)) is not None:
            reading.block_size = _int(match.group(1))
        if (match := _SG_PAGE.search(line)) is not None:
            reading.page_size = _int(match.group(1))
        if (match := _MODEL.search(line)) is not None:
            reading.model = match.group(1)
        return reading
    if any(word in line for word in _TRIGGERS):
        raise LineError("names a KV pool or context field but its value cannot be read")
    if (match := _VL_BLOCK_SIZE.search(line)) is not None:
        return Reading(engine="other", role=role, block_size=_int(match.group(1)))
    return None


@dataclass(slots=True)
class EngineView:
    """Pool, context and page size of one engine process, merged over its log lines."""

    role: str | None
    rank: int
    engine: str = "other"
    pool_tokens: int | None = None
    context_length_tokens: int | None = None
    page_size: int | None = None
    gpu_blocks: int | None = None
    block_size: int | None = None
    version: str | None = None
    model: str | None = None
    lines: list[int] = field(default_factory=list)
    pool_from_blocks: bool = False

    def update(self, reading: Reading, line_number: int = 0) -> None:
        if reading.engine != "other":
            self.engine = reading.engine
        names = ("pool_tokens", "context_length_tokens", "page_size", "version", "model")
        for name in (*names, "gpu_blocks", "block_size"):
            value = getattr(reading, name)
            if value is not None:
                setattr(self, name, value)
        if reading.pool_tokens is not None:
            self.pool_from_blocks = False
        elif reading.gpu_blocks is not None:
            self.pool_from_blocks = True
        if self.pool_from_blocks and self.gpu_blocks is not None:
            block = self.block_size or DEFAULT_VLLM_BLOCK_SIZE
            self.pool_tokens = self.gpu_blocks * block
            if self.page_size is None or reading.block_size is not None:
                self.page_size = block
        if line_number:
            self.lines.append(line_number)

    @property
    def band_tokens(self) -> int | None:
        if self.pool_tokens is None or self.context_length_tokens is None:
            return None
        return unsafe_band(self.context_length_tokens, self.pool_tokens)

    def gauges(self) -> dict[str, float]:
        out: dict[str, float] = {}
        if self.pool_tokens is not None:
            out["kv_pool_tokens"] = float(self.pool_tokens)
        if self.context_length_tokens is not None:
            out["context_length_tokens"] = float(self.context_length_tokens)
        if self.page_size is not None:
            out["page_size_tokens"] = float(self.page_size)
        return out


class LogParser:
    """Per-file parser: merges readings into one :class:`EngineView` per (role, rank)."""

    def __init__(self, default_role: str | None = None) -> None:
        self.default_role = default_role
        self.views: dict[tuple[str | None, int], EngineView] = {}
        self.errors: dict[str, int] = {}
        self.lines = 0

    def feed(self, line: str) -> EngineView | None:
        """Read one line; the view it changed, if any. Never raises."""
        self.lines += 1
        try:
            reading = parse_line(line)
        except LineError as exc:
            reason = "long_line" if len(line) > MAX_LINE_CHARS else exc.reason
            self.errors[reason] = self.errors.get(reason, 0) + 1
            return None
        if reading is None:
            return None
        role = reading.role or self.default_role
        key = (role, reading.rank)
        view = self.views.get(key)
        if view is None:
            view = self.views[key] = EngineView(role=role, rank=reading.rank)
        view.update(reading, self.lines)
        return view
