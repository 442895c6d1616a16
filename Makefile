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

.PHONY: demo test test-gpu test-bounds test-lowest test-newest bounds-env-lowest \
	bounds-env-newest bounds-check-lowest bounds-check-newest lint format docs docs-screenshots \
	bench clean

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

# The CPU suite on TEST_WORKERS pytest-xdist processes, each with its share of the cores as
# torch threads; --dist loadfile keeps each module on one worker, and the modules that spawn
# gloo ranks on one worker together (tests/conftest.py). TEST_WORKERS=0: in this process.
TEST_WORKERS ?= 2

test: $(STAMP)
	$(PY) -m pytest -q -m "not gpu and not slow" -p no:cacheprovider -n $(TEST_WORKERS) \
		--dist loadfile

test-gpu: $(STAMP)
	$(PY) -m pytest -q -m gpu

# Both ends of the supported versions, each in a venv of its own under BOUNDS_DIR, built anew:
# LOWEST is pyproject.toml's lower bounds (and the lowest Triton, for the interpreter tests),
# NEWEST the newest releases. Torch is installed first, with BOUNDS_TORCH_ARGS, then the other
# requirements, then the package with its test extra, which must leave that torch in place
# (checked). Every subpackage is imported, then BOUNDS_TESTS runs (default: the CPU suite;
# SMOKE_TESTS is the shorter set that CI runs at the lowest versions). On Linux PyPI's torch is
# the CUDA build (several GB per venv); BOUNDS_TORCH_ARGS="--index-url $(TORCH_CPU_INDEX)" takes
# the CPU build (about 175 MB for torch 2.6). A pip constraint file that caps torch
# (PIP_CONSTRAINT, pip.conf) caps NEWEST too: lift it for the run, e.g.
# `make test-newest BOUNDS_PIP_ENV=PIP_CONFIG_FILE=/dev/null`.
BOUNDS_DIR ?= .venv-bounds
LOWEST ?= torch==2.6.0 triton==3.2.0 numpy==1.24.4 scipy==1.10.1
NEWEST ?= torch numpy scipy
BOUNDS_PIP_ENV ?=
BOUNDS_TORCH_ARGS ?=
TORCH_CPU_INDEX := https://download.pytorch.org/whl/cpu
SMOKE_TESTS := tests/test_solver.py tests/test_losses.py tests/test_gradients.py \
	tests/test_validation.py tests/test_compile.py tests/test_otdd.py tests/test_hvp.py \
	tests/test_multiscale.py tests/test_distributed.py tests/mhc/test_layer_ops.py \
	tests/test_coupling_api.py
BOUNDS_TESTS ?= -m "not gpu and not slow" tests
SUBPACKAGES := flashsinkhorn flashsinkhorn.otdd flashsinkhorn.distributed flashsinkhorn.hessian \
	flashsinkhorn.mhc flashsinkhorn.multiscale flashsinkhorn.coupling

# $(1): venv name, $(2): the requirements (torch's first and alone: BOUNDS_TORCH_ARGS, an index
# of torch builds, applies to it only)
define bounds_env
	rm -rf $(BOUNDS_DIR)/$(1)
	$(PYTHON) -m venv $(BOUNDS_DIR)/$(1)
	$(BOUNDS_PIP_ENV) $(BOUNDS_DIR)/$(1)/bin/python -m pip install -q --upgrade \
		$(BOUNDS_TORCH_ARGS) $(filter torch%,$(2))
	$(BOUNDS_PIP_ENV) $(BOUNDS_DIR)/$(1)/bin/python -m pip install -q --upgrade \
		$(filter-out torch%,$(2))
	$(BOUNDS_DIR)/$(1)/bin/python -c "import torch; print(torch.__version__)" \
		> $(BOUNDS_DIR)/$(1)/torch-before
	$(BOUNDS_PIP_ENV) $(BOUNDS_DIR)/$(1)/bin/python -m pip install -q -e ".[test]"
endef

# $(1): venv name
define bounds_check
	$(BOUNDS_DIR)/$(1)/bin/python -c "import torch; print(torch.__version__)" \
		| cmp - $(BOUNDS_DIR)/$(1)/torch-before || (echo "the test extra replaced torch"; exit 1)
	$(BOUNDS_DIR)/$(1)/bin/python -c "import importlib, numpy, scipy, torch, triton; \
		[importlib.import_module(m) for m in '$(SUBPACKAGES)'.split()]; \
		print('$(1): torch', torch.__version__, 'triton', triton.__version__, 'numpy', \
		numpy.__version__, 'scipy', scipy.__version__, '| imported $(SUBPACKAGES)')"
	$(BOUNDS_DIR)/$(1)/bin/python -m pytest -q -p no:cacheprovider $(BOUNDS_TESTS)
endef

bounds-env-lowest:
	$(call bounds_env,lowest,$(LOWEST))

bounds-env-newest:
	$(call bounds_env,newest,$(NEWEST))

bounds-check-lowest:
	$(call bounds_check,lowest)

bounds-check-newest:
	$(call bounds_check,newest)

test-lowest: bounds-env-lowest
	$(MAKE) bounds-check-lowest

test-newest: bounds-env-newest
	$(MAKE) bounds-check-newest

test-bounds: test-lowest test-newest

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
	rm -rf $(VENV) $(BOUNDS_DIR) build dist site *.egg-info .pytest_cache .ruff_cache
