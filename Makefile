# clipjax developer commands. Every target builds the virtual environment it
# needs from nothing: `make test` on a fresh clone is all CI does.

VENV ?= .venv
PYTHON ?= python3
PYTEST_WORKERS ?= 2

BIN := $(VENV)/bin
PIP := $(BIN)/python -m pip --disable-pip-version-check
# The torch references (zclip, drytorch, pytorch-optimizer, torch-optimi,
# adamwclip; `make test-all` only) depend on torch. Installed first and kept
# pinned, torch resolves to the CPU wheel on the machine's pip index; left to
# the resolver it pulls the CUDA build and gigabytes of wheels.
TORCH ?= torch==2.13.0

# `make test-min`: the oldest versions pyproject.toml declares (keep in step
# with [project] dependencies), in their own environment.
VENV_MIN ?= .venv-min
MIN_DEPS ?= jax==0.4.36 jaxlib==0.4.36 optax==0.2.5 chex==0.1.87 numpy==1.24.1
MIN_TEST_DEPS ?= "pytest>=8" "pytest-xdist>=3.5" "hypothesis>=6.100"
BIN_MIN := $(VENV_MIN)/bin

# `make docs`: Sphinx, warnings as errors; SPHINXOPTS adds options.
SPHINXOPTS ?=
DOCS_OUT ?= build/docs

.PHONY: help test test-all test-min lint typecheck format docs docs-check dist test-wheel demo notebooks bench clean distclean

help:
	@echo "make demo       train a small model with injected gradient spikes (examples/demo.py)"
	@echo "make notebooks  run notebooks/*.ipynb top to bottom; executed copies in build/notebooks/"
	@echo "make test       ruff check, then pytest -m 'not slow' (tests/ and doctests; ~5 min on 2 cores, install included)"
	@echo "make test-all   ruff check, then every test: also notebooks, docs site, reference traces"
	@echo "                (installs torch's CPU build and the references), 8-device and multi-process"
	@echo "                runs, long scans and sweeps, examples, wheel (what CI runs)"
	@echo "make test-min   the fast suite on the oldest declared jax, optax, chex, numpy ($(VENV_MIN))"
	@echo "make lint       ruff check, ruff format --check, then make typecheck"
	@echo "make typecheck  pyright on clipjax/ ([tool.pyright] in pyproject.toml)"
	@echo "make docs       the documentation site in $(DOCS_OUT)/html (runs the notebooks)"
	@echo "make docs-check the built site in headless Chromium at 1280 px: no table or code"
	@echo "                block scrolls sideways, no image wider than the page (after make docs)"
	@echo "make dist       wheel and sdist in dist/, checked with twine check --strict"
	@echo "make test-wheel make dist, install the wheel in a clean venv, run one update"
	@echo "make format     ruff format and ruff check --fix"
	@echo "make bench      run benchmarks/run.py"
	@echo "make clean      remove caches, build outputs, demo_out/ and lm_out/"
	@echo "make distclean  clean, and remove $(VENV)"

$(BIN)/python:
	$(PYTHON) -m venv $(VENV)
	$(PIP) install --quiet --upgrade pip

# Development environment: tests, lint, notebooks tooling; no torch.
$(VENV)/.installed: pyproject.toml clipjax/__init__.py | $(BIN)/python
	$(PIP) install -e ".[test]"
	@touch $@

# `make test-all` (CI): adds torch's CPU build and the torch references.
$(VENV)/.installed-references: $(VENV)/.installed
	$(PIP) install "$(TORCH)"
	$(PIP) install -e ".[references]" "$(TORCH)"
	@touch $@

# Lighter environments: no torch.
$(VENV)/.installed-examples: pyproject.toml | $(BIN)/python
	$(PIP) install -e ".[examples]"
	@touch $@

$(VENV)/.installed-bench: pyproject.toml | $(BIN)/python
	$(PIP) install -e ".[bench]"
	@touch $@

$(VENV)/.installed-lint: pyproject.toml | $(BIN)/python
	$(PIP) install "ruff>=0.8"
	@touch $@

# pyright resolves imports in this environment: clipjax's dependencies too.
$(VENV)/.installed-typecheck: pyproject.toml | $(BIN)/python
	$(PIP) install -e ".[typecheck]"
	@touch $@

$(VENV)/.installed-docs: pyproject.toml | $(BIN)/python
	$(PIP) install -e ".[docs]"
	@touch $@

