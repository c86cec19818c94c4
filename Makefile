# Two entry points for a fresh machine: `make demo` and `make test` (see README.md).
PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed-v4
# Exact tested versions; pyproject.toml holds the ranges a user's repository installs against.
CONSTRAINTS := constraints.txt

.PHONY: demo test test-fast lint lint-style lint-types check-install bench gpu-check gpu-check-data gpu-check-wheels venv clean

venv: $(STAMP)

# torchrec goes in with --no-deps: it declares the CUDA fbgemm-gpu and torchmetrics==1.0.3; its real
# runtime needs come with the [train] extra (docs/api.md).
$(STAMP): pyproject.toml $(CONSTRAINTS)
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	$(PY) -m pip install -q -c $(CONSTRAINTS) -e '.[train-cpu,report,ray,test]'
	$(PY) -m pip install -q -c $(CONSTRAINTS) --no-deps torchrec
	$(PY) -c "import torchrec, fbgemm_gpu, polars, pyarrow, ortools, ray.data, psutil"
	touch $(STAMP)

demo: $(STAMP)
	$(PY) -m pipelines.demo

# One pytest worker per core (pytest-xdist); tests/conftest.py says which tests share a worker (--dist loadgroup).
PYTEST_PARALLEL ?= -n auto --dist loadgroup

test: $(STAMP)
	$(PY) -m pytest -q $(PYTEST_PARALLEL)

test-fast: $(STAMP)
	$(PY) -m pytest -q $(PYTEST_PARALLEL) -m "not slow and not multiproc"

# ruff (pyproject.toml [tool.ruff]) and mypy with no error beyond those recorded in mypy-baseline.txt; .ci/run runs it
# before the tests, .pre-commit-config.yaml on commit.
lint: lint-style lint-types

lint-style: $(STAMP)
	$(PY) -m ruff check .

lint-types: $(STAMP)
	@out=$$($(PY) -m mypy 2>&1); rc=$$?; \
	if [ $$rc -gt 1 ]; then echo "$$out"; echo "mypy could not run (exit $$rc)"; exit $$rc; fi; \
	echo "$$out" | $(VENV)/bin/mypy-baseline filter && echo "mypy: no error beyond mypy-baseline.txt"

# Fresh venvs built with docs/api.md's install lines (with and without torch preinstalled) plus a
# resolution-only check of the torch/fbgemm pairing; part of `make test` too (marked slow).
check-install: $(STAMP)
	$(PY) -m pytest -q tests/test_install.py tests/test_api_docs.py tests/fstrain/test_compat.py

bench: $(STAMP)
	$(PY) -m benchmarks.run_all

# The GPU check (docs/comm.md, "The GPU check"): with the $(PYTHON) that already has torch (a lent GPU
# image: torch, pyarrow, numba, pytest; nothing to download) it runs straight from the repository;
# otherwise it builds the virtual environment first. GPU_CHECK_ARGS, e.g. --quick or --dry-run.
GPU_CHECK_ARGS ?=
gpu-check:
	@if $(PYTHON) -c "import torch, pyarrow, numba" 2>/dev/null; then \
		echo "PYTHONPATH=. $(PYTHON) -m benchmarks.gpu_check $(GPU_CHECK_ARGS)"; \
		PYTHONPATH=$(CURDIR)$${PYTHONPATH:+:$$PYTHONPATH} $(PYTHON) -m benchmarks.gpu_check $(GPU_CHECK_ARGS); \
	else \
		$(MAKE) venv && $(PY) -m benchmarks.gpu_check $(GPU_CHECK_ARGS); \
	fi

# torchrec for the GPU check's pipeline_cpu section: the builds matching the GPU image's torch 2.11 and
# Python 3.12 (git-ignored gpu-check-wheels/, ~8 MB; the image cannot download).
gpu-check-wheels:
	$(PYTHON) -m pip download --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
		--platform manylinux_2_28_x86_64 --platform manylinux2014_x86_64 -d gpu-check-wheels \
		$$(PYTHONPATH=$(CURDIR) $(PYTHON) -c "from benchmarks.gpu_pipeline_cpu import WHEEL_PINS; print(*WHEEL_PINS)")

# The GPU check's inputs (git-ignored gpu-check-data/), written on the CPU side before a GPU is lent.
gpu-check-data:
	PYTHONPATH=$(CURDIR)$${PYTHONPATH:+:$$PYTHONPATH} $(PYTHON) -m benchmarks.gpu_check --prepare

clean:
	rm -rf $(VENV) .pytest_cache build *.egg-info
