"""Checkpoints that load under any plan: sharded tensors with checksums (save_load) and the schedulers'
state (scheduler_state)."""
