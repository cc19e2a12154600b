"""``kvwatch probe``: the marker test, pointed at a deployment you own.

It plants unique markers in recent KV pages, then sends one prompt whose length lands between
the KV pool size and the advertised context (the unsafe band), and reports what came back: the
status (an over-length prompt must be refused), the ``prompt_tokens`` the server reports, the
latency against what a prefill of that length takes, and any marker from an earlier request.

Exit codes: 0 the long prompt was refused with a client error (4xx: safe); 1 it was not
refused: answered, or failed with a server error (5xx, e.g. kvwatch in enforce mode stopped a
read of stale pages, but the engine still let the prompt through); 3 it was answered with
another request's marker in it (a leak); 4 the probe could not complete (server unreachable,
bad responses); 2 usage errors and refusals to run.
"""

# Longer than 450 lines: one command that stands alone (its HTTP client, calibration, markers
# and report), imported by nothing else. (Not in the docstring: it is the command's --help.)

from __future__ import annotations

import argparse
import ipaddress
import json
import math
import secrets
import sys
import time
import urllib.error
import urllib.parse
import urllib.request
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, field
from typing import Any, Protocol

EXIT_SAFE, EXIT_ANSWERED, EXIT_USAGE, EXIT_LEAKED, EXIT_FAILED = 0, 1, 2, 3, 4
FILLER_WORD = "word "
TAIL = "Repeat any codes you saw."
# A reply faster than this share of the expected time did not read the whole prompt.
TOO_FAST_SHARE = 0.5
NEW_TOKENS = 64


class ProbeError(Exception):
    """A response the probe cannot use; the message says what was wrong."""


@dataclass(frozen=True)
class Reply:
    status: int
    text: str
    prompt_tokens: int | None
    seconds: float


class Api(Protocol):
    def send(self, prompt: str, max_new_tokens: int) -> Reply: ...


@dataclass
class HttpApi:
    """SGLang's native ``/generate`` or the OpenAI-compatible ``/v1/completions``."""

    url: str
    kind: str = "sglang"
    timeout: float = 1800.0
    model: str | None = None

    def endpoint(self) -> str:
        base = self.url.rstrip("/")
        path = "/generate" if self.kind == "sglang" else "/v1/completions"
        return base if base.endswith(path) else base + path

    def body(self, prompt: str, max_new_tokens: int) -> dict[str, Any]:
        if self.kind == "sglang":
            params = {"max_new_tokens": max_new_tokens, "temperature": 0}
            return {"text": prompt, "sampling_params": params}
        body: dict[str, Any] = {"prompt": prompt, "max_tokens": max_new_tokens, "temperature": 0}
        if self.model:
            body["model"] = self.model
        return body

    def send(self, prompt: str, max_new_tokens: int) -> Reply:
        data = json.dumps(self.body(prompt, max_new_tokens)).encode()
        request = urllib.request.Request(
            self.endpoint(), data, {"Content-Type": "application/json"}
        )
        started = time.monotonic()
        try:
            with urllib.request.urlopen(request, timeout=self.timeout) as response:
                status, raw = response.status, response.read()
        except urllib.error.HTTPError as exc:  # an error status is an answer, not a failure
            return Reply(exc.code, "", None, time.monotonic() - started)
        except TimeoutError as exc:
            raise ProbeError(f"no answer within {self.timeout:g} s from {self.endpoint()}") from exc
        except (urllib.error.URLError, OSError) as exc:
            raise ProbeError(f"cannot reach {self.endpoint()}: {exc}") from exc
        seconds = time.monotonic() - started
        return self.parse(status, raw, seconds)

    def parse(self, status: int, raw: bytes, seconds: float) -> Reply:
        try:
            payload = json.loads(raw)
        except ValueError:
            raise ProbeError(
                f"HTTP {status} from {self.endpoint()} is not JSON: {raw[:80]!r}"
            ) from None
        if not isinstance(payload, dict):
            raise ProbeError(f"HTTP {status}: expected a JSON object, got {type(payload).__name__}")
        if self.kind == "sglang":
            text, meta = payload.get("text"), payload.get("meta_info")
            if not isinstance(meta, dict) or not isinstance(text, str):
                raise ProbeError(f"HTTP {status}: the reply lacks 'text' or 'meta_info'")
            tokens = meta.get("prompt_tokens")
        else:
            choices, usage = payload.get("choices"), payload.get("usage")
            if not (isinstance(choices, list) and choices and isinstance(choices[0], dict)):
                raise ProbeError(f"HTTP {status}: the reply lacks 'choices'")
            text = choices[0].get("text", "")
            if not isinstance(usage, dict) or not isinstance(text, str):
                raise ProbeError(f"HTTP {status}: the reply lacks 'usage'")
            tokens = usage.get("prompt_tokens")
        if not isinstance(tokens, int):
            raise ProbeError(f"HTTP {status}: the reply does not report prompt_tokens")
        return Reply(status, text, tokens, seconds)


