"""The SGLang half of the hook-mutation check (driver: ``tests/mutation.py``).

One mutant per entry of the plugin's ``HOOKS``: the plugin registers every hook but that one
(``load_plugins()`` then patches SGLang without it), and the tests that exercise it run; and one
per call in ``CALLS`` (what records whose KV a page holds, and scrub), removed with every hook
in place. Every mutant must fail at least one of its tests. Run in build/sglang-venv
(``make mutation-sglang``)::

    KVWATCH_SGLANG_STAGE=1 build/sglang-venv/bin/python -m tests.mutation tests.sglang.mutants

It also speaks the (name, command) interface of a driver that runs each mutant in its own
interpreter: :func:`mutants` lists the commands, and ``mutants.py NAME -- PYTEST-ARGS`` removes
hook NAME and runs the tests.
"""

from __future__ import annotations

import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

if __name__ == "__main__":  # run as a script: the repository first, not tests/sglang
    sys.path[0] = str(Path(__file__).resolve().parents[2])


class Mutant:
    """What ``tests/mutation.py``'s in-process driver reads (name, apply, tests, exempt); kept
    here so this file also serves a driver with another mutant type. (A plain class: a driver
    may load this file without registering it as a module, which dataclasses need.)"""

    def __init__(
        self, name: str, apply: Callable[[], None], tests: tuple[str, ...], exempt: str = ""
    ) -> None:
        self.name, self.apply, self.tests, self.exempt = name, apply, tests, exempt


D = "tests/sglang/test_decode.py::"
M = "tests/sglang/test_memory.py::"
A = "tests/sglang/test_admission.py::"
E = "tests/sglang/test_engine.py::"
R = "tests/sglang/test_deferred_release.py::"

#: The tests that must notice each hook, by (method, hook function): the first listed is the
#: one expected to fail, so a killed mutant stops there (-x).
TESTS: dict[tuple[str, str], tuple[str, ...]] = {
    ("__init__", "after_init"): (M + "test_allocator_gets_a_watch_over_the_pool",),
    ("clear", "after_clear"): (M + "test_a_cache_flush_stamps_every_page_free",),
    ("alloc", "around_alloc"): (
        M + "test_write_into_a_released_page_is_caught_at_the_next_allocation",
    ),
    ("alloc_extend", "around_alloc"): (
        D + "test_a_late_write_is_caught_when_decode_reserves_the_page",
    ),
    ("alloc_decode", "around_alloc"): (
        D + "test_a_late_write_is_caught_when_a_decode_step_takes_the_page",
    ),
    ("_release_page_ids", "before_release"): (M + "test_double_free_is_caught",),
    ("add", "around_prefill_add"): (A + "test_a_clean_request_passes_both_doors",),
    ("add", "around_decode_add"): (A + "test_a_clean_request_passes_both_doors",),
    ("__init__", "before_scheduler_init"): (E + "test_pool_versus_context_and_engine_identity",),
    ("__init__", "after_scheduler_init"): (E + "test_pool_versus_context_and_engine_identity",),
    ("process_batch_result", "after_process_batch_result"): (
        D + "test_a_page_reused_while_the_request_still_references_it",
    ),
    ("_pre_alloc", "after_pre_alloc"): (D + "test_the_incident_eight_reserved_one_written",),
    ("process_prebuilt", "before_process_prebuilt"): (
        D + "test_the_incident_eight_reserved_one_written",
    ),
    ("process_prebuilt", "after_process_prebuilt"): (
        D + "test_decode_radix_cache_dedup_is_not_a_stale_page",
    ),
    ("process_batch_result_prebuilt", "after_prebuilt_result"): (
        D + "test_a_request_finished_at_admission_drops_its_ticket",
    ),
    ("_verify_kv_checksums", "around_verify_kv_checksums"): (
        E + "test_sglang_kv_checksum_coverage_and_mismatch",
    ),
    ("_handle_kv_checksum_mismatch", "before_kv_checksum_mismatch"): (
        E + "test_sglang_kv_checksum_coverage_and_mismatch",
    ),
    ("_format_violation", "after_format_violation"): (
        E + "test_sglang_kv_canary_violation_becomes_an_event_without_token_ids",
    ),
    ("_do_release", "before_do_release"): (
        R + "test_a_timed_out_release_names_the_requests_that_took_its_pages",
    ),
    ("_observe_deferred_kv_release", "after_observe_release"): (
        R + "test_a_timed_out_release_names_the_requests_that_took_its_pages",
    ),
    ("resolve_deferred_releases", "after_resolve_releases"): (
        R + "test_a_timed_out_release_names_the_requests_that_took_its_pages",
    ),
}

