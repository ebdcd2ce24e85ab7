# Common loops. `make test` and `make demo` work on a fresh Debian 12 machine (as root): they run setup first.
VENV ?= .venv
PY := $(VENV)/bin/python
PYTEST_ARGS ?=

.PHONY: setup images test test-all test-fast lint ruff fmt typecheck ansible-lint docs-check plan-examples clean

setup:
	bash tools/setup.sh

## sandbox host images (base rootfs, offline wheelhouse, engine image): minutes the first time, then cached
images: setup
	$(VENV)/bin/vllm-fleet sandbox image --engine

## the test suite: unit + integration (real vLLM-CPU engines, nginx, Prometheus, Alertmanager, nspawn hosts);
## CI runs it. Scenarios marked `extended` (further drills) only in test-all. tools/run_tests.py runs the
## Ansible e2e beside the local modules, then the modules that need the machine alone (docs/testing.md);
## PYTEST_ARGS with test paths (or --serial) runs one plain pytest
test: setup images
	$(PY) tools/run_tests.py -ra --durations=20 -m "not extended" $(PYTEST_ARGS)

## everything: the `extended` scenarios too (docs/testing.md lists each scenario with its tier and time)
test-all: setup images
	$(PY) tools/run_tests.py -ra --durations=20 $(PYTEST_ARGS)

## unit tests only (seconds; no processes started)
test-fast:
	$(PY) -m pytest -ra tests/unit $(PYTEST_ARGS)

lint: ruff typecheck ansible-lint docs-check

ruff:
	$(VENV)/bin/ruff check .
	$(VENV)/bin/ruff format --check .

fmt:
	$(VENV)/bin/ruff format .
	$(VENV)/bin/ruff check --fix .

# the package, the Ansible plugins, the tools; the GPU labs import each other (and tools/*.py) as top-level
# modules, and tools/sandbox has a measure.py too: their own run
typecheck:
	$(VENV)/bin/mypy
	$(VENV)/bin/mypy ansible/plugins/modules ansible/plugins/filter
	$(VENV)/bin/mypy tools/*.py tools/sandbox/*.py tools/amx/*.py
	MYPYPATH=tools $(VENV)/bin/mypy tools/gpu-validate/*.py

ansible-lint:
	@if [ -f site.yml ]; then PATH=$(abspath $(VENV))/bin:$$PATH $(VENV)/bin/ansible-lint --profile production site.yml rollout.yml ansible/; fi

## docs/performance.md is assembled from docs/perf/*.md: out of date fails
docs-check:
	$(PY) tools/assemble_performance.py --check

plan-examples:
	@for f in examples/*.yml; do echo "== $$f"; $(VENV)/bin/vllm-fleet plan $$f || exit 1; done

clean:
	rm -rf out .pytest_cache .mypy_cache .ruff_cache

-include mk/*.mk
