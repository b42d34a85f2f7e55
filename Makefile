# Two entry points for a fresh machine:
#   make demo   set up .venv and open the dashboard on a bundled demo
#   make test   set up .venv (with dev tools) and run the whole test suite
# torch is installed only if the venv lacks it; override the spec for your build, e.g.
#   make demo TORCH="torch==2.13.0"   (a CPU wheel where one is available; see README "Installing")
PY ?= python3
VENV ?= .venv
TORCH ?= torch==2.13.0
BIN := $(VENV)/bin

.PHONY: demo test setup lint bench screenshots clean

$(BIN)/python:
	$(PY) -m venv $(VENV)
	$(BIN)/python -m pip install -q --upgrade pip

# installed once, again only when what the install builds from changes (the C hot path, the dependencies): an
# editable install sees every other change as it is made
STAMP := $(VENV)/.perfmon-installed

$(STAMP): pyproject.toml setup.py perfmon/agent/_hot.c | $(BIN)/python
	@$(BIN)/python -c "import torch" 2>/dev/null || $(BIN)/python -m pip install -q "$(TORCH)" numpy
	$(BIN)/python -m pip install -q -e ".[dev]"
	@touch $@

setup: $(STAMP)

demo: setup
	$(BIN)/perfmon demos/train_mlp.py --steps 20000

# The suite starts hundreds of Python processes: bytecode cached in the venv (even where the environment sets
# PYTHONDONTWRITEBYTECODE) spares each one compiling perfmon's modules and the tests' scripts again (~15% of the
# suite's CPU), and keeps the checkout free of __pycache__
test: setup
	PYTHONPYCACHEPREFIX=$(abspath $(VENV))/pycache PYTHONDONTWRITEBYTECODE= $(BIN)/python -m pytest -q -n 2 --dist loadfile

lint: setup
	$(BIN)/ruff check perfmon tests demos benchmarks

bench: setup
	$(BIN)/python benchmarks/agent_cpu.py --job tiny
	$(BIN)/python benchmarks/hook_floor.py --job mlp
	$(BIN)/python benchmarks/overhead.py
	$(BIN)/python benchmarks/agent_threads.py --job mlp
	$(BIN)/python benchmarks/agent_blocks.py --job mlp --pairs 30
	$(BIN)/python benchmarks/dashboard_cpu.py --job mlp

clean:
	rm -rf $(VENV) perfmon-runs .pytest_cache

# Torch compatibility, not part of `make test`: for the oldest supported torch and the newest this
# machine's pip allows, a venv .venv-compat-<ver> (made once; CUDA wheels from PyPI, ~5 GB each)
# runs the loop-shape end-to-end tests and the corpus. Other versions:
#   make test-compat COMPAT_TORCH="2.4.1 2.13.0"
COMPAT_TORCH ?= 2.4.1 2.14.1

.PHONY: test-compat
test-compat:
	@status=0; for v in $(COMPAT_TORCH); do \
	  venv=.venv-compat-$$v; \
	  echo "== torch $$v ($$venv)"; \
	  if [ ! -x $$venv/bin/python ]; then $(PY) -m venv $$venv && $$venv/bin/python -m pip install -q --upgrade pip || exit 1; fi; \
	  $$venv/bin/python -c "import sys, torch; sys.exit(torch.__version__.split('+')[0] != '$$v')" 2>/dev/null || \
	    $$venv/bin/python -m pip install -q "torch==$$v" "numpy<2" || exit 1; \
	  $$venv/bin/python -m pip install -q -e ".[dev]" || exit 1; \
	  $$venv/bin/python -m pytest -q -m e2e -k loop_shape tests/test_e2e.py || status=1; \
	  $$venv/bin/python -m pytest -q tests/test_corpus.py || status=1; \
	done; exit $$status
