# Quick start:  make demo   (few-shot CoOp on the bundled textile images)
#               make test   (the test suite, offline)
#               make gpu-check  (parity, speed and memory on one CUDA GPU)
# Each target creates .venv and installs the package first when needed: the exact set of releases
# the suite passed on (requirements-lock.txt), then the package itself without dependencies.
VENV ?= .venv
PY := $(VENV)/bin/python
PYTHON ?= python3
LOCK := requirements-lock.txt
UV ?= uv

.PHONY: demo test lint bench gpu-check install lock clean

$(VENV)/.installed: pyproject.toml $(LOCK)
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q -r $(LOCK)
	$(PY) -m pip install -q --no-deps -e .
	touch $@

install: $(VENV)/.installed

# Regenerate the lock from pyproject.toml's ranges (docs/development.md, "Dependencies"): pins that
# still satisfy them are kept; UPGRADE=--upgrade moves every pin, UPGRADE="--upgrade-package timm" one.
lock:
	$(UV) pip compile pyproject.toml --extra test --universal --python-version 3.11 $(UPGRADE) \
		--custom-compile-command "make lock" -o $(LOCK)

demo: $(VENV)/.installed
	$(PY) tools/demo.py $(ARGS)

# Two xdist workers at most (one per core on a 2-core machine), one intra-op thread each
# (tests/conftest.py). --dist loadfile keeps each test file on one worker, so module fixtures are
# built once and the Ray simulations of tests/test_federated.py run one at a time. PYTEST_WORKERS=0: serial.
# Each federated simulation holds ~4 GB (one Ray actor; docs/federated.md), so two side by side ~8 GB.
PYTEST_WORKERS ?= $(shell $(PYTHON) -c "import os; print(min(2, os.cpu_count() or 1))")

# Bytecode caching on (PYTHONDONTWRITEBYTECODE emptied; containers often set it): the suite starts
# each worker and the tools the tests run in fresh interpreters, which would otherwise compile
# the package's and the tests' sources again every time (__pycache__ is ignored by git).
test: $(VENV)/.installed
	PYTHONDONTWRITEBYTECODE= $(PY) -m pytest -q -n $(PYTEST_WORKERS) --dist loadfile

lint: $(VENV)/.installed
	$(VENV)/bin/ruff check coop tools tests
	$(VENV)/bin/ruff format --check coop tools tests

bench: $(VENV)/.installed
	$(PY) tools/bench/bench_text.py
	$(PY) tools/bench/bench_train.py
	$(PY) tools/bench/bench_ddp.py --model ViT-B-32 --shots 4 --batch-size 4
	$(PY) tools/bench/bench_threads.py

# Parity, text speed-up, peak memory and epoch time on one CUDA GPU (~5 min); writes gpu_check.json.
# Without CUDA it says so and exits 0. ARGS="--quick" uses fewer images for the epoch.
gpu-check: $(VENV)/.installed
	$(PY) tools/bench/gpu_check.py $(ARGS)

clean:
	rm -rf $(VENV) .pytest_cache
