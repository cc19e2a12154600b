"""Hook-mutation check: remove one engine hook at a time, run the adapter's tests, and require
every such mutant to fail at least one of them (a hook no test misses is a hook no test checks).

Each engine adapter lists its mutants in ``tests/<engine>/mutants.py``, whose ``mutants()``
returns ``(name, argv)`` pairs: the hook removed and the command that runs the adapter's tests
with it removed; the first pair is the baseline (nothing removed), which must pass. Usage::

    <engine venv>/bin/python tests/mutation.py vllm

Prints the table (mutant, tests failed, first failing test, killed) and exits non-zero when the
baseline fails or any mutant survives. The baseline runs first and alone; the mutants then run
``KVWATCH_MUTATION_JOBS`` at a time (default: one per CPU this process may use), each in its own
interpreter with one torch thread, since most of a mutant's time is one core importing the
engine. A mutant is killed when pytest fails a test or hangs; a run that does neither (a crash,
a usage error, nothing collected) fails the check.
"""

from __future__ import annotations

import importlib.util
import os
import subprocess
import sys
import tempfile
import time
import xml.etree.ElementTree as ET
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
BASELINE = "(none removed)"
if sys.path and Path(sys.path[0]).resolve() == ROOT / "tests":
    # Run as a script: tests/ first on the path would shadow the repo's packages with the test
    # directories of the same names (tests/engine_hooks).
    sys.path[0] = str(ROOT)


@dataclass(frozen=True)
class Mutant:
    name: str  # the hook removed; BASELINE for the unmutated run
    argv: list[str]  # runs the tests with the hook removed; pytest's --junitxml is appended


@dataclass(frozen=True)
class Result:
    name: str
    failed: int
    first: str
    seconds: float
    killed: bool
    #: The run neither passed nor failed a test (a crash, a usage error, no test collected):
    #: no evidence either way, so the check fails.
    broken: bool = False


def run(mutant: Mutant, timeout: float, env: dict[str, str] | None = None) -> Result:
    with tempfile.TemporaryDirectory() as tmp:
        report = Path(tmp) / "report.xml"
        start = time.monotonic()
        try:
            proc = subprocess.run(
                [*mutant.argv, f"--junitxml={report}"],
                cwd=ROOT,
                stdout=subprocess.DEVNULL,
                stderr=subprocess.DEVNULL,
                timeout=timeout,
                check=False,
                env=env,
            )
            code: int | None = proc.returncode
        except subprocess.TimeoutExpired:
            code = None
        seconds = time.monotonic() - start
        failed, first = _failures(report)
    if code is None:  # a hook removed that makes the tests hang: they did not pass
        return Result(mutant.name, failed, "(timed out)", seconds, True)
    if code == 1 and failed:  # pytest's "tests failed", and the report names them
        return Result(mutant.name, failed, first, seconds, True)
    if code == 0:
        return Result(mutant.name, failed, first, seconds, False)
    # A crash (killed for memory, say), a usage error, nothing collected: not a kill.
    return Result(mutant.name, failed, f"(pytest exit {code})", seconds, False, broken=True)


def _failures(report: Path) -> tuple[int, str]:
    if not report.exists():
        return 0, ""
    failed = [
        # classname is the dotted module path; the test name may hold dots in its parameters.
        f"{case.get('classname', '').rsplit('.', 1)[-1]}::{case.get('name', '')}"
        for case in ET.parse(report).getroot().iter("testcase")
        if case.find("failure") is not None or case.find("error") is not None
    ]
    return len(failed), (failed[0] if failed else "")


def outcome(result: Result) -> str:
    """The run's word on the progress line: a run stopped from outside (a signal) or crashed
    neither passed nor failed a test, and says so."""
    return "broken" if result.broken else "killed" if result.killed else "passed"


def table(results: list[Result]) -> str:
    rows = [("mutant", "tests failed", "first failing test", "seconds", "killed")]
    for r in results:
        killed = "-" if r.name == BASELINE else ("yes" if r.killed else "NO")
        killed = "ERROR" if r.broken else killed
        rows.append((r.name, str(r.failed), r.first or "-", f"{r.seconds:.0f}", killed))
    widths = [max(len(row[i]) for row in rows) for i in range(len(rows[0]))]
    lines = ["  ".join(cell.ljust(w) for cell, w in zip(row, widths, strict=True)) for row in rows]
    lines.insert(1, "  ".join("-" * w for w in widths))
    return "\n".join(lines)


def load(engine: str) -> list[Mutant]:
    path = ROOT / "tests" / engine / "mutants.py"
    spec = importlib.util.spec_from_file_location(f"{engine}_mutants", path)
    if spec is None or spec.loader is None:
        raise SystemExit(f"mutation: no {path}")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    pairs: list[tuple[str, list[str]]] = module.mutants()
    return [Mutant(name, argv) for name, argv in pairs]


def main(argv: list[str]) -> int:
    if len(argv) != 1:
        print("usage: mutation.py ENGINE", file=sys.stderr)
        return 2
    mutants = load(argv[0])
    jobs = int(os.environ.get("KVWATCH_MUTATION_JOBS") or len(os.sched_getaffinity(0)))
    # One torch thread per interpreter: two mutants on two cores, not four threads fighting;
    # the baseline runs so too, so that it passes in the mutants' environment.
    env = dict(os.environ, OMP_NUM_THREADS="1") if jobs > 1 else None
    baseline = run(mutants[0], timeout=900, env=env)
    print(f"mutation: {baseline.name}: {outcome(baseline)}", flush=True)
    if baseline.killed or baseline.broken:
        print(table([baseline]))
        print("mutation: the tests fail with nothing removed", file=sys.stderr)
        return 1

    def one(mutant: Mutant) -> Result:
        result = run(mutant, timeout=900, env=env)
        print(f"mutation: {result.name}: {outcome(result)}", flush=True)
        return result

    with ThreadPoolExecutor(max(1, jobs)) as pool:
        results = [baseline, *pool.map(one, mutants[1:])]
    print(table(results))
    broken = [r.name for r in results if r.broken]
    if broken:
        print(f"mutation: {len(broken)} run(s) neither passed nor failed a test: {broken}")
        return 1
    survivors = [r.name for r in results if r.name != BASELINE and not r.killed]
    if survivors:
        print(f"mutation: {len(survivors)} hook(s) removed with no test failing: {survivors}")
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
