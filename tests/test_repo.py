"""The repository stands on its own: no file names or points at sources outside it.

The incident is told in docs/incident.md and the design in docs/architecture.md; an earlier
write-up and a directory beside the checkout were once cited instead. The words are assembled
here so that this file does not match itself.
"""

from __future__ import annotations

import re
import subprocess
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
FORBIDDEN = re.compile(
    rb"(?i:" + b"ess" + rb"ay)|\.\./" + b"shared" + rb"|/work/" + b"shared",
)


def tracked_files() -> list[str]:
    listed = subprocess.run(
        ["git", "ls-files", "-z"], cwd=ROOT, capture_output=True, check=True, timeout=60
    )
    return [name.decode() for name in listed.stdout.split(b"\0") if name]


def test_the_pattern_matches_what_it_forbids() -> None:
    for text in (
        "the " + "Ess" + "ay's check",
        "see " + "/".join(("..", "shared", "DESIGN.md")),
        "/work/" + "shared",
    ):
        assert FORBIDDEN.search(text.encode()), text


def test_no_tracked_file_points_outside_the_repository() -> None:
    files = tracked_files()
    assert "pyproject.toml" in files  # git listed this checkout
    found = [f"{name} (name)" for name in files if FORBIDDEN.search(name.encode())]
    for name in files:
        path = ROOT / name
        if path.is_symlink() or not path.is_file():
            continue  # a deleted, not yet committed file; a symlink's target is listed itself
        for number, line in enumerate(path.read_bytes().splitlines(), 1):
            if FORBIDDEN.search(line):
                found.append(f"{name}:{number}")
    assert not found, found
