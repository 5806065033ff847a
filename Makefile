# `make install` then `make test` is all a fresh machine needs (Python 3.10+ with venv).
PYTHON ?= python3
VENV   := .venv
PY     := $(VENV)/bin/python

.PHONY: install test

install: $(VENV)/.installed

$(VENV)/.installed: pyproject.toml
	@echo "make install: a virtual environment in $(VENV), then autodist with Paddle and the test tools (a few minutes)"
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install --quiet --upgrade pip
	# setuptools prints a boxed warning for every editable install of a project whose folders share
	# the package's name (autodist/); it says nothing about this layout, so it is filtered by its text.
	PYTHONWARNINGS='ignore:Editable installation' $(PY) -m pip install --progress-bar on -e '.[cpu,test]'
	touch $@

# Three pytest workers on the 2-core machine, one test file each at a time (module fixtures stay
# in one process): much of the suite is multi-process proofs that start ranks, wait on each other
# and on timeouts, so with two workers a core sat idle a quarter of the time (CPU 11.5 min over
# 7.8 min of wall). A third worker fills those waits: 7 min 26 s -> 6 min 6 s of pytest on a fresh
# clone at idle (docs/benchmarks.md, "The whole make test"). `make test PYTEST_ARGS=` runs them one by one.
# Which files go to one worker together, and that the multi-process files are sent first, is
# tests/harness/scheduling.py's (through tests/conftest.py).
# A worker that dies is not replaced: its file's tests would never be sent again and the run hung
# (pytest-xdist with --dist loadfile, seen twice); the run ends with the failure instead. The 25
# slowest tests are listed at the end, for the suite's 10-minute budget.
PYTEST_ARGS ?= -n 3 --dist loadfile --max-worker-restart 0 --durations=25

# Lint and layout (ruff), types (mypy), the test suite, then the docstring examples of the three packages.
test: install
	$(PY) -m ruff check .
	$(PY) -m ruff format --check .
	$(PY) -m mypy
	$(PY) -m pytest $(PYTEST_ARGS)
	$(PY) -m pytest -q --doctest-modules planner applier schemas autodist

# Regenerate the checked-in example plans (docstring Llama, default sizes, pinned device profile).
PLAN_DEVICES := 2 4 8
.PHONY: plans bench
plans: install
	for n in $(PLAN_DEVICES); do \
	  $(VENV)/bin/autodist-plan plans/llama_docstring/model.py --devices $$n --device h100-sxm --quiet \
	    -o plans/llama_docstring/plan_$${n}dev.json || exit 1; \
	done
	$(VENV)/bin/autodist-plan plans/gpt/model.py --devices 4 --device h100-sxm --quiet -o plans/gpt/plan_1x4dev.json
	$(VENV)/bin/autodist-plan plans/gpt/model.py --devices 8 --device h100-sxm --quiet -o plans/gpt/plan_1x8dev.json
	$(VENV)/bin/autodist-plan plans/gpt/model.py --devices 8 --nodes 2 --mp 4 --device h100-sxm --quiet \
	  -o plans/gpt/plan_2x8dev_mp4.json
	$(VENV)/bin/autodist-plan plans/paddleformers_llama/model.py --devices 8 --device h100-sxm --quiet \
	  -o plans/paddleformers_llama/plan_1x8dev.json
	$(VENV)/bin/autodist-plan plans/paddleformers_llama/model.py --devices 8 --nodes 2 --device a100-40g --quiet \
	  -o plans/paddleformers_llama/plan_2x8dev_a100.json
	$(VENV)/bin/autodist-plan plans/paddleformers_llama/model.py --devices 8 --nodes 4 --mp 8 --pp 2 --device h100-sxm \
	  --quiet -o plans/paddleformers_llama/plan_4x8dev_mp8_pp2.json

# Planning time and memory by depth, apply_plan (and its cost on a lazily built model),
# checkpoints, recompute's activation memory, pipeline schedules priced, expert parallelism's
# memory and step time against plain dp and to_distributed, the PaddleFormers Trainer's parameters per rank
# (docs/benchmarks.md has the recorded tables).
bench: install
	$(PY) bench/plan_time.py --markdown
	$(PY) bench/plan_memory.py --markdown
	$(PY) bench/apply_time.py --markdown
	$(PY) bench/lazy_init.py --markdown
	$(PY) bench/checkpoint_time.py --markdown
	$(PY) bench/checkpoint_checksums.py --markdown
	$(PY) bench/recompute_memory.py --markdown
	$(PY) bench/local_view.py --markdown
	$(PY) bench/local_view_mp8_pp2.py --markdown
	$(PY) bench/pipeline_schedule.py
	$(PY) bench/experts.py --markdown
	$(PY) bench/closed_loop.py --runs 3
	$(PY) bench/search_quality.py --alternatives 2 --rounds 2
	$(PY) bench/trainer_params.py --markdown

# The whole product on 4 CPU processes: plan the docstring Llama, apply it, compare losses with one device.
.PHONY: demo
demo: install
	$(PY) examples/demo.py

# Strategy-search time for 8 to 1024 devices (the table in docs/benchmarks.md, "Strategy search").
.PHONY: bench-search
bench-search: install
	$(PY) bench/search_time.py
