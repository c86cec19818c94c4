# Two entry points for a fresh machine: `make demo` and `make test` (see README.md).
PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed-v2
TORCHREC := torchrec==1.9.2

.PHONY: demo test test-fast bench venv clean

venv: $(STAMP)

$(STAMP): pyproject.toml
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	$(PY) -m pip install -q -e '.[test,ray]'
	$(PY) -m pip install -q --no-deps $(TORCHREC)
	$(PY) -c "import torchrec, fbgemm_gpu, polars, pyarrow, ortools, ray.data, psutil"
	touch $(STAMP)

demo: $(STAMP)
	$(PY) -m pipelines.demo

test: $(STAMP)
	$(PY) -m pytest -q

test-fast: $(STAMP)
	$(PY) -m pytest -q -m "not slow and not multiproc"

bench: $(STAMP)
	$(PY) -m benchmarks.run_all

clean:
	rm -rf $(VENV) .pytest_cache build *.egg-info
