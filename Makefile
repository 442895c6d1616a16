# Quick start: `make demo` and `make test` each create .venv, install, and run.
PYTHON ?= $(shell command -v python3.11 || command -v python3)
VENV := .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed
# torch is installed first, from TORCH_SPEC with PIP_TORCH_ARGS. On plain PyPI (Linux)
# torch==2.13.0 is the CUDA build (~17 nvidia-* packages, several GB, with its own Triton);
# on the CI machines it resolves to a local CPU wheel. A CPU-only machine elsewhere:
#   make test PIP_TORCH_ARGS="--index-url https://download.pytorch.org/whl/cpu"
# A torch already importable in .venv is kept.
TORCH_SPEC ?= torch==2.13.0
PIP_TORCH_ARGS ?=

.PHONY: demo test test-gpu lint format docs docs-screenshots bench clean

$(STAMP): pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	$(PY) -c "import torch" 2>/dev/null || $(PY) -m pip install -q $(PIP_TORCH_ARGS) "$(TORCH_SPEC)"
	$(PY) -m pip install -q -e ".[test,dev]"
	touch $(STAMP)

# The demo's own dependency (matplotlib, the `demo` extra) only for `make demo`.
DEMO_STAMP := $(VENV)/.demo-installed

$(DEMO_STAMP): $(STAMP)
	$(PY) -m pip install -q -e ".[demo]"
	touch $(DEMO_STAMP)

demo: $(DEMO_STAMP)
	$(PY) examples/demo.py

test: $(STAMP)
	$(PY) -m pytest -q -m "not gpu and not slow" -p no:cacheprovider

test-gpu: $(STAMP)
	$(PY) -m pytest -q -m gpu

DOCS_STAMP := $(VENV)/.docs-installed

$(DOCS_STAMP): $(STAMP)
	$(PY) -m pip install -q -e ".[docs]"
	touch $(DOCS_STAMP)

# The site (mkdocs.yml) with the API reference from the docstrings; warnings are errors. Then
# the checks of the built HTML (tools/docs/test_site.py). KaTeX comes from npm on the first
# build and is kept in build/katex. `make docs-screenshots` (Debian's chromium) shows the home,
# quick start, API and performance pages at 1280 and 400 px in out/screenshots.
docs: $(DOCS_STAMP)
	NO_MKDOCS_2_WARNING=1 $(VENV)/bin/mkdocs build --strict
	$(PY) -m pytest -q -p no:cacheprovider tools/docs/test_site.py

docs-screenshots: docs
	$(PY) tools/docs/screenshots.py

lint: $(STAMP)
	$(VENV)/bin/ruff check flashsinkhorn tests bench examples tools
	$(VENV)/bin/ruff format --check flashsinkhorn tests bench examples tools

format: $(STAMP)
	$(VENV)/bin/ruff format flashsinkhorn tests bench examples tools
	$(VENV)/bin/ruff check --fix flashsinkhorn tests bench examples tools

clean:
	rm -rf $(VENV) build dist site *.egg-info .pytest_cache .ruff_cache
