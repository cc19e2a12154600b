#!/usr/bin/env bash
# Build (or reuse) the real SGLang PD bed's environment (tests/sglang_pd): the class bed's venv,
# build/sglang-venv (tests/sglang/setup_env.sh: SGLang 0.5.23 on CPU torch, the 0.5.19 and 0.5.22
# overlays, kvwatch editable), plus Mooncake (non-CUDA), NIXL and the smg router in it, the system
# libraries Mooncake's engine.so links, the tiny models in build/, and build/sglang-pd-site: the
# CPU shims' entry points, on the servers' PYTHONPATH only (bed.py), so that the class bed, which
# shares the venv (one SGLang install to build, not two), never loads them.
# Idempotent and cached (a stamp holds the hash of what built it). Fails loudly.
set -euo pipefail

HERE="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
ROOT="$(cd "$HERE/../.." && pwd)"
VENV="$ROOT/build/sglang-venv"
PD_SITE="$ROOT/build/sglang-pd-site"
MODEL="$ROOT/build/sglang-pd-model"
RECITE="$ROOT/build/sglang-pd-recite-model"
PY="$VENV/bin/python"
STAMP="$VENV/.kvwatch-pd-stamp"

fail() { echo "sglang-pd-test env: $*" >&2; exit 1; }
trap 'fail "setup failed at line $LINENO (see the output above)"' ERR

# Mooncake's engine.so links libibverbs, librdmacm and libnuma even for its TCP transport.
missing=()
libs="$(ldconfig -p)"
for lib in libibverbs.so.1 librdmacm.so.1 libnuma.so.1; do
    [[ "$libs" == *"$lib"* ]] || missing+=("$lib")
done
if ((${#missing[@]})); then
    if [[ "$(id -u)" != 0 ]]; then
        fail "missing ${missing[*]}: run as root, or apt-get install libibverbs1 librdmacm1 libnuma1"
    fi
    echo "sglang-pd-test env: apt-get install libibverbs1 librdmacm1 libnuma1"
    apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq \
        libibverbs1 librdmacm1 libnuma1 >/dev/null
fi

bash "$ROOT/tests/sglang/setup_env.sh"

SITE="$("$PY" -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')"
# What an earlier layout put in the venv itself (seen by the class bed): gone.
rm -rf "$SITE/kvwatch-pd-stubs.pth" "$SITE"/kvwatch_sglang_pd_cpu_bed-*.dist-info
# The entry points of this bed's plugins (cpu_bed, the corrupter, the 0.5.19 doors, the ground
# truth recorders; README.md here), found by SGLang's load_plugins() through the servers'
# PYTHONPATH (bed.py puts this folder and the sgl_kernel stand-in there), never in kvwatch's own
# metadata and never in the class bed.
SHIM="$PD_SITE/kvwatch_sglang_pd_cpu_bed-0.0.0.dist-info"
mkdir -p "$SHIM"
printf 'Metadata-Version: 2.1\nName: kvwatch-sglang-pd-cpu-bed\nVersion: 0.0.0\n' > "$SHIM/METADATA"
printf '[sglang.srt.plugins]\ncpu_bed = tests.sglang_pd.cpu_shims:register\ncorrupt_after_seal = tests.sglang_pd.corrupter:register\nadmit_0_5_19 = tests.sglang_pd.release_0_5_19:register\npage_owners = tests.sglang_pd.page_owners:register\ndrain_rows = tests.sglang_pd.drain_rows:register\n' \
    > "$SHIM/entry_points.txt"

want="$(cat "${BASH_SOURCE[0]}" "$HERE/requirements.txt" "$ROOT/tests/vllm_pd/make_model.py" \
    "$HERE/make_recite_model.py" \
    | sha256sum | cut -c1-16)"
if [[ -f "$STAMP" && "$(cat "$STAMP")" == "$want" && -f "$MODEL/model.safetensors" \
    && -f "$RECITE/model.safetensors" ]]; then
    echo "sglang-pd-test env: cached ($VENV)"
    exit 0
fi
echo "sglang-pd-test env: adding the transfer engines and the router"
"$PY" -m pip install -q --disable-pip-version-check --no-deps -r "$HERE/requirements.txt"
rm -rf "$MODEL"
# The vLLM bed's tiny Llama (made here, nothing downloaded): one model for both real beds.
(cd / && "$PY" -W ignore "$ROOT/tests/vllm_pd/make_model.py" "$MODEL")
# The marker test's model: weights that recite what its KV holds (make_recite_model.py).
rm -rf "$RECITE"
(cd / && "$PY" -W ignore "$HERE/make_recite_model.py" "$RECITE")
(cd / && PYTHONPATH="$HERE/stubs" "$PY" -W ignore - <<'PYEOF'
import shutil
from mooncake.engine import TransferEngine  # noqa: F401  (engine.so and its libraries)
from nixl._api import nixl_agent  # noqa: F401
import sglang.srt.disaggregation.mooncake.conn  # noqa: F401
assert shutil.which("smg") or __import__("importlib").util.find_spec("smg"), "no smg router"
PYEOF
)
echo "$want" > "$STAMP"
echo "sglang-pd-test env: ready"
