# Set-up and everyday commands. `make demo` and `make test` work on a fresh machine: each creates the
# virtual environment it needs (Python >= 3.12, found by scripts/find_python.sh).
VENV ?= .venv
PY := $(VENV)/bin/python

.PHONY: venv demo test test-fast lint gpu-test gpu-test-deps bench clean

$(VENV)/.installed: pyproject.toml
	@PYTHON_BIN=$$(scripts/find_python.sh) && echo "using $$PYTHON_BIN" && "$$PYTHON_BIN" -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	$(PY) -m pip install -q -e ".[test]"
	@touch $@

venv: $(VENV)/.installed

demo: venv
	$(PY) examples/demo.py

# A test whose worker process dies runs once more in a new worker (a safety net: the crashes seen until 2026-12-01,
# segfaults in XLA's CPU compiler, were workers out of memory mappings, which tests/conftest.py now prevents); an
# ordinary failure never does (--only-rerun matches no failure message), and the summary counts reruns.
CRASH_RERUN := --reruns 1 --only-rerun '^jsparse: no ordinary failure matches this$$'

# One worker per core (pytest-xdist): the suite's time is mostly XLA compiling, which runs on one core per test.
test: venv
	$(PY) -m pytest -q -n auto $(CRASH_RERUN)

# Everything but the tests marked slow (the notebooks): the everyday loop while editing.
test-fast: venv
	$(PY) -m pytest -q -n auto -m "not slow" $(CRASH_RERUN)

# ruff (pyproject's [tool.ruff]) over the code; `pip install ruff` or the dev extra.
lint:
	$(PY) -m ruff check .

# On a GPU machine (jax with CUDA already installed there): the real Triton kernels against the XLA path.
# Several workers share the one GPU: a GPU test's time is mostly compiling its Triton programs, on one CPU core.
# The GPU image lacks pytest-xdist and hypothesis and is offline: `make gpu-test-deps` here copies them into
# .gpu_test_deps (carry it); without xdist the tests run one after another (~45 min).
GPU_TEST_WORKERS ?= 8
gpu-test:
	python3 -m pip install -e . --no-deps --no-build-isolation -q
	export PYTHONPATH="$${PYTHONPATH:+$$PYTHONPATH:}$(CURDIR)/.gpu_test_deps" && python3 -m pytest -m gpu tests -q \
	  $$(python3 -c "import xdist" 2>/dev/null && echo "-n $(GPU_TEST_WORKERS)")

gpu-test-deps: venv
	$(PY) scripts/gpu_test_deps.py .gpu_test_deps

# On a GPU machine: the benchmark suite side by side with FlexGEMM (see BENCHMARKS.md).
bench:
	bash scripts/gpu_session.sh suite kernels

clean:
	rm -rf $(VENV) .pytest_cache *.egg-info
