"""The vLLM half of the hook-mutation check (``tests/mutation.py vllm``).

A mutant removes one method that the kvwatch connector overrides from vLLM's
``KVConnectorBase_V1`` / ``SupportsHMA`` (scheduler and worker side alike; properties included)
or from ``KVConnectorWorkerMetadata``, exactly as deleting it from the source would: the class
then inherits vLLM's base method, and a removed abstract method leaves the class abstract. The
list is read off the classes, so a new override joins the check by itself.

Run as a script, it removes one method and runs the tests: ``mutants.py NAME -- PYTEST-ARGS``.
"""

from __future__ import annotations

import abc
import importlib
import sys
from collections.abc import Callable
from dataclasses import is_dataclass
from pathlib import Path
from typing import Any

BASELINE = "(none removed)"  # tests/mutation.py's name for the unmutated run
# The V1 runner path covers every hook; -x stops at the first failing test.
TESTS = [
    "tests/vllm/test_connector.py",
    "tests/vllm/test_pd.py",
    "tests/vllm/test_exposure.py",
    "tests/vllm/test_lease.py",
    "-x",
    "-q",
    "-k",
    "not v2",
]


def _noop(module: str, owner: str, attr: str) -> Callable[[], None]:
    """A mutant that turns ``owner.attr`` of ``module`` (a class, or "" for the module) into a
    no-op: the call stays, what it records is gone."""

    def apply() -> None:
        target: Any = importlib.import_module(module)
        if owner:
            target = getattr(target, owner)
        setattr(target, attr, lambda *args, **kwargs: None)

    return apply


def _no_scrub() -> None:
    """The connector builds its KVWatch without the ``scrub`` setting."""
    connector = importlib.import_module("engine_hooks.vllm.connector")
    real = connector.KVWatch

    def without(*args: Any, **kwargs: Any) -> Any:
        kwargs.pop("scrub", None)
        return real(*args, **kwargs)

    connector.KVWatch = without


#: The calls inside the hooks that record whose KV a block holds, and scrub: each, removed,
#: must make a test fail too. (The connector is KVWatch's only caller of ``wrote`` and
#: ``landed`` in these tests: the method made a no-op is the connector's call removed.)
CALLS: dict[str, Callable[[], None]] = {
    "call: SchedulerSide._forward_writes": _noop(
        "engine_hooks.vllm.scheduler", "SchedulerSide", "_forward_writes"
    ),
    "call: KVWatch.wrote": _noop("engine_hooks.watch", "KVWatch", "wrote"),
    "call: KVWatch.landed": _noop("engine_hooks.watch", "KVWatch", "landed"),
    "call: BlockLedger.evicted": _noop("engine_hooks.vllm.blocks", "BlockLedger", "evicted"),
    "call: KVWatch(scrub=...)": _no_scrub,
    # Prefill's side of an expired lease: NIXL's expiry record, and the finding it leads to.
    "call: LeaseWatch.attach": _noop("engine_hooks.vllm.lease", "LeaseWatch", "attach"),
    "call: KVWatch.freed_before_read": _noop("engine_hooks.watch", "KVWatch", "freed_before_read"),
}


def _classes() -> dict[str, tuple[type, tuple[type, ...]]]:
    from vllm.distributed.kv_transfer.kv_connector.v1.base import (
        KVConnectorBase_V1,
        KVConnectorWorkerMetadata,
        SupportsHMA,
    )

    from engine_hooks.vllm import KVWatchConnector
    from engine_hooks.vllm.metadata import KVWatchWorkerMetadata

    return {
        "KVWatchConnector": (KVWatchConnector, (KVConnectorBase_V1, SupportsHMA)),
        "KVWatchWorkerMetadata": (KVWatchWorkerMetadata, (KVConnectorWorkerMetadata,)),
    }


def names() -> list[str]:
    found = []
    for label, (cls, bases) in _classes().items():
        for attr in vars(cls):
            # Dunders are class plumbing, except a hand-written constructor (a dataclass's is
            # generated from its fields); _abc_impl is abc's.
            plumbing = attr == "_abc_impl" or (
                attr.startswith("__") and (attr != "__init__" or is_dataclass(cls))
            )
            if any(hasattr(base, attr) for base in bases) and not plumbing:
                found.append(f"{label}.{attr}")
    return sorted(found)


def mutants() -> list[tuple[str, list[str]]]:
    """(name, command) per mutant, the baseline (nothing removed) first."""
    script = [sys.executable, str(Path(__file__).resolve())]
    every = [BASELINE, *names(), *CALLS]
    return [(name, [*script, name, "--", *TESTS]) for name in every]


#: What every mutant's tests import (vLLM, torch): tests/mutation.py imports it once, so each
#: forked run starts warm. No hook is removed by importing these.
WARM = (
    "torch",
    "vllm",
    "vllm.config",
    "vllm.v1.core.sched.scheduler",
    "vllm.v1.core.kv_cache_utils",
    "vllm.v1.worker.utils",
    "vllm.v1.worker.kv_connector_model_runner_mixin",
    "vllm.v1.structured_output",
    "vllm.distributed.kv_transfer.kv_connector.factory",
    "engine_hooks.vllm",
)


def apply(name: str) -> None:
    if name in CALLS:
        CALLS[name]()
        return
    label, attr = name.split(".", 1)
    cls, _ = _classes()[label]
    delattr(cls, attr)
    abc.update_abstractmethods(cls)


def main(argv: list[str]) -> int:
    import pytest

    name, args = argv[0], argv[argv.index("--") + 1 :]
    if name != BASELINE:
        apply(name)
    return int(pytest.main(args))


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