P = "tests/sglang/test_page_size_one.py::"

#: The same for the page-size-1 allocator's hooks (same methods and hook functions).
TOKEN_TESTS: dict[tuple[str, str], tuple[str, ...]] = {
    ("__init__", "after_init"): (P + "test_the_token_allocator_gets_a_watch_over_its_slots",),
    ("clear", "after_clear"): (P + "test_a_cache_flush_stamps_every_slot_free",),
    ("alloc", "around_alloc"): (
        P + "test_a_write_into_a_freed_slot_is_caught_at_the_next_allocation",
    ),
    ("free", "before_token_free"): (
        P + "test_a_double_free_of_slots_is_caught_and_a_free_group_frees_once",
    ),
}

X = "tests/sglang/test_exposure.py::"

#: The calls inside the hooks that record whose KV a page holds, and scrub: (name, what the
#: mutant does, the tests that must notice). Each mutant keeps every hook and removes one call.
CALLS: tuple[tuple[str, str, tuple[str, ...]], ...] = (
    (
        "KVWatch.landed",
        "admission records no transfer write",
        (X + "test_the_incident_names_exactly_the_exposed_requests",),
    ),
    (
        "hooks_disagg.decode_pages",
        "decode-step pages join no ticket",
        (X + "test_the_incident_names_exactly_the_exposed_requests",),
    ),
    (
        "KVWatch.freed_before_drain",
        "a timed-out release's takers are not reported",
        (R + "test_a_timed_out_release_names_the_requests_that_took_its_pages",),
    ),
    (
        "drain.DrainWatch.took",
        "no request is a taker of a timed-out release's pages (reserve and decode step)",
        (
            R + "test_a_timed_out_release_names_the_requests_that_took_its_pages",
            R + "test_a_decode_step_that_starts_a_released_page_is_a_taker",
        ),
    ),
    (
        "runtime.KVWatch",
        "the watch is built without KVWATCH_SCRUB",
        (X + "test_scrub_leaves_the_reader_zeros_and_the_detectors_still_fire",),
    ),
)

#: Hooks no test here can reach through SGLang's own code, and why.
_REAL_TRANSFER = (
    "the seal rides in the metadata row a real transfer moves, which this class bed has not: "
    "tests/sglang_pd (make sglang-pd-test) checks it in real servers, where removing it leaves "
    "verifications{checksum} below the transfers and counts skipped{no_seal}"
)
EXEMPT: dict[tuple[str, str], str] = {
    ("send_kv_chunk", "before_send_kv_chunk"): _REAL_TRANSFER,
    ("_commit_transfer_to_req", "before_commit_transfer"): _REAL_TRANSFER,
}

#: The baseline: every targeted test passes with every hook in place.
BASELINE: tuple[str, ...] = tuple(
    sorted(
        {
            t
            for tests in [*TESTS.values(), *TOKEN_TESTS.values(), *(c[2] for c in CALLS)]
            for t in tests
        }
    )
)


def _without(index: int) -> None:
    import engine_hooks.sglang as plugin

    plugin.HOOKS = plugin.HOOKS[:index] + plugin.HOOKS[index + 1 :]


