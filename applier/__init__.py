"""Run-time phase: ``apply_plan`` on every rank. Light: no tracing, no networkx, no planner."""
