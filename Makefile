# optiserve: `make serve` builds the default models and serves them; `make test` runs the tests.
PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python
BENTOML := $(VENV)/bin/bentoml
PORT ?= 3000
RECIPES ?= models/image-classifier.yaml models/text-embedder.yaml
export HF_HUB_OFFLINE := 1

.PHONY: setup optimize serve test lint base-image clean loadtest bench

setup: $(VENV)/.installed

# pip (not uv) installs torch: pip on Python 3.11 takes torch 2.14.1 from this machine's disk.
$(VENV)/.installed: pyproject.toml
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install --quiet --upgrade pip
	$(PY) -m pip install --quiet -e '.[pipeline,dev]'
	touch $@

optimize: setup
	$(PY) -m pipeline $(RECIPES)

serve: optimize
	$(BENTOML) serve service:Optiserve --port $(PORT)

test: setup
	$(PY) -m pytest

lint: setup
	$(VENV)/bin/ruff check .
	$(VENV)/bin/ruff format --check .

# Sweep a running server (`make serve` in another shell); LOADTEST_ARGS adds options, e.g.
# make loadtest LOADTEST_URL=http://127.0.0.1:3000/embed LOADTEST_ARGS="--slo-ms 300 --target-qps 200"
LOADTEST_URL ?= http://127.0.0.1:$(PORT)/classify
LOADTEST_ARGS ?=
loadtest: setup
	$(PY) -m loadtest $(LOADTEST_URL) $(LOADTEST_ARGS)

# limit vs optiserve vs naive, image and text, in one run (about 10 minutes on 2 cores).
# BENCH_ARGS="--manifest serving-manifest.json" serves the store's models instead of building afresh.
BENCH_ARGS ?=
bench: setup
	$(PY) -m bench.serving $(BENCH_ARGS)

# A Debian bookworm + Python 3.11 base image built from Debian's packages (no registry needed; root).
base-image:
	deploy/base-image/build.sh

clean:
	rm -rf reports serving-manifest.json .pytest_cache
