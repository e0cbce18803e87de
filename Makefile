# optiserve: `make serve` builds the default models and serves them; `make test` runs the tests.
PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python
BENTOML := $(VENV)/bin/bentoml
PORT ?= 3000
# Every recipe is optimized, reported and served: the default endpoints' first (serving.endpoint),
# then each other at its own path, /models/<name>/. SERVED_RECIPES narrows what `make serve` builds.
DEFAULT_RECIPES := models/image-classifier.yaml models/text-embedder.yaml
RECIPES ?= $(DEFAULT_RECIPES) $(filter-out $(DEFAULT_RECIPES),$(wildcard models/*.yaml))
SERVED_RECIPES ?= $(RECIPES)
export HF_HUB_OFFLINE := 1

.PHONY: setup optimize served-models serve test lint base-image clean loadtest bench bench-variants bench-overload bench-bulk bench-priorities bench-monitoring bench-swap fuzz soak

setup: $(VENV)/.installed

# pip (not uv) installs torch: pip on Python 3.11 takes torch 2.14.1 from this machine's disk.
$(VENV)/.installed: pyproject.toml
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install --quiet --upgrade pip
	$(PY) -m pip install --quiet -e '.[pipeline,dev]'
	touch $@

optimize: setup
	$(PY) -m pipeline $(RECIPES)

# Serving needs the served recipes built: all of them unless SERVED_RECIPES says otherwise.
served-models: setup
	$(PY) -m pipeline $(SERVED_RECIPES)

serve: served-models
	$(BENTOML) serve service:Optiserve --port $(PORT)

test: setup
	$(PY) -m pytest

lint: setup
	$(VENV)/bin/ruff check .
	$(VENV)/bin/ruff format --check .

# Both endpoints at 70 % of their knee for 30 minutes: errors, worker RSS growth, p99 drift.
soak: setup
	$(PY) -m bench.soak $(BENCH_ARGS)

# schemathesis against a real `bentoml serve` of the test suite's models: 200 examples per operation.
FUZZ_EXAMPLES ?= 200
fuzz: setup
	FUZZ_EXAMPLES=$(FUZZ_EXAMPLES) $(PY) -m pytest -s -m slow tests/test_fuzz.py

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

# A flood at 4 × the knee's concurrency for 60 s per endpoint: goodput, refusal speed, recovery.
bench-overload: setup
	$(PY) -m bench.overload $(BENCH_ARGS)

# A bulk task of 5 000 texts beside interactive /embed requests: their p99 during the task vs unloaded.
bench-bulk: setup
	$(PY) -m bench.bulk $(BENCH_ARGS)

# Normal /embed requests beside a flood of low-priority ones.
bench-priorities: setup
	$(PY) -m bench.priorities $(BENCH_ARGS)

# Throughput at the knee with monitoring on and off, alternated over three rounds (wrk).
bench-monitoring: setup
	$(PY) -m bench.monitoring $(BENCH_ARGS)

# Hot swaps (promote, rollback, …) of the /embed model under load: failures and p99 during each swap vs steady.
bench-swap: setup
	$(PY) -m bench.swap $(BENCH_ARGS)

# Every variant of each model's latest pipeline run against its FP32 export, at the batch the
# optimization targets name (32; text rows of 128 tokens), timed interleaved.
VARIANT_MODELS ?= image-classifier text-embedder digits-classifier
bench-variants: setup
	$(PY) -m bench.variants $(VARIANT_MODELS)

# A Debian trixie + Python 3.13 base image built from Debian's packages (no registry needed; root).
base-image:
	deploy/base-image/build.sh

clean:
	rm -rf reports serving-manifest.json .pytest_cache

# --- Release: the bento and its container image (README "Release") ----------------------------
# make bento                      bento `optiserve` from serving-manifest.json (served models built first)
# make container                  image optiserve:latest on the local base image, with podman
# make container BASE_IMAGE=python:3.13-slim BACKEND=docker      the usual base, Docker + registry
# make container GPU=1            bentofile.gpu.yaml: CUDA base, onnxruntime-gpu + TensorRT (unverified)
# Without MANIFEST, the served recipes are built first and the manifest they write is used
# ($OPTISERVE_MANIFEST, else serving-manifest.json); MANIFEST=path uses that manifest as it is
# (models imported from another machine; the tests' own store).
MANIFEST ?=
BENTO_MANIFEST := $(or $(MANIFEST),$(OPTISERVE_MANIFEST),serving-manifest.json)
GPU ?=
BACKEND ?= podman
BASE_IMAGE ?=
LOCAL_BASE_IMAGE := localhost/optiserve-base:trixie
BENTOFILE := $(if $(filter 1,$(GPU)),bentofile.gpu.yaml,bentofile.yaml)
BENTO_NAME := $(if $(filter 1,$(GPU)),optiserve-gpu,optiserve)
IMAGE ?= $(BENTO_NAME):latest
BENTO_SOURCES := service.py serving bentofile.yaml bentofile.gpu.yaml deploy/bento/Dockerfile.template

.PHONY: bento container

# The bento is built from a staging copy whose serving-manifest.json is $(BENTO_MANIFEST): the
# manifest inside the bento then names exactly the models the service collected at build time.
# Per-endpoint tag overrides are cleared for the same reason. `cd` into the copy: BentoML
# checks the dockerfile_template against the working directory (bentoml/BentoML#5566).
bento: setup $(if $(MANIFEST),,served-models)
	@test -f "$(BENTO_MANIFEST)" || { echo "no serving manifest at $(BENTO_MANIFEST)" >&2; exit 1; }
	set -e; stage="$$(mktemp -d)"; trap 'rm -rf "$$stage"' EXIT; \
	cp -R --parents $(BENTO_SOURCES) "$$stage/"; \
	cp "$(BENTO_MANIFEST)" "$$stage/serving-manifest.json"; \
	cd "$$stage" && env -u OPTISERVE_CLASSIFY_MODEL -u OPTISERVE_EMBED_MODEL \
	    OPTISERVE_MANIFEST="$$stage/serving-manifest.json" \
	    $(abspath $(BENTOML)) build -f $(BENTOFILE) .

# The local base image is built (root, debootstrap) only when it is the one used and missing.
# containerize runs from / for the same BentoML bug as above (its build context is a temp dir).
container: bento
ifeq ($(BACKEND)$(BASE_IMAGE)$(filter 1,$(GPU)),podman)
	podman image exists $(LOCAL_BASE_IMAGE) || deploy/base-image/build.sh
endif
	cd / && $(abspath $(BENTOML)) containerize --backend $(BACKEND) \
	    $(if $(filter podman buildah,$(BACKEND)),--opt isolation=chroot) \
	    $(if $(BASE_IMAGE),--opt build-arg=BASE_IMAGE=$(BASE_IMAGE)) \
	    -t $(IMAGE) $(BENTO_NAME):latest
	@$(if $(filter docker,$(BACKEND)),docker,podman) image inspect --format '{{.Size}}' $(IMAGE) | \
	    awk '{ printf "image $(IMAGE): %d MB\n", $$1 / 1000000 }'
