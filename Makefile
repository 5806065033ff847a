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

# Regenerate the checked-in example plans (docstring Llama, default sizes, pinned device profile).
PLAN_DEVICES := 2 4 8
.PHONY: plans bench
plans: install
	for n in $(PLAN_DEVICES); do \
	  $(VENV)/bin/autodist-plan plans/llama_docstring/model.py --devices $$n --device h100-sxm --quiet \
	    -o plans/llama_docstring/plan_$${n}dev.json || exit 1; \
	done

# Planning time and memory by depth (docs/benchmarks.md has the recorded table).
bench: install
	$(PY) bench/plan_time.py --markdown
