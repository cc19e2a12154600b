"""The daemon's own counters are named once, in the catalogue (``DaemonCounter``): no module of
the daemon spells one as a bare string, where a typo would read a counter that is always 0."""

from __future__ import annotations

import ast
from pathlib import Path

import kvwatch
from kvspool import catalogue

_NAMES = frozenset(catalogue.DAEMON_COUNTERS)


def _bare_names(tree: ast.AST) -> list[tuple[int, str]]:
    """Daemon counter names spelled as string constants where a state key is named: the first
    item of a (name, labels) key, the name given to a counting call, a name compared with or
    looped over. (The rules name families through ``catalogue.exposed``, which checks them.)"""
    found = []
    for node in ast.walk(tree):
        candidates: list[ast.expr] = []
        if isinstance(node, ast.Tuple) and len(node.elts) == 2:  # a (name, labels) key
            if isinstance(node.elts[1], ast.Tuple):
                candidates.append(node.elts[0])
        elif isinstance(node, ast.Call) and node.args:  # self._count(name, ...), .get(key)
            func = node.func
            if isinstance(func, ast.Attribute) and func.attr in ("_count", "count", "get"):
                candidates.append(node.args[0])
        elif isinstance(node, ast.Compare):  # name == "spool_rejected"
            candidates += [node.left, *node.comparators]
        elif isinstance(node, ast.For) and isinstance(node.iter, ast.Tuple):
            names = [e.value for e in node.iter.elts if isinstance(e, ast.Constant)]
            if names and set(names) <= _NAMES:  # a loop over counters (not over tables)
                candidates += node.iter.elts
        for item in candidates:
            if isinstance(item, ast.Constant) and item.value in _NAMES:
                found.append((item.lineno, item.value))
    return found


def test_every_daemon_counter_is_a_catalogued_counter_family() -> None:
    for name in catalogue.DAEMON_COUNTERS:
        assert catalogue.FAMILY_BY_NAME[catalogue.PREFIX + name].type == "counter"


def test_no_module_of_the_daemon_names_a_daemon_counter_by_a_bare_string() -> None:
    root = Path(kvwatch.__file__).parent
    bare = {
        f"{path.relative_to(root)}:{line}: {name}"
        for path in sorted(root.rglob("*.py"))
        for line, name in _bare_names(ast.parse(path.read_text(), str(path)))
    }
    assert not bare, sorted(bare)
