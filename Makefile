# Two commands on a fresh machine:  `make demo`  (the main job)  and  `make test`  (the test suite).
VENV ?= .venv
PY := $(VENV)/bin/python
# CPU machines: torch 2.13.0 (a local CPU wheel here). Install it before the project, or the plain
# torch>=2.11 requirement pulls a multi-GB CUDA build.
TORCH ?= torch==2.13.0
ARGS ?=
# test files spread over this many processes (pytest-xdist; one file stays in one process)
TEST_WORKERS ?= 2

$(VENV)/.installed: pyproject.toml
	python3 -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	$(PY) -m pip install -q "$(TORCH)"
	$(PY) -m pip install -q -e ".[dev,eval]"
	touch $@

.PHONY: install demo test
install: $(VENV)/.installed

demo: $(VENV)/.installed
	$(VENV)/bin/wide demo $(ARGS)

test: $(VENV)/.installed
	$(PY) -m pytest -m "not slow" -n $(TEST_WORKERS) --dist loadfile tests
