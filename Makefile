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

.PHONY: demo test test-gpu lint format docs bench clean

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

# The site (mkdocs.yml) with the API reference from the docstrings; warnings are errors.
docs: $(DOCS_STAMP)
	$(VENV)/bin/mkdocs build --strict

lint: $(STAMP)
	$(VENV)/bin/ruff check flashsinkhorn tests bench examples
	$(VENV)/bin/ruff format --check flashsinkhorn tests bench examples

format: $(STAMP)
	$(VENV)/bin/ruff format flashsinkhorn tests bench examples
	$(VENV)/bin/ruff check --fix flashsinkhorn tests bench examples

clean:
	rm -rf $(VENV) build dist site *.egg-info .pytest_cache .ruff_cache
