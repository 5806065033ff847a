"""The conformance suite's session fixtures (loop_runs.py defines them)."""

from loop_runs import loop_plans, single_device  # noqa: F401  (pytest finds fixtures by name)
