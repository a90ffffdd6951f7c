# Two commands for a newcomer (README): `make demo` runs the main job, `make test` runs the tests.
# Both set up .venv (Python 3.12) and build the C++/CUDA core in place first.
SHELL := /bin/bash
export PYENV_VERSION ?= 3.12.1
PYTHON312 ?= $(shell command -v python3.12 || command -v python3)
VENV := .venv
PY := $(VENV)/bin/python

.PHONY: demo test build venv clean

demo: build
	$(PY) -m tide demo

test: build
	$(PY) -m pytest -q tests $(PYTEST_ARGS)

build: $(VENV)/.stamp
	PYTHON=$(PY) tools/build.sh

venv: $(VENV)/.stamp

$(VENV)/.stamp: requirements/base.txt requirements/frameworks.txt
	test -x $(PY) || $(PYTHON312) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	$(PY) -m pip install -q -r requirements/base.txt
	$(PY) -m pip install -q -r requirements/frameworks.txt
	touch $@

clean:
	rm -rf build tide/_core*.so tide_xla/_ffi*.so
