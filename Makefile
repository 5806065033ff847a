# `make install` then `make test` is all a fresh machine needs (Python 3.10+ with venv).
PYTHON ?= python3
VENV   := .venv
PY     := $(VENV)/bin/python

.PHONY: install test

install: $(VENV)/.installed

$(VENV)/.installed: pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install --quiet --upgrade pip
	$(PY) -m pip install --quiet -e '.[cpu,test]'
	touch $@

test: install
	$(PY) -m pytest $(PYTEST_ARGS)
