# nfab — two commands on a fresh machine: `make demo` and `make test`.
PY ?= python3
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed

.PHONY: install test test-fast test-gpu device-check device-wheels compat demo lint docs-tables bench study clean

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

# the one prepared command for a lent GPU (no venv there: its python3 holds torch); on CPU a quick run.
# The GPU image lacks pydantic: `make device-wheels` here saves its wheels in .whl/ (git-ignored), the
# device call carries .whl, and device-check installs them into $(DEVICE_SITE) when pydantic is missing.
DEVICE_PY ?= $(if $(wildcard $(BIN)/python),$(BIN)/python,python3)
DEVICE_SITE := /tmp/nfab-site
DEVICE_WHEELS := pydantic==2.14.4 pydantic_core==2.50.5 annotated-types==0.8.0 typing-inspection==0.4.5
device-check:
	@if ! $(DEVICE_PY) -c "import pydantic" 2>/dev/null && [ -d .whl ]; then \
	  $(DEVICE_PY) -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
	    --target $(DEVICE_SITE) .whl/*.whl; fi
	PYTHONPATH=$(CURDIR):$(DEVICE_SITE)$(if $(PYTHONPATH),:$(PYTHONPATH)) $(DEVICE_PY) bench/device_check.py

device-wheels:  # Python 3.12 x86-64 wheels of what the GPU image lacks, for the device call's carry
	grep -qx '/.whl/' .git/info/exclude 2>/dev/null || echo '/.whl/' >> .git/info/exclude
	$(PY) -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
	  --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 \
	  -d .whl $(DEVICE_WHEELS)

# the suite and the CPU device check on another torch, in a venv of its own: the GPU image's (2.11, the
# default) or the oldest declared (2.4.1: DDP only, FSDP2 refused in one line). PyPI's x86-64 builds are
# CUDA builds (about 5 GB in the venv); they run on the CPU.
TORCH ?= 2.11.0
COMPAT := .venv-torch$(TORCH)
compat:
	$(PY) -m venv $(COMPAT)
	$(COMPAT)/bin/pip install --quiet --upgrade pip setuptools wheel
	echo "torch==$(TORCH)" > $(COMPAT)/constraints.txt
	$(COMPAT)/bin/pip install --quiet -c $(COMPAT)/constraints.txt -e '.[dev]'
	OMP_NUM_THREADS=1 $(COMPAT)/bin/python -m pytest -q -p no:cacheprovider
	$(MAKE) device-check DEVICE_PY=$(COMPAT)/bin/python

demo: install
	$(BIN)/nfab demo

lint: install
	$(BIN)/ruff check nfab tests

docs-tables: install  # docs/config.md's key tables from the config models (tests/test_docs_tables.py checks them)
	$(BIN)/python -m bench.docs_tables

bench: install  # the wire run folded into its setting's file (bench/runs.py: runs with min/median/max); the hook table printed
	$(BIN)/nfab bench wire --reducers signgather,signcount,qsum-q8 --json /tmp/nfab-wire-run.json
	$(BIN)/python -m bench.runs bench/wire/codecs.json /tmp/nfab-wire-run.json
	$(BIN)/nfab bench hook

study: install
	$(BIN)/python -m bench.study --out bench/study --publish

clean:
	rm -rf $(VENV) runs .pytest_cache