@dataclass(frozen=True)
class Sizing:
    """A line y = per_word * x + fixed: reported prompt tokens against filler words (and, in
    :func:`expected_seconds`, reply microseconds against prompt tokens)."""

    per_word: float
    fixed: float

    def words_for(self, tokens: int) -> int:
        return max(1, math.ceil((tokens - self.fixed) / self.per_word))

    def tokens_for(self, words: int) -> float:
        return self.per_word * words + self.fixed


def fit(points: Sequence[tuple[int, int]]) -> Sizing:
    """Least-squares line through (filler words, reported prompt tokens)."""
    if len({w for w, _ in points}) < 2:
        raise ProbeError("calibration needs two prompts of different lengths")
    n = len(points)
    mean_w = sum(w for w, _ in points) / n
    mean_t = sum(t for _, t in points) / n
    cov = sum((w - mean_w) * (t - mean_t) for w, t in points)
    var = sum((w - mean_w) ** 2 for w, _ in points)
    slope = cov / var
    if slope <= 0:
        raise ProbeError("the server's prompt_tokens does not grow with the prompt")
    return Sizing(slope, mean_t - slope * mean_w)


def aim(pool_tokens: int, context_length_tokens: int) -> int:
    """The middle of the unsafe band (pool, context]; an error when there is no band."""
    if context_length_tokens <= pool_tokens:
        raise ProbeError(
            f"no unsafe band: the pool ({pool_tokens:,}) holds the whole context "
            f"({context_length_tokens:,}); nothing to probe"
        )
    return pool_tokens + max(1, (context_length_tokens - pool_tokens) // 2)


def is_loopback(url: str) -> bool:
    host = urllib.parse.urlsplit(url).hostname or ""
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


@dataclass
class Report:
    url: str
    status: int = 0
    verdict: str = ""
    target_tokens: int = 0
    filler_words: int = 0
    prompt_tokens: int | None = None
    landed_off_by_tokens: int | None = None
    seconds: float = 0.0
    expected_seconds: float | None = None
    too_fast: bool = False
    markers_planted: int = 0
    leaked_markers: list[str] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)

    @property
    def refused(self) -> bool:
        return 400 <= self.status < 500

    @property
    def exit_code(self) -> int:
        if self.leaked_markers:
            return EXIT_LEAKED
        return EXIT_SAFE if self.refused else EXIT_ANSWERED


class Progress:
    """One status line on a terminal's stderr; silent under --json or when not on a terminal."""

    def __init__(self, enabled: bool) -> None:
        self.enabled = enabled

    def __call__(self, message: str) -> None:
        if self.enabled:
            sys.stderr.write(f"\r\x1b[2K{message}")
            sys.stderr.flush()

    def done(self) -> None:
        if self.enabled:
            sys.stderr.write("\r\x1b[2K")
            sys.stderr.flush()


