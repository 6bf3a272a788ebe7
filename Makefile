# Quick start:  make demo   (few-shot CoOp on the bundled textile images)
#               make test   (the test suite, offline)
#               make gpu-check  (parity, speed and memory on one CUDA GPU)
# Each target creates .venv and installs the package first when needed.
VENV ?= .venv
PY := $(VENV)/bin/python
PYTHON ?= python3

.PHONY: demo test lint bench gpu-check install clean

$(VENV)/.installed: pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q -e '.[test]'
	touch $@

install: $(VENV)/.installed

demo: $(VENV)/.installed
	$(PY) tools/demo.py $(ARGS)

# Two xdist workers at most (one per core on a 2-core machine), one intra-op thread each
# (tests/conftest.py). --dist loadfile keeps each test file on one worker, so module fixtures are
# built once and the Ray simulations of tests/test_federated.py run one at a time. PYTEST_WORKERS=0: serial.
# Each federated simulation holds ~4 GB (one Ray actor; docs/federated.md), so two side by side ~8 GB.
PYTEST_WORKERS ?= $(shell $(PYTHON) -c "import os; print(min(2, os.cpu_count() or 1))")

test: $(VENV)/.installed
	$(PY) -m pytest -q -n $(PYTEST_WORKERS) --dist loadfile

lint: $(VENV)/.installed
	$(VENV)/bin/ruff check coop tools tests
	$(VENV)/bin/ruff format --check coop tools tests

bench: $(VENV)/.installed
	$(PY) tools/bench_text.py
	$(PY) tools/bench_train.py
	$(PY) tools/bench_ddp.py --model ViT-B-32 --shots 4 --batch-size 4

# Parity, text speed-up, peak memory and epoch time on one CUDA GPU (~5 min); writes gpu_check.json.
# Without CUDA it says so and exits 0. ARGS="--quick" uses fewer images for the epoch.
gpu-check: $(VENV)/.installed
	$(PY) tools/gpu_check.py $(ARGS)

clean:
	rm -rf $(VENV) .pytest_cache
