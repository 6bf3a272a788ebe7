# Quick start:  make demo   (few-shot CoOp on the bundled textile images)
#               make test   (the test suite, offline)
# Each target creates .venv and installs the package first when needed.
VENV ?= .venv
PY := $(VENV)/bin/python
PYTHON ?= python3

.PHONY: demo test lint bench install clean

$(VENV)/.installed: pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q -e '.[test]'
	touch $@

install: $(VENV)/.installed

demo: $(VENV)/.installed
	$(PY) tools/demo.py $(ARGS)

test: $(VENV)/.installed
	$(PY) -m pytest -q

lint: $(VENV)/.installed
	$(VENV)/bin/ruff check coop tools tests
	$(VENV)/bin/ruff format --check coop tools tests

bench: $(VENV)/.installed
	$(PY) tools/bench_text.py
	$(PY) tools/bench_train.py

clean:
	rm -rf $(VENV) .pytest_cache
