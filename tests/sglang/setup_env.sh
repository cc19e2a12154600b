#!/usr/bin/env bash
# Build (or reuse) the SGLang test environment: build/sglang-venv with the real SGLang release
# from PyPI on the CPU build of torch, kvwatch installed editable, and the torchvision stand-in.
# Idempotent: a complete environment (stamp matches this script and the requirements) is reused
# in about a second. Any failure is loud and exits non-zero.
set -euo pipefail

ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)"
HERE="$ROOT/tests/sglang"
VENV="${SGLANG_VENV:-$ROOT/build/sglang-venv}"
PYTHON="${PYTHON:-python3.11}"
SGLANG_VERSION="${SGLANG_VERSION:-0.5.23}"
TORCH_VERSION="2.13.0"
PY="$VENV/bin/python"
PIP=("$PY" -m pip install -q --disable-pip-version-check)
STAMP="$VENV/.kvwatch-stamp"

fail() { echo "sglang-test env: $*" >&2; exit 1; }
trap 'fail "setup failed at line $LINENO (see the output above)"' ERR

want="$(cat "$HERE/setup_env.sh" "$HERE/requirements.txt" | sha256sum | cut -c1-16)-$SGLANG_VERSION"
if [[ -x "$PY" && -f "$STAMP" && "$(cat "$STAMP")" == "$want" ]]; then
    echo "sglang-test env: cached ($VENV)"
else
    echo "sglang-test env: building $VENV (sglang $SGLANG_VERSION, torch $TORCH_VERSION CPU)"
    rm -f "$STAMP"
    [[ -x "$PY" ]] || "$PYTHON" -m venv "$VENV"
    # torch first, pinned, alone: the CPU build on this machine's disk. Everything after is
    # --no-deps, so nothing can ask pip for another torch (a multi-GB CUDA build).
    "${PIP[@]}" "torch==$TORCH_VERSION"
    "${PIP[@]}" --no-deps "sglang==$SGLANG_VERSION"
    "${PIP[@]}" --no-deps -r "$HERE/requirements.txt"
    "$PY" -m pip uninstall -q -y torchvision 2>/dev/null || true
fi

SITE="$("$PY" -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')"
# The test-only torchvision stand-in (SGLang imports torchvision at module level).
echo "$HERE/stubs" > "$SITE/kvwatch-test-stubs.pth"

# kvwatch itself, editable, so load_plugins() sees its entry points. Until pyproject.toml declares
# the sglang.srt.plugins entry point, a minimal dist-info stands in for that one declaration.
PYPROJECT_HASH="$(sha256sum "$ROOT/pyproject.toml" | cut -c1-16)"
if [[ ! -f "$VENV/.kvwatch-editable" || "$(cat "$VENV/.kvwatch-editable")" != "$PYPROJECT_HASH" ]]; then
    "${PIP[@]}" --no-deps -e "$ROOT"
    echo "$PYPROJECT_HASH" > "$VENV/.kvwatch-editable"
fi
SHIM="$SITE/kvwatch_sglang_entry_point-0.0.0.dist-info"
if grep -q 'sglang.srt.plugins' "$ROOT/pyproject.toml"; then
    rm -rf "$SHIM"
else
    mkdir -p "$SHIM"
    printf 'Metadata-Version: 2.1\nName: kvwatch-sglang-entry-point\nVersion: 0.0.0\n' \
        > "$SHIM/METADATA"
    printf '[sglang.srt.plugins]\nkvwatch = engine_hooks.sglang:register\n' \
        > "$SHIM/entry_points.txt"
fi

# Complete means: the pinned torch, the real SGLang modules kvwatch hooks, and the entry point.
"$PY" - "$SGLANG_VERSION" "$TORCH_VERSION" <<'PYEOF'
import importlib, importlib.metadata as md, sys, warnings
warnings.simplefilter("ignore")
sglang_version, torch_version = sys.argv[1], sys.argv[2]
import torch
assert torch.__version__.split("+")[0] == torch_version, torch.__version__
assert md.version("sglang") == sglang_version, md.version("sglang")
for name in ("plugins", "mem_cache.allocator.paged", "mem_cache.memory_pool",
             "managers.schedule_batch", "disaggregation.prefill", "disaggregation.decode"):
    importlib.import_module("sglang.srt." + name)
eps = [ep for ep in md.entry_points(group="sglang.srt.plugins") if ep.name == "kvwatch"]
assert eps, "no kvwatch entry point in group sglang.srt.plugins"
PYEOF
echo "$want" > "$STAMP"

# Older releases as overlays (sglang and the few pins it needs, --no-deps, on this venv's deps).
for overlay in "$HERE"/overlay-*.txt; do
    version="$(basename "$overlay" .txt)"
    version="${version#overlay-}"
    target="$VENV/overlays/$version"
    hash="$(sha256sum "$overlay" | cut -c1-16)"
    if [[ -f "$target/.kvwatch-stamp" && "$(cat "$target/.kvwatch-stamp")" == "$hash" ]]; then
        continue
    fi
    echo "sglang-test env: overlay sglang $version"
    rm -rf "$target"
    "${PIP[@]}" --no-deps --target "$target" -r "$overlay"
    PYTHONPATH="$target" "$PY" -W ignore -c "
import importlib.metadata as md, sglang.srt.disaggregation.decode, sglang.srt.managers.scheduler
assert md.version('sglang') == '$version', md.version('sglang')"
    echo "$hash" > "$target/.kvwatch-stamp"
done
echo "sglang-test env: ready"
