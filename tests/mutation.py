"""Hook-mutation check: remove one hook of an engine adapter at a time and run the adapter's tests;
every mutant must fail at least one test. A hook whose removal no test notices is untested.

An adapter describes its mutants (``tests/<engine>/mutants.py``): a name, how to apply it inside
a test process, and the targeted tests to run (the ones that should notice, first, so a killed
mutant stops early under ``-x``). This driver runs an unmutated baseline first (it must pass:
otherwise every mutant would look killed), then each mutant, and prints the table.

Speed: the parent imports the engine once (``prepare``) and forks one child per mutant, so each
mutant pays for its tests, not for importing the engine again. Where forking is not safe (the
parent already runs threads) each mutant gets a fresh interpreter instead.
"""

from __future__ import annotations

import os
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import pytest


@dataclass(frozen=True)
class Mutant:
    name: str
    #: Applies the mutation in the current process (before any test runs).
    apply: Callable[[], None]
    #: pytest arguments: test files or node ids, the ones that should kill it first.
    tests: tuple[str, ...]
    #: Why no test can kill it here; such a mutant is listed, not run, and not a pass.
    exempt: str = ""


@dataclass
class Outcome:
    name: str
    failed: int
    code: int
    seconds: float
    killed: bool = field(init=False)

    def __post_init__(self) -> None:
        # 1: tests failed. Anything else (2 interrupted, 3 internal error, 4 usage, 5 no tests
        # collected, or a crash) is not a kill: the check itself is broken.
        self.killed = self.code == 1 and self.failed > 0


class _Failures:
    """A pytest plugin that counts failed tests (setup, call or teardown)."""

    def __init__(self) -> None:
        self.failed = 0

    def pytest_runtest_logreport(self, report: Any) -> None:
        if report.failed:
            self.failed += 1


PYTEST_ARGS = ("-x", "-q", "-p", "no:cacheprovider", "-W", "ignore")


def _run_tests(mutant: Mutant | None, tests: Sequence[str]) -> tuple[int, int]:
    """In this process: apply the mutant, run the tests; (exit code, failed tests)."""
    if mutant is not None:
        mutant.apply()
    counter = _Failures()
    code = pytest.main([*PYTEST_ARGS, "--no-header", "--tb=no", *tests], plugins=[counter])
    return int(code), counter.failed


def _in_child(mutant: Mutant | None, tests: Sequence[str]) -> tuple[int, int]:
    """Fork, run the tests in the child, report (code, failed) through a pipe."""
    read, write = os.pipe()
    sys.stdout.flush()
    sys.stderr.flush()
    pid = os.fork()
    if pid == 0:  # the child: never returns into the parent's code
        os.close(read)
        result = (3, 0)
        try:
            devnull = os.open(os.devnull, os.O_WRONLY)
            os.dup2(devnull, 1)  # the table is the output; a failing test's detail is not
            result = _run_tests(mutant, tests)
        finally:
            os.write(write, f"{result[0]} {result[1]}".encode())
            os.close(write)
            os._exit(0)
    os.close(write)
    with os.fdopen(read) as pipe:
        text = pipe.read().split()
    os.waitpid(pid, 0)
    if len(text) != 2:
        return 3, 0  # the child died before reporting
    return int(text[0]), int(text[1])


def _in_subprocess(module: str, name: str | None, tests: Sequence[str]) -> tuple[int, int]:
    """A fresh interpreter runs ``python -m tests.mutation MODULE --one NAME``."""
    args = [sys.executable, "-m", "tests.mutation", module, "--one", name or ""]
    done = subprocess.run(
        [*args, "--", *tests], capture_output=True, text=True, check=False, timeout=1800
    )
    last = (done.stdout.strip().splitlines() or ["3 0"])[-1].split()
    return (int(last[0]), int(last[1])) if len(last) == 2 else (3, 0)


def check(
    module: str,
    mutants: Sequence[Mutant],
    baseline: Sequence[str],
    prepare: Callable[[], None] | None = None,
) -> int:
    """Baseline, then every mutant; print the table; 0 when every mutant was killed."""
    if prepare is not None:
        prepare()
    fork = hasattr(os, "fork") and threading.active_count() == 1

    def run(mutant: Mutant | None, tests: Sequence[str]) -> Outcome:
        started = time.monotonic()
        if fork:
            code, failed = _in_child(mutant, tests)
        else:
            code, failed = _in_subprocess(module, mutant and mutant.name, tests)
        name = mutant.name if mutant is not None else "(none: baseline)"
        return Outcome(name, failed, code, time.monotonic() - started)

    base = run(None, baseline)
    if base.code != 0:
        print(f"mutation check: the baseline fails (pytest exit {base.code}); fix that first")
        return 1
    outcomes = [run(m, m.tests) for m in mutants if not m.exempt]
    exempt = [m for m in mutants if m.exempt]
    width = max(len(m.name) for m in mutants)
    print(f"\n{'MUTANT (hook removed)'.ljust(width)}  TESTS FAILED  KILLED  SECONDS")
    for o in outcomes:
        failed = str(o.failed) if o.code in (0, 1) else f"error {o.code}"
        killed = "yes" if o.killed else "NO"
        print(f"{o.name.ljust(width)}  {failed:>12}  {killed:>6}  {o.seconds:7.1f}")
    for m in exempt:
        print(f"{m.name.ljust(width)}  {'-':>12}  {'exempt':>6}  {m.exempt}")
    survivors = [o.name for o in outcomes if not o.killed]
    print(f"{len(outcomes) - len(survivors)}/{len(mutants)} mutants killed, {len(exempt)} exempt")
    print("(-x: a run stops at its first failing test, so TESTS FAILED counts up to that one)")
    if survivors:
        print("survived: " + ", ".join(survivors))
        return 1
    return 0


def main(argv: Sequence[str]) -> int:
    """``python -m tests.mutation MODULE`` runs MODULE's ``MUTANTS`` (``--one NAME -- TESTS``
    runs one mutant's tests here and prints ``CODE FAILED``: the no-fork fallback)."""
    import importlib

    module = importlib.import_module(argv[0])
    if len(argv) > 1 and argv[1] == "--one":
        name, tests = argv[2], argv[argv.index("--") + 1 :]
        mutant = next((m for m in module.MUTANTS if m.name == name), None)
        code, failed = _run_tests(mutant, tests)
        print(f"{code} {failed}")
        return 0
    return check(argv[0], module.MUTANTS, module.BASELINE, getattr(module, "prepare", None))


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
