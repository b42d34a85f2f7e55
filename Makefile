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

setup: $(BIN)/python
	@$(BIN)/python -c "import torch" 2>/dev/null || $(BIN)/python -m pip install -q "$(TORCH)" numpy
	$(BIN)/python -m pip install -q -e ".[dev]"

demo: setup
	$(BIN)/perfmon demos/train_mlp.py --steps 20000

test: setup
	$(BIN)/python -m pytest -q

lint: setup
	$(BIN)/ruff check perfmon tests demos benchmarks

bench: setup
	$(BIN)/python benchmarks/overhead.py

clean:
	rm -rf $(VENV) perfmon-runs .pytest_cache
