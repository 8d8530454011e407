# lctrain: `make train` sets up .venv and runs the default job; `make test` sets up .venv and runs the tests;
# `make test-fast` the single-process ones only; `make test-cluster` (root) runs the cluster suite on a local slurm
# cluster and two network namespaces.
PYTHON ?= python3
# torch is installed first, from the default index (the public one gives the CUDA build on Linux; a machine may keep
# a local CPU build) or from TORCH_INDEX, e.g. https://download.pytorch.org/whl/cpu.
TORCH_VERSION ?= 2.13.0
TORCH_INDEX ?=
VENV := .venv
PY := $(VENV)/bin/python

.PHONY: install train test test-fast test-cluster lint bench

install: $(VENV)/.installed

# torch first, so that nothing pulls a different (multi-GB CUDA) build as a dependency.
$(VENV)/.installed: pyproject.toml Makefile
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install --quiet "torch==$(TORCH_VERSION)" $(if $(TORCH_INDEX),--index-url $(TORCH_INDEX))
	$(PY) -m pip install --quiet -e ".[dev]"
	touch $@

# The default job: recipes/tiny_cpu.yaml, a small Llama trained on the embedded corpus by 4 CPU processes
# (ring 2 x ulysses 2). Extra Hydra overrides: make train ARGS="train.steps=50".
train: install
	$(VENV)/bin/torchrun --standalone --nproc-per-node 4 -m lctrain train recipe=tiny_cpu $(ARGS)

# Two pytest workers, each running one test file at a time (a file's fixtures are built once): a single worker leaves
# a core idle about a fifth of the time (timeouts, servers, process starts) and the single-process tests use one core
# each (docs/testing.md).
PYTEST_WORKERS := -n 2 --dist loadfile

test: install
	$(PY) -m pytest tests $(PYTEST_WORKERS)

# The inner loop: tests/unit and tests/repository without the tests marked slow (benchmark smoke runs in worker
# processes, the wheel build); no spawned process group, about 2 minutes on 2 cores (docs/testing.md).
test-fast: install
	$(PY) -m pytest tests/unit tests/repository -m "not slow" $(PYTEST_WORKERS)

# The cluster suite (tests/cluster): a real slurm cluster (munge, slurmctld, two slurmd nodes) and two hosts in
# network namespaces, started and stopped by the tests. Needs root; installs Debian's packages when they are missing
# (as root with apt-get); without them the tests are skipped, naming what is missing.
CLUSTER_PACKAGES := slurmctld slurmd slurm-client munge iproute2
test-cluster: install
	@missing=""; for p in $(CLUSTER_PACKAGES); do dpkg -s $$p >/dev/null 2>&1 || missing="$$missing $$p"; done; \
	if [ -n "$$missing" ] && [ "$$(id -u)" = 0 ] && command -v apt-get >/dev/null; then \
		echo "installing$$missing"; apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq$$missing; \
	fi
	LCTRAIN_CLUSTER_TESTS=1 $(PY) -m pytest tests/cluster

lint: install
	$(VENV)/bin/ruff check lctrain tests testbed benchmarks examples
	$(VENV)/bin/ruff format --check lctrain tests testbed benchmarks examples

bench: install
	$(PY) -m pip install --quiet -e ".[deepspeed]"
	$(PY) -m benchmarks.bench_attention
