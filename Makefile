# Installs CPU torch first (a pinned wheel already on disk), then the package.
PY ?= python3
VENV ?= .venv
BIN := $(VENV)/bin
TORCH_VERSION ?= 2.13.0

.PHONY: install run test clean

$(BIN)/python:
	$(PY) -m venv $(VENV)
	$(BIN)/pip install -q --upgrade pip

install: $(BIN)/python
	$(BIN)/pip install -q torch==$(TORCH_VERSION)
	$(BIN)/pip install -q -e '.[dev]'

run: install
	$(BIN)/qual run --dcp 4

test: install
	$(BIN)/python -m pytest -q

clean:
	rm -rf $(VENV) build *.egg-info
