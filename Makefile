# clipjax developer commands. Every target builds the virtual environment it
# needs from nothing: `make test` on a fresh clone is all CI does.

VENV ?= .venv
PYTHON ?= python3
PYTEST_WORKERS ?= 2

BIN := $(VENV)/bin
PIP := $(BIN)/python -m pip --disable-pip-version-check
# zclip and drytorch (test references) depend on torch. Installed first and
# kept pinned, torch resolves to the CPU wheel on the machine's pip index;
# left to the resolver it pulls the CUDA build and gigabytes of wheels.
TORCH ?= torch==2.13.0

.PHONY: help test lint format demo notebooks bench clean distclean

help:
	@echo "make demo       train a small model with injected gradient spikes (examples/demo.py)"
	@echo "make notebooks  run notebooks/*.ipynb top to bottom; executed copies in build/notebooks/"
	@echo "make test       ruff check, then pytest (tests/ and doctests)"
	@echo "make lint       ruff check and ruff format --check"
	@echo "make format     ruff format and ruff check --fix"
	@echo "make bench      run benchmarks/run.py"
	@echo "make clean      remove caches, build outputs, demo_out/ and lm_out/"
	@echo "make distclean  clean, and remove $(VENV)"

$(BIN)/python:
	$(PYTHON) -m venv $(VENV)
	$(PIP) install --quiet --upgrade pip

# Full development environment: tests, lint, notebooks tooling.
$(VENV)/.installed: pyproject.toml | $(BIN)/python
	$(PIP) install "$(TORCH)"
	$(PIP) install -e ".[test]" "$(TORCH)"
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

test: $(VENV)/.installed
	$(BIN)/ruff check .
	$(BIN)/python -m pytest -n $(PYTEST_WORKERS)

lint: $(VENV)/.installed-lint
	$(BIN)/ruff check .
	$(BIN)/ruff format --check .

format: $(VENV)/.installed-lint
	$(BIN)/ruff format .
	$(BIN)/ruff check --fix .

demo: $(VENV)/.installed-examples
	$(BIN)/python examples/demo.py

notebooks: $(VENV)/.installed
	CLIPJAX_NOTEBOOK_OUT=build/notebooks $(BIN)/python -m pytest tests/test_notebooks.py

bench: $(VENV)/.installed-bench
	$(BIN)/python benchmarks/run.py

clean:
	rm -rf build dist *.egg-info .pytest_cache .ruff_cache .hypothesis demo_out lm_out
	find . -path ./$(VENV) -prune -o -name __pycache__ -type d -exec rm -rf {} +

distclean: clean
	rm -rf $(VENV)
