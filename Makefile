# draftsmith: `make demo` runs the whole pipeline on the embedded default; `make test` runs the suite.
PY ?= python3
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed
RECIPE ?= recipes/demo/stdlib-code-eagle3.yaml

.PHONY: setup demo test test-long test-parallel test-fast bench gpu-check clean

$(STAMP): pyproject.toml
	test -d $(VENV) || $(PY) -m venv $(VENV)
	$(BIN)/pip install -q --upgrade pip
	$(BIN)/pip install -q torch==2.13.0
	$(BIN)/pip install -q -e '.[dev]'
	touch $(STAMP)

setup: $(STAMP)

demo: $(STAMP)
	$(BIN)/draftsmith run --recipe $(RECIPE)

# three tiers, all run by CI (.ci/run): everything but the tiers below; the whole pipeline on every architecture
# (marker long); the multi-process sharded-target tests (marker parallel)
test: $(STAMP)
	$(BIN)/python -m pytest -q --timeout=900 -m "not parallel and not long" tests

test-long: $(STAMP)
	$(BIN)/python -m pytest -q --timeout=900 -m "long and not parallel" tests

test-parallel: $(STAMP)
	$(BIN)/python -m pytest -q --timeout=900 -m parallel tests

test-fast: $(STAMP)
	$(BIN)/python -m pytest -q -m "not slow" tests

bench: $(STAMP)
	$(BIN)/python -m draftsmith.bench --recipe $(RECIPE) --out BENCHMARKS.md

gpu-check: $(STAMP)
	$(BIN)/python scripts/gpu_check.py

clean:
	rm -rf runs .pytest_cache
