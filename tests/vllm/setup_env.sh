#!/usr/bin/env bash
# Build build/vllm-venv: the real vLLM 0.33.0 release on CPU, for the connector tests in tests/vllm.
# Idempotent and cached: does nothing when the venv is complete for this script and its
# requirements (a stamp holds their hash); the wheels are kept in build/vllm-wheels, so a rebuild
# downloads nothing. Fails loudly.
set -euo pipefail

ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)"
VENV="$ROOT/build/vllm-venv"
REQ="$ROOT/tests/vllm/requirements.txt"
STAMP="$VENV/.kvwatch-complete"
PYTHON="${PYTHON:-python3.11}"
WHEELS="$ROOT/build/vllm-wheels"
export PIP_DISABLE_PIP_VERSION_CHECK=1

want="$(cat "${BASH_SOURCE[0]}" "$REQ" | sha256sum | cut -d' ' -f1)"
check() {
    "$VENV/bin/python" - <<'PY'
import torch, vllm
assert torch.__version__.startswith("2.13.0"), torch.__version__
assert vllm.__version__ == "0.33.0", vllm.__version__
from vllm.distributed.kv_transfer.kv_connector.factory import KVConnectorFactory  # noqa: F401
import engine_hooks.vllm  # noqa: F401
PY
}
link_repo() {
    # The repository on the venv's path (this clone, wherever it lives): no copy, no egg-info.
    site="$("$VENV/bin/python" -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')"
    echo "$ROOT" > "$site/kvwatch-repo.pth"
}

if [ -f "$STAMP" ] && [ "$(cat "$STAMP")" = "$want" ]; then
    link_repo
    if check 2>/dev/null; then
        echo "vllm-venv: cached ($VENV)"
        exit 0
    fi
fi

echo "vllm-venv: building $VENV"
rm -rf "$VENV"
"$PYTHON" -m venv "$VENV"
# torch first and pinned: the CPU build from this machine's wheels. vLLM and everything after it
# go in with --no-deps, so pip never resolves another torch (a multi-GB CUDA build).
# --no-compile: the tests' first imports compile what they use (one pytest process at first),
# not every module of torch and vLLM up front.
"$VENV/bin/pip" install -q --no-compile torch==2.13.0
# Fetch once into build/vllm-wheels (pip skips files already there), then install offline.
"$VENV/bin/pip" download -q --no-deps -d "$WHEELS" vllm==0.33.0 -r "$REQ"
VLLM_TARGET_DEVICE=cpu "$VENV/bin/pip" install -q --no-compile --no-deps --no-index \
    --find-links "$WHEELS" vllm==0.33.0
"$VENV/bin/pip" install -q --no-compile --no-deps --no-index --find-links "$WHEELS" -r "$REQ"
link_repo
check
echo "$want" > "$STAMP"
echo "vllm-venv: ready"