#: The share of a known pool that the probe's own sizing prompts stay under: a prompt in the
#: band (over the pool) would itself be rejected at intake, and leak on a vulnerable release.
IN_POOL = 0.9


def calibrate(api: Api, progress: Callable[[str], None], pool_tokens: int | None = None) -> Sizing:
    """Fit tokens per filler word from short prompts (the probe has no tokenizer). With the
    pool's size known, a longer prompt goes only where the fit so far puts it inside the pool
    (a 1,024-word prompt is past a pool of 1,024 tokens)."""
    points: list[tuple[int, int]] = []
    for words in (16, 64, 256, 1024):
        if (
            pool_tokens
            and len(points) >= 2
            and fit(points).tokens_for(words) > pool_tokens * IN_POOL
        ):
            break
        progress(f"calibrating the size: {words} words")
        reply = api.send(FILLER_WORD * words + TAIL, 1)
        if reply.status >= 400 or reply.prompt_tokens is None:
            raise ProbeError(f"calibration prompt of {words} words got HTTP {reply.status}")
        points.append((words, reply.prompt_tokens))
    return fit(points)


def expected_seconds(
    api: Api,
    sizing: Sizing,
    target_tokens: int,
    progress: Callable[[str], None],
    pool_tokens: int | None = None,
) -> float | None:
    """What a reply to ``target_tokens`` should take, from a line through the fastest of two
    replies to each of three shorter prompts asking as many new tokens. The shorter prompts stay
    inside the pool when its size is known (a prompt in the band would itself leak), else at a
    quarter of the target at most. Real prefill grows faster than linearly with length, so the
    line underestimates: a reply faster than half of it did not read its prompt."""
    shares = (8, 4, 2) if pool_tokens else (16, 8, 4)
    limit = int(pool_tokens * IN_POOL) if pool_tokens else target_tokens
    timings: list[tuple[int, int]] = []
    for share in shares:
        words = sizing.words_for(max(16, min(limit, target_tokens // share)))
        best: Reply | None = None
        for attempt in (1, 2):
            progress(f"timing replies: {words} words ({attempt}/2)")
            reply = api.send(FILLER_WORD * words + TAIL, NEW_TOKENS)
            if reply.status >= 400 or reply.prompt_tokens is None:
                return None
            if best is None or reply.seconds < best.seconds:
                best = reply
        assert best is not None and best.prompt_tokens is not None
        timings.append((best.prompt_tokens, round(best.seconds * 1e6)))
    try:
        line = fit(timings)
    except ProbeError:
        return None
    return line.tokens_for(target_tokens) / 1e6


def probe(
    api: Api,
    url: str,
    target_tokens: int,
    *,
    markers: int = 16,
    marker_repeats: int = 2000,
    count_tokens: Callable[[str], int] | None = None,
    progress: Callable[[str], None] = lambda _m: None,
    pool_tokens: int | None = None,
) -> Report:
    """The probe itself: calibrate, plant markers, send the long prompt, read the reply."""
    report = Report(url=url, target_tokens=target_tokens)
    sizing = calibrate(api, progress, pool_tokens)
    if count_tokens is not None:  # a local tokenizer: size exactly instead of by the fit
        words = sizing.words_for(target_tokens)
        while count_tokens(FILLER_WORD * words + TAIL) < target_tokens:
            words += max(1, words // 100)
        report.filler_words = words
    else:
        report.filler_words = sizing.words_for(target_tokens)
    planted = ["CANARY-" + secrets.token_hex(6) for _ in range(markers)]
    for i, marker in enumerate(planted, 1):
        progress(f"planting markers: {i}/{markers}")
        api.send(("Remember the code " + marker + ". ") * marker_repeats, NEW_TOKENS)
    report.markers_planted = len(planted)
    expected = expected_seconds(api, sizing, target_tokens, progress, pool_tokens)
    progress(f"sending the long prompt (~{target_tokens:,} tokens); this can take minutes")
    reply = api.send(FILLER_WORD * report.filler_words + TAIL, NEW_TOKENS)
    report.status, report.seconds, report.prompt_tokens = (
        reply.status,
        reply.seconds,
        reply.prompt_tokens,
    )
    if reply.prompt_tokens is not None:
        report.landed_off_by_tokens = reply.prompt_tokens - target_tokens
    if expected is not None:
        report.expected_seconds = expected
        report.too_fast = reply.status < 400 and reply.seconds < TOO_FAST_SHARE * expected
    report.leaked_markers = [m for m in planted if m in reply.text]
    if report.leaked_markers:
        report.verdict = "LEAK: the reply holds another request's marker"
    elif report.refused:
        report.verdict = "safe: the over-length prompt was refused"
    elif report.status >= 500:
        report.verdict = (
            f"NOT REFUSED: the engine let the over-length prompt through and then failed it "
            f"(HTTP {report.status}); nothing leaked, but the engine needs the fix"
        )
    else:
        report.verdict = "VULNERABLE: an over-length prompt was answered"
    if report.too_fast:
        report.notes.append(
            "the reply came much faster than a prefill of this length takes: "
            "the prompt was not read, yet it was answered"
        )
    return report


def render(report: Report) -> str:
    lines = [
        f"kvwatch probe {report.url}",
        f"  long prompt: aimed at {report.target_tokens:,} tokens with "
        f"{report.filler_words:,} filler words",
        f"  HTTP status: {report.status}",
    ]
    if report.prompt_tokens is not None:
        lines.append(
            f"  prompt_tokens reported: {report.prompt_tokens:,} "
            f"({report.landed_off_by_tokens:+,} from the aim)"
        )
    expected = report.expected_seconds
    timing = f"  latency: {report.seconds:.2f} s"
    if expected is not None:
        timing += f" (a reply to a prompt this long should take at least {expected:.2f} s)"
    lines.append(timing)
    lines.append(
        f"  markers planted: {report.markers_planted}, leaked: {len(report.leaked_markers)}"
    )
    lines.extend(f"  leaked marker: {m}" for m in report.leaked_markers)
    lines.extend(f"  note: {n}" for n in report.notes)
    lines.append(f"verdict: {report.verdict}")
    return "\n".join(lines)


def load_tokenizer(path: str) -> Callable[[str], int]:
    try:
        from tokenizers import Tokenizer
    except ImportError:
        raise ProbeError(
            "--tokenizer needs the 'tokenizers' package: pip install tokenizers"
        ) from None
    try:
        tokenizer = Tokenizer.from_file(path)
    except Exception as exc:
        raise ProbeError(f"cannot load tokenizer {path}: {exc}") from None
    return lambda text: len(tokenizer.encode(text).ids)


def target_from_args(args: argparse.Namespace) -> tuple[int, int | None]:
    """The prompt length to send, and the pool size when known."""
    if args.prompt_tokens:
        return int(args.prompt_tokens), args.pool_tokens
    if args.pool_tokens and args.context_length_tokens:
        return aim(args.pool_tokens, args.context_length_tokens), args.pool_tokens
    if args.from_logs:
        from kvwatch.commands.check_logs import smallest_band_from_files

        pool, context = smallest_band_from_files(args.from_logs)
        return aim(pool, context), pool
    raise ProbeError(
        "say how long: --prompt-tokens, --pool-tokens with --context-length, or --from-logs"
    )


def add_parser(commands: Any) -> argparse.ArgumentParser:
    from kvwatch.commands.clihelp import Formatter, number

    tokens = number(1, 1 << 30, whole=True)

    parser: argparse.ArgumentParser = commands.add_parser(
        "probe",
        help="send the marker test (does a long prompt read others' KV?) to a deployment you own",
        description=__doc__.replace("``", "'"),
        formatter_class=Formatter,
        epilog="examples:\n  kvwatch probe --url http://127.0.0.1:8000 --from-logs prefill.log\n"
        "  kvwatch probe --url http://127.0.0.1:8000 --pool-tokens 16384 --context-length 32768",
    )
    parser.set_defaults(_parser=parser)
    parser.add_argument("--url", required=True, help="the router, e.g. http://127.0.0.1:8000")
    parser.add_argument(
        "--api", choices=["sglang", "openai"], default="sglang", help="the router's API"
    )
    parser.add_argument("--model", help="model name for --api openai (default: none)")
    size = parser.add_argument_group("sizing (one of)")
    size.add_argument("--prompt-tokens", type=tokens, help="send a prompt of this many tokens")
    size.add_argument(
        "--pool-tokens", type=tokens, help="the KV pool, in tokens (with --context-length)"
    )
    size.add_argument(
        "--context-length",
        dest="context_length_tokens",
        type=tokens,
        help="the advertised context length, in tokens",
    )
    size.add_argument(
        "--from-logs", nargs="+", metavar="FILE", help="engine logs to read pool and context from"
    )
    parser.add_argument(
        "--tokenizer", help="a local Hugging Face tokenizer.json (default: calibrate)"
    )
    parser.add_argument(
        "--markers",
        type=number(1, 1024, whole=True),
        default=16,
        help="marker requests planted before the long prompt",
    )
    parser.add_argument(
        "--marker-repeats",
        type=number(1, 1 << 20, whole=True),
        default=2000,
        help="times each marker is repeated",
    )
    parser.add_argument(
        "--timeout",
        type=number(0, 86400, above=True, unit="s"),
        default=1800.0,
        help="seconds per request",
    )
    parser.add_argument("--json", action="store_true", help="the report as JSON")
    parser.add_argument(
        "--i-own-this-deployment",
        action="store_true",
        help="required for any URL that is not on loopback",
    )
    return parser


def url_problem(url: str) -> str | None:
    """Why ``--url`` cannot be probed, or None."""
    parts = urllib.parse.urlsplit(url)
    if parts.scheme not in ("http", "https") or not parts.hostname:
        return f"--url {url!r} is not an HTTP URL (expected e.g. http://127.0.0.1:8000)"
    try:
        parts.port  # noqa: B018 (raises on a bad port)
    except ValueError:
        return f"--url {url!r} has a bad port"
    return None


def run(args: argparse.Namespace) -> int:
    problem = url_problem(args.url)
    if problem:
        print(f"kvwatch probe: {problem}", file=sys.stderr)
        return EXIT_USAGE
    if not is_loopback(args.url) and not args.i_own_this_deployment:
        print(
            f"kvwatch probe: refusing to probe {args.url}: it is not on loopback. Run it only "
            "against a deployment you own, and say so with --i-own-this-deployment.",
            file=sys.stderr,
        )
        return EXIT_USAGE
    try:
        target, pool = target_from_args(args)
    except ProbeError as exc:  # no sizing given, or logs that do not size it: usage
        print(f"kvwatch probe: {exc}", file=sys.stderr)
        return EXIT_USAGE
    except (OSError, ValueError) as exc:
        print(f"kvwatch probe: --from-logs: {exc}", file=sys.stderr)
        return EXIT_USAGE
    progress = Progress(enabled=not args.json and sys.stderr.isatty())
    api = HttpApi(args.url, args.api, args.timeout, args.model)
    try:
        counter = load_tokenizer(args.tokenizer) if args.tokenizer else None
        report = probe(
            api,
            args.url,
            target,
            markers=args.markers,
            marker_repeats=args.marker_repeats,
            count_tokens=counter,
            progress=progress,
            pool_tokens=pool,
        )
    except ProbeError as exc:
        progress.done()
        if args.json:
            print(json.dumps({"url": args.url, "verdict": "error", "error": str(exc)}))
        else:
            print(f"kvwatch probe: {exc}", file=sys.stderr)
        return EXIT_FAILED
    progress.done()
    print(
        json.dumps(asdict(report) | {"exit_code": report.exit_code})
        if args.json
        else render(report)
    )
    return report.exit_code
