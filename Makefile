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
	for shape in "4 1" "8 1" "8 2"; do set -- $$shape; \
	  $(VENV)/bin/autodist-plan plans/gpt/model.py --devices $$1 --nodes $$2 --device h100-sxm --quiet \
	    -o plans/gpt/plan_$${2}x$${1}dev.json || exit 1; \
	done
	for shape in "8 1" "8 2" "8 4"; do set -- $$shape; \
	  $(VENV)/bin/autodist-plan plans/paddleformers_llama/model.py --devices $$1 --nodes $$2 --device h100-sxm --quiet \
	    -o plans/paddleformers_llama/plan_$${2}x$${1}dev.json || exit 1; \
	done

# Planning time and memory by depth (docs/benchmarks.md has the recorded table).
bench: install
	$(PY) bench/plan_time.py --markdown
	$(PY) bench/apply_time.py --markdown

# The whole product on 4 CPU processes: plan the docstring Llama, apply it, compare losses with one device.
.PHONY: demo
demo: install
	$(PY) examples/demo.py
