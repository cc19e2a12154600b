"""The adapters use KVWatch's public doors only, and name every label from the catalogue.

An AST walk over the adapters (the SGLang plugin, the vLLM connector, minipd): none reads or
writes an underscore attribute of a watch, nor a watch's detectors, page state or counters, nor
writes page tags itself (tag writes live in :mod:`engine_hooks.pagestate`), nor imports the
detectors or the page state (their types come from :mod:`engine_hooks`); no hook, skip or
counter door is called with a bare string.
"""

from __future__ import annotations

import ast
import re
from enum import StrEnum
from pathlib import Path

import pytest

from engine_hooks import labels
from kvspool import catalogue

ROOT = Path(__file__).resolve().parents[2]
ADAPTERS = sorted(
    [
        *(ROOT / "engine_hooks" / "sglang").glob("*.py"),
        *(ROOT / "engine_hooks" / "vllm").glob("*.py"),
        *(ROOT / "minipd").glob("*.py"),
    ]
)
#: An expression that is a KVWatch in the adapters: ``watch``, ``self.watch``, ``held.watch``,
#: ``rt.engine_watch()``, ``rt.watch_for(a)``, ``rt.all_watches[0]``, ``coverage``.
_WATCH = re.compile(r"(?:^|\.)(?:watch|coverage)$|watch\(\)$|watch_for\(.*\)$|all_watches\[.*\]$")
#: A watch's insides: its detectors, page state, request keys and counters.
_INSIDES = {"state", "tags", "canary", "checksum", "admission", "stats", "requests", "spool"}
#: The doors and guards whose label arguments must come from :mod:`engine_hooks.labels`.
_LABELLED = {"skip", "verified", "hook_failed", "engine_finding", "safe", "_guard", "Guard"}
#: The core's private modules: what the adapters need of them, ``engine_hooks`` re-exports.
_PRIVATE_MODULES = {"engine_hooks.detectors", "engine_hooks.pagestate"}


def imported(node: ast.Import | ast.ImportFrom) -> list[str]:
    """The modules an import names (``from a import b`` names ``a`` and, if a module, ``a.b``)."""
    if isinstance(node, ast.Import):
        return [alias.name for alias in node.names]
    return [node.module or "", *(f"{node.module}.{alias.name}" for alias in node.names)]


def violations(source: str) -> list[str]:
    found = []
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Attribute):
            name, receiver = node.attr, ast.unparse(node.value)
            private = name.startswith("_") and not name.startswith("__")
            if _WATCH.search(receiver) and (private or name in _INSIDES):
                found.append(f"{node.lineno}: {receiver}.{name}")
            elif name == "tag_store":
                found.append(f"{node.lineno}: {receiver}.tag_store (tags are pagestate's)")
        elif isinstance(node, ast.Import | ast.ImportFrom):
            for module in _PRIVATE_MODULES.intersection(imported(node)):
                found.append(f"{node.lineno}: imports {module} (import from engine_hooks)")
        elif isinstance(node, ast.Call):
            func = node.func
            called = func.attr if isinstance(func, ast.Attribute) else getattr(func, "id", "")
            if called in _LABELLED:
                for arg in node.args[:2]:  # the label arguments of each
                    if isinstance(arg, ast.Constant) and isinstance(arg.value, str):
                        found.append(f"{node.lineno}: {called}({arg.value!r}): a bare label")
    return found


@pytest.mark.parametrize("path", ADAPTERS, ids=lambda p: str(p.relative_to(ROOT)))
def test_adapters_use_the_public_doors_only(path: Path) -> None:
    assert violations(path.read_text()) == []


def test_the_walk_finds_what_the_adapters_once_did() -> None:
    """What the SGLang and vLLM adapters did before the doors: each is found."""
    old = """
watch._pending.extend(findings)
state, pool = watch.state, watch.pool
written = pool.tag_store
held.watch.stats.skipped("canary", "no_pool")
self.watch.stats.add("hook_errors", (hook,))
checksum = self.watch.checksum
rt.all_watches[0].stats.add("hook_errors", (hook,))
watch.skip("canary", "no_pool")
@safe("verify")
def f(): ...
from engine_hooks.detectors import Seal
from engine_hooks import pagestate
"""
    assert len(violations(old)) == 12
    assert violations("ticket.tags; watch.pool.page_size; self._vllm_config") == []


def test_each_label_enum_is_its_catalogue_label() -> None:
    for enum, label in labels.LABELS.items():
        assert {m.value for m in enum} | {catalogue.OTHER} == set(label.values), enum.__name__


def test_a_misspelt_label_fails_at_import() -> None:
    class Typo(StrEnum):
        ALOCATE = "alocate"

    with pytest.raises(ValueError, match="'alocate' is not a catalogued hook"):
        labels.catalogued(Typo, catalogue.HOOK)
