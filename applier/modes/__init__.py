"""Execution modes a plan switches on: pipeline schedules, recompute, gradient accumulation, expert
dispatch, sub-layers on local tensors (local_calls, exported_views), the vocabulary-parallel lookup and
einsum on local values."""
