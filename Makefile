# Two commands for a newcomer (README): `make demo` runs the main job, `make test` runs the tests.
# Both set up .venv (Python 3.12), build the C++/CUDA core in place and install the `tide`
# command (.venv/bin/tide, the checkout on the venv's path: tools/install_launcher.py) first.
# `make test` then runs the tide_torch tests and the demo's tests a second time on the newest
# torch release (.venv-torch-newest, requirements/torch-newest.txt; torch-newest-nodeps.txt,
# torchtitan for tests/test_torch_titan.py, without its Trainer's dependencies), next to the
# same core.
SHELL := /bin/bash
export PYENV_VERSION ?= 3.12.1
PYTHON312 ?= $(shell command -v python3.12 || command -v python3)
VENV := .venv
PY := $(VENV)/bin/python
VENV_NEWEST := .venv-torch-newest
PY_NEWEST := $(VENV_NEWEST)/bin/python
# The test files that exercise tide_torch on the CPU (FSDP2 over gloo) and `tide demo`.
TORCH_TESTS := $(wildcard tests/test_torch_*.py) tests/test_demo.py

.PHONY: demo test test-torch-newest build venv venv-torch-newest clean

demo: build
	$(PY) -m tide_apps demo

test: build venv-torch-newest
	$(PY) -m pytest -q tests $(PYTEST_ARGS)
	$(MAKE) --no-print-directory test-torch-newest

test-torch-newest: build venv-torch-newest
	@echo "tide_torch on $$($(PY_NEWEST) -c 'import torch; print("torch", torch.__version__)')"
	$(PY_NEWEST) -m pytest -q $(TORCH_TESTS) $(PYTEST_ARGS)

build: $(VENV)/.stamp
	PYTHON=$(PY) tools/build.sh
	$(PY) tools/install_launcher.py

venv: $(VENV)/.stamp

venv-torch-newest: $(VENV_NEWEST)/.stamp

$(VENV)/.stamp: requirements/base.txt requirements/frameworks.txt
	test -x $(PY) || $(PYTHON312) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	$(PY) -m pip install -q -r requirements/base.txt
	$(PY) -m pip install -q -r requirements/frameworks.txt
	touch $@

$(VENV_NEWEST)/.stamp: requirements/base.txt requirements/torch-newest.txt \
		requirements/torch-newest-nodeps.txt
	test -x $(PY_NEWEST) || $(PYTHON312) -m venv $(VENV_NEWEST)
	$(PY_NEWEST) -m pip install -q --upgrade pip
	$(PY_NEWEST) -m pip install -q -r requirements/base.txt -r requirements/torch-newest.txt
	$(PY_NEWEST) -m pip install -q --no-deps -r requirements/torch-newest-nodeps.txt
	touch $@

clean:
	rm -rf build tide/_core*.so tide_xla/_ffi*.so
