# nfab — two commands on a fresh machine: `make demo` and `make test`.
PY ?= python3
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed

.PHONY: install test test-fast test-gpu device-check demo lint bench study clean

install: $(STAMP)

$(STAMP): pyproject.toml constraints.txt
	$(PY) -m venv $(VENV)
	$(BIN)/pip install --quiet --upgrade pip
	$(BIN)/pip install --quiet -c constraints.txt -e '.[dev]'
	touch $(STAMP)

test: install
	OMP_NUM_THREADS=1 $(BIN)/python -m pytest -q --durations=20

test-fast: install
	OMP_NUM_THREADS=1 $(BIN)/python -m pytest -q -m 'not slow' --durations=10

test-gpu: install
	$(BIN)/python -m pytest -q -m cuda -rs

# the one prepared command for a lent GPU (no venv there: its python3 holds torch); on CPU a quick run
DEVICE_PY ?= $(if $(wildcard $(BIN)/python),$(BIN)/python,python3)
device-check:
	PYTHONPATH=$(CURDIR) $(DEVICE_PY) bench/device_check.py

demo: install
	$(BIN)/nfab demo

lint: install
	$(BIN)/ruff check nfab tests

bench: install  # one run each, folded into its setting's file (bench/runs.py: runs with min/median/max)
	$(BIN)/nfab bench wire --reducers signgather,signcount,qsum-q8 --json /tmp/nfab-wire-run.json
	$(BIN)/python -m bench.runs bench/wire/codecs.json /tmp/nfab-wire-run.json
	$(BIN)/nfab bench hook --json /tmp/nfab-hook-run.json
	$(BIN)/python -m bench.runs bench/hook.json /tmp/nfab-hook-run.json

study: install
	$(BIN)/nfab bench study --out bench/study --publish

clean:
	rm -rf $(VENV) runs .pytest_cache
