# Two commands do everything on a fresh machine (Python 3.11, no torch, no venv):
#   make demo   - the main job: compile a built-in model and show the result
#   make test   - the test suite
# Both create .venv (with --system-site-packages, so a torch you already have — e.g. a CUDA build — is kept)
# and install the CPU build of torch into it only when no torch is importable.
# make typecheck runs mypy on the package (CI runs it after make test); make docs builds docs/ into build/docs
# (warnings and unresolved references are errors).

PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.rpcompile-installed
TORCH_CPU ?= torch==2.13.0
PYTEST_ARGS ?=
# pytest-xdist workers for make test (the suite is CPU-bound: one per core of the 2-core reference machine);
# worksteal: each worker starts on a contiguous half (a file's tests share their saved-segment captures) and
# steals from the other at the end; a crashed worker's tests are rescheduled, as with load
PYTEST_WORKERS ?= 2

# transformers versions the HF tests also run against (pyproject allows >=4.50): each installs into .tf/VERSION
TRANSFORMERS_VERSIONS ?= 4.50.3 4.57.6 5.17.0

.PHONY: demo test test-slow test-compat typecheck docs setup clean adamw

demo: $(STAMP)
	$(VENV)/bin/rpcompile demo

# the C++ AdamW's tests run, never skip: the kernel is built first (into torch's extension cache,
# ~/.cache/torch_extensions, which keeps it between runs: about 30 s on 2 cores when cold, 2 s when current)
test: $(STAMP) adamw
	RPCOMPILE_TEST_CPP_ADAMW=required $(PY) -m pytest -q -n $(PYTEST_WORKERS) --dist worksteal --durations=10 $(PYTEST_ARGS)

# build (or find current) the one-pass C++ AdamW (runtime/csrc/adamw.cpp) the GPU benchmarks use by default
adamw: $(STAMP)
	$(PY) -c "from rpcompile.runtime.optim import build_extension as b; print('C++ AdamW:', b())"

test-slow: $(STAMP)
	$(PY) -m pytest -q -m slow $(PYTEST_ARGS)

# mypy with pyproject's [tool.mypy], through .ci/typecheck.py so passes/ and runtime/ get their installed names
typecheck: $(STAMP)
	$(PY) .ci/typecheck.py

# the user guide and API reference (docs/): -W -n, so a warning or a reference to a moved or removed name fails
docs: $(STAMP)
	$(PY) -c "import sphinx, myst_parser" 2>/dev/null || $(PY) -m pip install -q -e ".[docs]"
	$(PY) -m sphinx -W -n --keep-going -q -b html docs build/docs

test-compat: $(STAMP)
	for v in $(TRANSFORMERS_VERSIONS); do \
	  test -d .tf/$$v || $(PY) -m pip install -q --target .tf/$$v "transformers==$$v" || exit 1; \
	  echo "HF tests with transformers $$v"; \
	  PYTHONPATH=.tf/$$v RPCOMPILE_GPU_TESTS_ON_CPU=1 $(PY) -m pytest -q -m hf -p no:cacheprovider || exit 1; \
	done

setup: $(STAMP)

$(STAMP): pyproject.toml
	test -x $(PY) || $(PYTHON) -m venv --system-site-packages $(VENV)
	$(PY) -c "import torch" 2>/dev/null || $(PY) -m pip install -q "$(TORCH_CPU)"
	$(PY) -m pip install -q -e ".[test]"
	touch $(STAMP)

clean:
	rm -rf $(VENV) .tf build *.egg-info .pytest_cache .hypothesis .mypy_cache
