# Two commands for a fresh Linux machine with Python 3.11 and make:
#   make run   - the main job (the best demo the project has so far)
#   make test  - the test suite
# Both create or reuse the local virtualenv .venv.
PYTHON ?= python3
VENV   := .venv
PY     := $(VENV)/bin/python
# CPU torch, pinned: a looser spec pulls a multi-GB CUDA build (GPU users: pip install -e '.[replica,gpu]').
TORCH  ?= torch==2.13.0
STAMP  := $(VENV)/.installed

.PHONY: venv run test proto lint bench clean

venv: $(STAMP)

$(STAMP): pyproject.toml
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	$(PY) -m pip install -q "$(TORCH)"
	$(PY) -m pip install -q -e '.[replica,dev]'
	touch $(STAMP)

run: venv
	$(PY) -m kvroute demo

test: venv
	$(PY) -m pytest -q -p no:cacheprovider

proto: venv
	$(PY) -m kvroute.proto_gen

lint: venv
	$(VENV)/bin/ruff check .

bench: venv
	$(PY) bench/kv_manager.py

clean:
	rm -rf $(VENV) build *.egg-info
