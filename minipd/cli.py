"""``python -m minipd serve|demo``. Heavy imports wait until a command runs: spawned children
re-import the main module."""

from __future__ import annotations

import argparse
from collections.abc import Sequence

from minipd.config import Faults, ServeConfig
from minipd.releases import LATEST, RELEASES
from minipd.tokenizer import PIECE_BYTES


def _serve_parser(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    p = sub.add_parser("serve", allow_abbrev=False, help="start router, prefill and decode")
    p.add_argument("--host", default="127.0.0.1", help="router bind address")
    p.add_argument("--port", type=int, default=8000, help="router port (0: any free port)")
    p.add_argument("--prefill-port", type=int, default=0)
    p.add_argument("--decode-port", type=int, default=0)
    p.add_argument("--release", default=LATEST, choices=sorted(RELEASES))
    p.add_argument("--pool-tokens", type=int, default=16384, help="KV pool of each role")
    p.add_argument("--prefill-pool-tokens", type=int, default=None)
    p.add_argument("--decode-pool-tokens", type=int, default=None)
    p.add_argument("--page-size", type=int, default=16)
    p.add_argument("--context-length", type=int, default=32768)
    p.add_argument("--max-running-requests", type=int, default=64)
    p.add_argument("--layers", type=int, default=2)
    p.add_argument(
        "--ffn-width",
        type=int,
        default=0,
        help="a feed-forward block of this width per layer, so prefill costs what a wider model"
        " costs (0: attention only, the fastest)",
    )
    p.add_argument("--device", default="cpu", help="cpu or cuda")
    p.add_argument("--transfer-timeout", type=float, default=30.0)
    p.add_argument("--kv-hold-timeout", type=float, default=30.0)
    p.add_argument("--deferred-release", choices=["auto", "on", "off"], default="auto")
    p.add_argument("--kvwatch", choices=["off", "log", "enforce"], default="off")
    p.add_argument("--kvwatch-spool", default=None)
    p.add_argument(
        "--kvwatch-scrub",
        choices=["off", "on_free", "on_reserve"],
        default="off",
        help="zero KV pages when they return to the free list (on_free) or when decode reserves"
        " them for prefill's write (on_reserve); independent of --kvwatch (docs/scrub.md)",
    )
    p.add_argument("--log-dir", default=None)
    p.add_argument(
        "--tokenizer-piece-bytes",
        type=int,
        default=PIECE_BYTES,
        help="longest word piece one token holds (smaller: more tokens per word)",
    )
    p.add_argument("--fault-late-write", type=int, default=0, metavar="N")
    p.add_argument("--fault-late-write-delay", type=float, default=1.0, metavar="SECONDS")
    p.add_argument("--fault-drop-page", type=int, default=0, metavar="N")
    p.add_argument("--fault-bit-flip", type=int, default=0, metavar="N")
    p.add_argument("--fault-double-free", type=int, default=0, metavar="N")


def config_from(args: argparse.Namespace) -> ServeConfig:
    deferred = {"auto": None, "on": True, "off": False}[args.deferred_release]
    return ServeConfig(
        host=args.host,
        port=args.port,
        prefill_port=args.prefill_port,
        decode_port=args.decode_port,
        version=args.release,
        prefill_pool_tokens=args.prefill_pool_tokens or args.pool_tokens,
        decode_pool_tokens=args.decode_pool_tokens or args.pool_tokens,
        page_size=args.page_size,
        context_length=args.context_length,
        max_running_requests=args.max_running_requests,
        layers=args.layers,
        device=args.device,
        transfer_timeout=args.transfer_timeout,
        kv_hold_timeout=args.kv_hold_timeout,
        deferred_release=deferred,
        kvwatch=args.kvwatch,
        kvwatch_spool=args.kvwatch_spool,
        kvwatch_scrub=args.kvwatch_scrub,
        log_dir=args.log_dir,
        tokenizer_piece_bytes=args.tokenizer_piece_bytes,
        ffn_width=args.ffn_width,
        faults=Faults(
            late_write=args.fault_late_write,
            late_write_delay=args.fault_late_write_delay,
            drop_page=args.fault_drop_page,
            bit_flip=args.fault_bit_flip,
            double_free=args.fault_double_free,
        ),
    )


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        allow_abbrev=False, prog="python -m minipd", description=__doc__
    )
    sub = parser.add_subparsers(dest="command", required=True)
    _serve_parser(sub)
    demo = sub.add_parser(
        "demo", allow_abbrev=False, help="replay the incident's incident on 0.5.19 with kvwatch log"
    )
    demo.add_argument("--release", default="0.5.19", choices=sorted(RELEASES))
    demo.add_argument("--kvwatch", choices=["off", "log", "enforce"], default="log")
    demo.add_argument("--device", default="cpu", help="where the KV pools live: cpu or cuda")
    return parser


def _check(parser: argparse.ArgumentParser, cfg: ServeConfig) -> None:
    if cfg.page_size < 1 or cfg.layers < 1 or cfg.max_running_requests < 1:
        parser.error("--page-size, --layers and --max-running-requests must be at least 1")
    if min(cfg.prefill_pool_tokens, cfg.decode_pool_tokens) < cfg.page_size:
        parser.error("each KV pool needs at least one page")
    if cfg.context_length < 1 or cfg.transfer_timeout <= 0 or cfg.kv_hold_timeout <= 0:
        parser.error("--context-length and the timeouts must be positive")
    if cfg.ffn_width < 0:
        parser.error("--ffn-width must be >= 0")
    if not 1 <= cfg.tokenizer_piece_bytes <= PIECE_BYTES:
        parser.error(f"--tokenizer-piece-bytes must be in 1..{PIECE_BYTES}")


def main(argv: Sequence[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    if args.command == "serve":
        from minipd.supervisor import serve

        cfg = config_from(args)
        _check(parser, cfg)
        return serve(cfg)
    from minipd.demo import run_demo

    return run_demo(str(args.release), str(args.kvwatch), str(args.device))
