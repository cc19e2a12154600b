#!/usr/bin/env bash
# The SGLang stage of `make test`: build (or reuse) build/sglang-venv, then run tests/sglang
# against SGLang 0.5.23 and against each older release overlay (0.5.22, 0.5.19). Fails loudly.
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)"
VENV="${SGLANG_VENV:-$ROOT/build/sglang-venv}"
cd "$ROOT"
bash tests/sglang/setup_env.sh
export KVWATCH_SGLANG_STAGE=1
echo "== tests/sglang on sglang $("$VENV/bin/python" -c 'import importlib.metadata as m; print(m.version("sglang"))')"
"$VENV/bin/python" -m pytest -p no:cacheprovider tests/sglang "$@"
for target in "$VENV"/overlays/*/; do
    echo "== tests/sglang on sglang $(basename "$target") (overlay)"
    PYTHONPATH="$target" "$VENV/bin/python" -m pytest -p no:cacheprovider tests/sglang "$@"
done
