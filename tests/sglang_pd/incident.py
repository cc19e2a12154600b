"""The incident's deployment for tests/sglang_pd: a prefill pool smaller than the context.

Prefill holds :data:`PREFILL_POOL` tokens and advertises :data:`CONTEXT`: a prompt between the
two passes the context check and is rejected at prefill's intake (a one-token stub, ``to_finish``
set). Decode's pool holds the whole context, so decode reserves pages for the whole prompt.
With 0.5.19's admission doors (``release_0_5_19``, the ``admit_0_5_19`` plugin) the rejected
request goes on: prefill transfers the stub's one page and decode reads all the pages it
reserved, the rest holding what their last owner left there. With 0.5.23's own doors it is
refused (400). ``page_owners`` on every decode records which request's row held each page: the
ground truth that kvwatch's findings are checked against.
"""

from __future__ import annotations

import time
from collections.abc import Iterator
from contextlib import ExitStack, contextmanager
from dataclasses import dataclass
from pathlib import Path

from tests.sglang_pd.bed import (
    ROOT,
    START_TIMEOUT_S,
    Prefill,
    Process,
    only_loopback,
    router,
    serving,
    sglang_server,
    stop_all,
)

#: The incident's shape at a quarter of the sizes first used (prefill's pool 4,096, the context
#: 8,192): the same band, a sixteenth of the attention to compute, so that the incident fits
#: the stage's time over both transports.
PREFILL_POOL = 1024
CONTEXT = 2048
#: SGLang's decode allocator hands out its never-used pages in order and merges the freed ones
#: back, sorted, only when those run short; then the lowest go first. Everything
#: ``kvwatch probe`` sends before its long prompt (with SGLang's health checks and the router's
#: warm-up, about 400 pages of 16: 6,400 tokens) fits in never-used pages and the long prompt
#: (97 pages) does not, so it takes the lowest pages: the calibration prompts' and the first
#: marker's. (With a decode pool of 4,096 the timing prompts ran short first and took the
#: lowest pages, over the markers': the long prompt read filler, no marker.) Inside that
#: window (6,400 to 7,950).
DECODE_POOL = 7200
#: The model that recites what its KV holds (make_recite_model.py): a marker in the KV a
#: request reads comes back in its text.
RECITE_MODEL = ROOT / "build" / "sglang-pd-recite-model"
SIZES = ["--model-path", str(RECITE_MODEL), "--context-length", str(CONTEXT)]


@dataclass
class Deployment:
    transport: str
    workdir: Path
    prefills: dict[str, Prefill]  # by release: "0.5.19" (the overlay), "0.5.23"
    decodes: dict[str, Process]  # by name
    #: Without kvwatch, by release (each in front of that release's prefill and the decode);
    #: with kvwatch, by decode (each in front of the 0.5.19 prefill and that decode).
    routers: dict[str, Process]

    def owners_file(self, decode: str) -> Path:
        return self.workdir / f"owners-{decode}.jsonl"

    def spool(self, name: str) -> Path:
        return self.workdir / f"spool-{name}"

    def processes(self) -> list[Process]:
        servers = [p.server for p in self.prefills.values()]
        return [*servers, *self.decodes.values(), *self.routers.values()]


def _prefill(workdir: Path, transport: str, release: str, kvwatch: bool) -> Prefill:
    plugins = ["kvwatch"] if kvwatch else []
    plugins += ["cpu_bed"] + (["admit_0_5_19"] if release == "0.5.19" else [])
    server, _, bootstrap = sglang_server(
        f"prefill-{release}",
        workdir,
        role="prefill",
        transport=transport,
        plugins=",".join(plugins),
        extra=[*SIZES, "--max-total-tokens", str(PREFILL_POOL)],
    )
    return Prefill(server, bootstrap)


def _decode(workdir: Path, transport: str, name: str, mode: str | None) -> Process:
    plugins = (["kvwatch"] if mode else []) + ["cpu_bed", "page_owners"]
    server, _, _ = sglang_server(
        name,
        workdir,
        role="decode",
        transport=transport,
        mode=mode or "off",
        plugins=",".join(plugins),
        extra=[*SIZES, "--max-total-tokens", str(DECODE_POOL)],
    )
    server.env["KVWATCH_BED_OWNERS"] = str(workdir / f"owners-{name}.jsonl")
    return server


@contextmanager
def deployment(transport: str, workdir: Path, *, kvwatch: bool) -> Iterator[Deployment]:
    """Without kvwatch: a 0.5.19 and a 0.5.23 prefill, one decode, an smg router for each
    release. With kvwatch (log on prefill): the 0.5.19 prefill, a log and an enforce decode, an
    smg router for each decode."""
    assert only_loopback(), "run the bed inside a loopback-only netns (tests/sglang_pd/run.sh)"
    if kvwatch:
        prefills = {"0.5.19": _prefill(workdir, transport, "0.5.19", kvwatch=True)}
        decodes = {
            f"decode-{m}": _decode(workdir, transport, f"decode-{m}", m) for m in ("log", "enforce")
        }
        fronted = {name: (prefills["0.5.19"], decode) for name, decode in decodes.items()}
    else:
        prefills = {r: _prefill(workdir, transport, r, kvwatch=False) for r in ("0.5.19", "0.5.23")}
        decodes = {"bare": _decode(workdir, transport, "decode-bare", None)}
        fronted = {release: (prefill, decodes["bare"]) for release, prefill in prefills.items()}
    routers = {}
    for name, (prefill, decode) in fronted.items():
        routers[name] = router(workdir, prefill.server, prefill.bootstrap, decode)
        routers[name].name = f"router-{name}"
    bed = Deployment(transport, workdir, prefills, decodes, routers)
    with ExitStack() as stack:
        stack.callback(stop_all, bed.processes())
        servers = [*[p.server for p in prefills.values()], *decodes.values()]
        for server in servers:
            server.start()
        deadline = time.monotonic() + START_TIMEOUT_S
        for server in servers:
            server.wait_ready(deadline)
        for front in routers.values():
            front.start()
        for front in routers.values():
            serving(front)
        yield bed