def _remove_call(target: str) -> None:
    """``module.name`` (or ``module.Class.method``) of the plugin (``engine_hooks.sglang.``)
    becomes a no-op; for the watch's class, the ``scrub`` setting is dropped instead.
    ``KVWatch.method``: the hook method the plugin calls becomes a no-op (the plugin is its only
    caller here)."""
    import importlib

    module_name, name = target.rsplit(".", 1)
    module: Any
    if module_name == "KVWatch":
        module = importlib.import_module("engine_hooks.watch").KVWatch
    elif module_name.rsplit(".", 1)[-1][:1].isupper():  # module.Class.method
        module_name, class_name = module_name.rsplit(".", 1)
        module = getattr(importlib.import_module(f"engine_hooks.sglang.{module_name}"), class_name)
    else:
        module = importlib.import_module(f"engine_hooks.sglang.{module_name}")
    real = getattr(module, name)

    def mutated(*args: Any, **kwargs: Any) -> Any:
        if name == "KVWatch":
            kwargs.pop("scrub", None)
            return real(*args, **kwargs)
        return None

    setattr(module, name, mutated)


def _mutants() -> list[Mutant]:
    import functools

    import engine_hooks.sglang as plugin
    from engine_hooks.sglang import compat

    mutants = []
    for index, (target, hook, kind, _) in enumerate(plugin.HOOKS):
        method = target.rsplit(".", 1)[1]
        table = TOKEN_TESTS if target.startswith(compat.TOKEN_ALLOCATOR + ".") else TESTS
        tests = table.get((method, hook.__name__))
        if tests is None:  # a new hook with no test named here fails the check loudly
            tests = ("tests/sglang/no-test-named-for-this-hook",)
        name = f"{compat.short(target)} {kind} {hook.__name__}"
        exempt = EXEMPT.get((method, hook.__name__), "")
        mutants.append(Mutant(name, functools.partial(_without, index), tests, exempt))
    for target, what, tests in CALLS:
        name = f"call {target} ({what})"
        mutants.append(Mutant(name, functools.partial(_remove_call, target), tests))
    return mutants


MUTANTS = _mutants()


#: What every mutant's tests import (SGLang, torch): tests/mutation.py imports it once, so each
#: forked run starts warm. No hook is registered by importing these.
WARM = (
    "torch",
    "sglang.srt.plugins",
    "sglang.srt.plugins.hook_registry",
    "sglang.srt.managers.scheduler",
    "sglang.srt.disaggregation.decode",
    "sglang.srt.disaggregation.prefill",
    "sglang.srt.mem_cache.allocator.paged",
    "sglang.srt.mem_cache.allocator.token",
    "sglang.srt.mem_cache.registry",
)


__all__ = ["BASELINE", "MUTANTS", "WARM"]


# -- the (name, command) interface -------------------------------------------------------------

NONE_REMOVED = "(none removed)"
PYTEST = ["-x", "-q", "-p", "no:cacheprovider", "-W", "ignore"]


def mutants() -> list[tuple[str, list[str]]]:
    """(name, command) per mutant, the baseline (nothing removed) first. An exempt hook is not
    listed as a mutant; it is named here, with its reason."""
    script = [sys.executable, str(Path(__file__).resolve())]
    pairs = [(NONE_REMOVED, [*script, NONE_REMOVED, "--", *BASELINE, *PYTEST])]
    for m in MUTANTS:
        if m.exempt:
            print(f"mutation: exempt: {m.name} ({m.exempt})")
            continue
        pairs.append((m.name, [*script, m.name, "--", *m.tests, *PYTEST]))
    return pairs


def main(argv: list[str]) -> int:
    import os

    import pytest

    name, tests = argv[0], argv[argv.index("--") + 1 :]
    os.environ.setdefault("KVWATCH_SGLANG_STAGE", "1")
    if name != NONE_REMOVED:
        next(m for m in MUTANTS if m.name == name).apply()
    return int(pytest.main(tests))


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
