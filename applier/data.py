"""Split the dataloader as the plan says: ``dist.shard_dataloader`` over the first stage's
mesh (inputs) and the last stage's (labels).

Example::

    >>> loader = shard_loader(paddle.io.DataLoader(dataset, batch_size=8), plan)   # doctest: +SKIP
    >>> for input_ids, labels in loader:   # DistTensors, each dp rank holds its part  # doctest: +SKIP
    ...     ...
"""

from __future__ import annotations

import paddle
import paddle.distributed as dist

from autodist.schemas import Plan

from autodist.applier.mesh import stage_mesh


def shard_loader(dataloader: paddle.io.DataLoader, plan: Plan) -> dist.ShardDataloader:
    """Wrap ``dataloader`` so each batch is split over ``plan.data.shard_axes`` (at most one
    axis, checked by validation) and placed on the input and label stages' meshes."""
    inputs, labels = stage_mesh(plan, plan.data.input_stage), stage_mesh(plan, plan.data.label_stage)
    meshes = inputs if plan.data.input_stage == plan.data.label_stage else [inputs, labels]
    shard_axes = plan.data.shard_axes[0] if plan.data.shard_axes else None
    return dist.shard_dataloader(dataloader, meshes=meshes, shard_dims=shard_axes)
