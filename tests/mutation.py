"""Hook-mutation check: remove one engine hook at a time, run the adapter's tests, and require
every such mutant to fail at least one of them (a hook no test misses is a hook no test checks).

Each engine adapter lists its mutants in ``tests/<engine>/mutants.py``, whose ``mutants()``
returns ``(name, argv)`` pairs: the hook removed and the command that runs the adapter's tests
with it removed; the first pair is the baseline (nothing removed), which must pass. Usage::

    <engine venv>/bin/python tests/mutation.py vllm

Prints the table (mutant, tests failed, first failing test, killed) and exits non-zero when the
baseline fails or any mutant survives. The baseline runs first and alone; the mutants then run
``KVWATCH_MUTATION_JOBS`` at a time (default: one per CPU this process may use), with one torch
thread each. The engine modules the mutants module names (``WARM``) are imported once, here;
each run is then a forked child of this interpreter that removes its hook and calls the module's
``main`` (pytest), so no run pays for importing the engine again (half of a run's time when each
had its own interpreter). Should that import leave a thread behind, forking is unsafe and each
run gets a fresh interpreter instead (the command ``mutants()`` gives). A mutant is killed when
pytest fails a test or hangs; a run that does neither (a crash, a usage error, nothing collected)
fails the check.
"""

from __future__ import annotations

import importlib
import importlib.util
import os
import signal
import subprocess
import sys
import tempfile
import threading
import time
import warnings
import xml.etree.ElementTree as ET
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
BASELINE = "(none removed)"
TIMEOUT_S = 900.0  # one run
#: A mutants module's in-process entry: ``main([name, "--", pytest args...])``, pytest's code.
Entry = Callable[[list[str]], int]
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


class Job:
    """One mutant's run: a forked child of this warm interpreter (the engine imported once, here),
    or a fresh interpreter (``subprocess``) where forking is not safe."""

    def __init__(self, mutant: Mutant, entry: Entry | None) -> None:
        self.mutant = mutant
        self.tmp = tempfile.TemporaryDirectory()
        self.report = Path(self.tmp.name) / "report.xml"
        self.start = time.monotonic()
        self.proc: subprocess.Popen[bytes] | None = None
        self.pid = 0
        argv = [*mutant.argv, f"--junitxml={self.report}"]
        if entry is None:
            self.proc = subprocess.Popen(
                argv, cwd=ROOT, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL
            )
            return
        sys.stdout.flush()
        sys.stderr.flush()
        self.pid = os.fork()
        if self.pid == 0:  # the child: apply the mutant, run pytest, never return
            code = 3
            try:
                os.chdir(ROOT)
                devnull = os.open(os.devnull, os.O_WRONLY)
                os.dup2(devnull, 1)
                os.dup2(devnull, 2)
                code = int(entry(argv[2:]))  # [name, "--", tests..., --junitxml]
            finally:
                os._exit(code)

    def poll(self) -> int | None:
        if self.proc is not None:
            return self.proc.poll()
        pid, status = os.waitpid(self.pid, os.WNOHANG)
        return None if pid == 0 else os.waitstatus_to_exitcode(status)

    def kill(self) -> None:
        if self.proc is not None:
            self.proc.kill()
            self.proc.wait()
        else:
            os.kill(self.pid, signal.SIGKILL)
            os.waitpid(self.pid, 0)

    def result(self, code: int | None) -> Result:
        seconds = time.monotonic() - self.start
        failed, first = _failures(self.report)
        self.tmp.cleanup()
        name = self.mutant.name
        if code is None:  # a hook removed that makes the tests hang: they did not pass
            return Result(name, failed, "(timed out)", seconds, True)
        if code == 1 and failed:  # pytest's "tests failed", and the report names them
            return Result(name, failed, first, seconds, True)
        if code == 0:
            return Result(name, failed, first, seconds, False)
        # A crash (killed for memory, say), a usage error, nothing collected: not a kill.
        return Result(name, failed, f"(pytest exit {code})", seconds, False, broken=True)


def run(mutants: list[Mutant], jobs: int, timeout: float, entry: Entry | None) -> list[Result]:
    """Every mutant, ``jobs`` at a time, each stopped after ``timeout`` seconds; results in the
    mutants' order, each printed as it ends. No threads: forking from this process stays safe."""
    pending, running, done = list(mutants), list[Job](), dict[str, Result]()
    while pending or running:
        while pending and len(running) < jobs:
            running.append(Job(pending.pop(0), entry))
        time.sleep(0.1)
        for job in list(running):
            code = job.poll()
            if code is None and time.monotonic() - job.start <= timeout:
                continue
            if code is None:
                job.kill()
            running.remove(job)
            result = done[job.mutant.name] = job.result(code)
            print(f"mutation: {result.name}: {outcome(result)}", flush=True)
    return [done[m.name] for m in mutants]


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


def load(engine: str) -> tuple[list[Mutant], Entry | None]:
    """The engine's mutants, and its in-process entry (``main``) once the modules it names
    (``WARM``) are imported here, if that left this process forkable (one thread)."""
    path = ROOT / "tests" / engine / "mutants.py"
    spec = importlib.util.spec_from_file_location(f"{engine}_mutants", path)
    if spec is None or spec.loader is None:
        raise SystemExit(f"mutation: no {path}")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    pairs: list[tuple[str, list[str]]] = module.mutants()
    mutants = [Mutant(name, argv) for name, argv in pairs]
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        for name in module.WARM:
            importlib.import_module(name)
    if threading.active_count() > 1:
        print("mutation: the engine's import started threads: one interpreter per mutant")
        return mutants, None
    entry: Entry = module.main
    return mutants, entry


def main(argv: list[str]) -> int:
    if len(argv) != 1:
        print("usage: mutation.py ENGINE", file=sys.stderr)
        return 2
    jobs = int(os.environ.get("KVWATCH_MUTATION_JOBS") or len(os.sched_getaffinity(0)))
    # One torch thread per run: two mutants on two cores, not four threads fighting; set before
    # the engine's import, which every forked run inherits (the baseline runs so too, so that
    # it passes in the mutants' environment).
    if jobs > 1:
        os.environ["OMP_NUM_THREADS"] = "1"
    mutants, entry = load(argv[0])
    (baseline,) = run(mutants[:1], 1, TIMEOUT_S, entry)
    if baseline.killed or baseline.broken:
        print(table([baseline]))
        print("mutation: the tests fail with nothing removed", file=sys.stderr)
        return 1
    results = [baseline, *run(mutants[1:], max(1, jobs), TIMEOUT_S, entry)]
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
