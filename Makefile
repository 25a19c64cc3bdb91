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

# The whole suite, real-model tests included (CI runs this): the fast tests, then the slow
# (real-model) ones in a second process, so that neither accumulates the other's programs.
test: fetch
	$(PY) -m pytest -q -m "not slow" $(PYTEST_ARGS)
	$(PY) -m pytest -q -m slow $(PYTEST_ARGS)

# The quick inner loop: no real-model or long tests.
test-fast: setup
	$(PY) -m pytest -q -m "not slow" $(PYTEST_ARGS)

bench: fetch
	$(PY) -m redrafter_jax.bench suite --prompts data/spec_bench.jsonl.gz --drafter shipped \
	    --param-dtype auto

clean:
	rm -rf $(VENV) build *.egg-info src/*.egg-info .pytest_cache
