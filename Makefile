# kvwatch: `make demo` runs the main job, `make test` runs the whole suite. Both set up .venv.
PYTHON ?= python3.11
VENV := .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed

.PHONY: demo test lint typecheck unit bench clean

$(STAMP): pyproject.toml
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	# torch first, pinned: this takes the CPU build from the machine's disk; any looser
	# requirement could pull a multi-GB CUDA build.
	$(PY) -m pip install -q torch==2.13.0
	$(PY) -m pip install -q -e '.[engine,dev,dashboards]'
	touch $(STAMP)

demo: $(STAMP)
	$(PY) -m engine_hooks.walkthrough

lint: $(STAMP)
	$(VENV)/bin/ruff check .
	$(VENV)/bin/ruff format --check .

typecheck: $(STAMP)
	$(VENV)/bin/mypy

unit: $(STAMP)
	$(PY) -m pytest

test: lint typecheck unit

bench: $(STAMP)
	$(PY) bench/checksum.py

clean:
	rm -rf $(VENV) build .pytest_cache .mypy_cache .ruff_cache .hypothesis