$(VENV)/.installed-dist: pyproject.toml | $(BIN)/python
	$(PIP) install "build>=1.2" "twine>=5" "pytest>=8"
	@touch $@

$(BIN_MIN)/python:
	$(PYTHON) -m venv $(VENV_MIN)
	$(BIN_MIN)/python -m pip --disable-pip-version-check install --quiet --upgrade pip

# One resolver call: it fails if the declared minimums cannot be installed together.
$(VENV_MIN)/.installed: pyproject.toml Makefile | $(BIN_MIN)/python
	$(BIN_MIN)/python -m pip --disable-pip-version-check install -e . $(MIN_DEPS) $(MIN_TEST_DEPS)
	@touch $@

# The long runs carry the `slow` marker (their file's pytestmark, or the lists in
# tests/slow_marks.py): `make test` leaves them out, `make test-all` (and .ci/run)
# runs everything. Every test that needs torch is slow: `make test`'s
# environment has none.
test: $(VENV)/.installed
	$(BIN)/ruff check .
	$(BIN)/python -m pytest -n $(PYTEST_WORKERS) --dist worksteal -m "not slow"

test-all: $(VENV)/.installed-references
	$(BIN)/ruff check .
	$(BIN)/python -m pytest -n $(PYTEST_WORKERS) --dist worksteal

# The fast suite (`-m "not slow"`): what it checks is what the oldest versions
# must pass; the slow runs need flax, torch, the reference packages or Sphinx,
# which this environment leaves out. Tests that need a newer API skip, with
# their reason in the -ra summary.
test-min: $(VENV_MIN)/.installed
	$(BIN_MIN)/python -m pip --disable-pip-version-check freeze | grep -iE '^(jax|jaxlib|optax|chex|numpy)=='
	# tests/parallel uses jax.shard_map (newer than jax 0.4.36): the 8-device
	# tests run under `make test-all` only.
	$(BIN_MIN)/python -m pytest -n $(PYTEST_WORKERS) --dist worksteal -p no:cacheprovider -m "not slow" --ignore=tests/parallel --ignore=tests/multiprocess

lint: $(VENV)/.installed-lint
	$(BIN)/ruff check .
	$(BIN)/ruff format --check .
	$(MAKE) typecheck

typecheck: $(VENV)/.installed-typecheck
	$(BIN)/pyright --pythonpath $(BIN)/python

docs: $(VENV)/.installed-docs
	rm -rf $(DOCS_OUT)/html
	$(BIN)/sphinx-build -b html -W --keep-going -n $(SPHINXOPTS) docs $(DOCS_OUT)/html
	@echo "open $(DOCS_OUT)/html/index.html"

# Renders $(DOCS_OUT)/html (built by `make docs`) in the system's Chromium
# through playwright; skips, saying why, without Chromium or the site.
docs-check: $(VENV)/.installed
	CLIPJAX_DOCS_HTML=$(DOCS_OUT)/html $(BIN)/python -m pytest -p no:cacheprovider -n 0 -o addopts="-ra" tests/docs/test_docs_layout.py

dist: $(VENV)/.installed-dist
	rm -rf dist
	$(BIN)/python -m build
	$(BIN)/twine check --strict dist/*

# Installs the wheel from dist/ into a fresh venv (jax, optax, chex, numpy from
# the package index) and runs one update there.
test-wheel: dist
	CLIPJAX_TEST_WHEEL=1 $(BIN)/python -m pytest -p no:cacheprovider -p no:xdist --noconftest -o addopts="" -ra -q tests/release/test_wheel.py

format: $(VENV)/.installed-lint
	$(BIN)/ruff format .
	$(BIN)/ruff check --fix .

demo: $(VENV)/.installed-examples
	$(BIN)/python examples/demo.py

notebooks: $(VENV)/.installed
	CLIPJAX_NOTEBOOK_OUT=build/notebooks $(BIN)/python -m pytest tests/release/test_notebooks.py

bench: $(VENV)/.installed-bench
	$(BIN)/python benchmarks/run.py

clean:
	rm -rf build dist *.egg-info .pytest_cache .ruff_cache .hypothesis demo_out lm_out
	rm -rf docs/api.rst docs/notebooks docs/_build
	find . \( -path ./$(VENV) -o -path ./$(VENV_MIN) \) -prune -o -name __pycache__ -type d -exec rm -rf {} +

distclean: clean
	rm -rf $(VENV) $(VENV_MIN)
