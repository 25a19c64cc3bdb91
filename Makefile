# `make demo` and `make test` set up everything they need on a fresh machine:
# a virtual environment in .venv (re-installed when pyproject.toml changes), the package with its
# extras, and the SmolLM2-135M model in the cache (~/.cache/redrafter_jax, fetched once).

PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed
EXTRAS ?= test,serve,mlx,bench,train
PYTEST_ARGS ?=

.PHONY: setup fetch demo test test-fast bench clean

$(STAMP): pyproject.toml
	@test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install --quiet --disable-pip-version-check --upgrade pip
	$(PY) -m pip install --quiet --disable-pip-version-check -e ".[$(EXTRAS)]"
	@touch $@

setup: $(STAMP)

fetch: setup
	$(PY) -m redrafter_jax.cli fetch smollm2-135m

demo: fetch
	$(PY) -m redrafter_jax.cli demo

# The whole suite, real-model tests included (CI runs this). The fast tests run in TEST_WORKERS
# processes (pytest-xdist) that take whole files (each file's fixtures built once), with quick
# code generation; the slow (real-model) ones in one process, whose programs use every core,
# with XLA's optimised code generation (tests/conftest.py says why).
TEST_WORKERS ?= 2
FAST_TESTS = $(PY) -m pytest -q -n $(TEST_WORKERS) --dist loadfile -m "not slow" --durations=20
test: fetch
	$(FAST_TESTS) $(PYTEST_ARGS)
	REDRAFTER_TEST_CODEGEN=full $(PY) -m pytest -q -p no:xdist -m slow --durations=20 $(PYTEST_ARGS)

# The quick inner loop: no real-model or long tests.
test-fast: setup
	$(FAST_TESTS) $(PYTEST_ARGS)

bench: fetch
	$(PY) -m redrafter_jax.bench suite --prompts data/spec_bench.jsonl.gz --drafter shipped \
	    --param-dtype auto

clean:
	rm -rf $(VENV) build *.egg-info src/*.egg-info .pytest_cache
