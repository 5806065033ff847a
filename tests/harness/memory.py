"""Bytes a rank holds, planned and real: what it should hold under a plan and what it holds
(parameters, their gradients, optimizer states).

Test-only: the applier never needs them; the tests use them to prove that sharding (and lazy
initialisation) leaves each rank exactly its planned shards, the benchmarks to measure memory.
"""

from __future__ import annotations

import numpy as np
import paddle

from autodist.schemas import Plan, shard_dim
from autodist.schemas.plan import DTYPE_BYTES


def planned_local_bytes(plan: Plan, rank: int) -> int:
    """Bytes of parameters ``rank`` holds under ``plan``: for each parameter on the rank's
    stage, its size divided by the degree of every mesh axis that shards it. What
    ``local_parameter_bytes(model)`` must equal after ``shard_parameters``."""
    ids = np.array(plan.mesh.process_ids).reshape(plan.mesh.shape)
    coords = dict(zip(plan.mesh.axes, np.argwhere(ids == rank)[0]))
    rank_stage = int(coords.get("pp", 0))
    sizes = dict(zip(plan.mesh.axes, plan.mesh.shape))
    total = 0
    for param in plan.params.values():
        if param.stage != rank_stage:
            continue
        elements = int(np.prod(param.shape, dtype=np.int64))
        for dim, placement in zip(plan.mesh.axes, param.placements):
            if shard_dim(placement) is not None:
                elements //= sizes[dim]
        total += elements * DTYPE_BYTES[param.dtype]
    return total


def local_bytes(tensors) -> int:
    """Bytes this rank really holds for ``tensors``: each one's local shard (its local value
    when it is distributed); a tensor with no storage yet (built lazily) counts nothing."""
    total = 0
    for tensor in tensors:
        local = tensor._local_value() if tensor.is_dist() else tensor
        if local._is_initialized():
            total += int(np.prod(local.shape, dtype=np.int64)) * local.element_size()
    return total


def local_parameter_bytes(model: paddle.nn.Layer) -> int:
    """Bytes this rank really holds for the model's parameters (local shards only)."""
    return local_bytes(model.parameters())


def local_gradient_bytes(model: paddle.nn.Layer) -> int:
    """Bytes of the gradients this rank holds for the model's parameters (after a backward)."""
    return local_bytes(p.grad for p in model.parameters() if p.grad is not None)


def optimizer_state_bytes(optimizer) -> int:
    """Bytes of the optimizer's states on this rank (AdamW's moments and beta powers), counted
    tensor by tensor; the states exist after the first step. ``optimizer`` may be a wrapper
    (``dist.shard_optimizer``'s, ``apply_plan``'s) that hands attributes to the one inside."""
    inner = getattr(optimizer, "_inner_opt", optimizer)
    return local_bytes(state for states in inner._accumulators.values() for state in states.values())
