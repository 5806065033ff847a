"""Split the dataloader as the plan says: ``dist.shard_dataloader`` over the first stage's
mesh (inputs) and the last stage's (labels).

Paddle splits a loader's batches with a ``DistributedBatchSampler``, which pads a dataset whose
length does not divide over dp with repeats of its first samples: a ``drop_last=False`` loader of
61 samples at batch 8 would end, under dp2, with a batch of 6 whose sixth row is sample 0 again,
a loss and an update one device never makes. Nothing is padded silently: such a loader is refused
when ``apply_plan`` checks it (:func:`uneven_problem`, naming the fix), and again before each
epoch, in case the dataset's length changed since. A last batch that splits evenly trains as on
one device (each dp rank's mean over its equal share).

Example::

    >>> loader = shard_loader(paddle.io.DataLoader(dataset, batch_size=8), plan)   # doctest: +SKIP
    >>> for input_ids, labels in loader:   # DistTensors, each dp rank holds its part  # doctest: +SKIP
    ...     ...
    >>> uneven_problem(61, 8, dp=2, micro_batches=1, drop_last=False, shuffle=False)[:46]
    'dataloader: 61 samples do not split over dp=2:'
    >>> uneven_problem(60, 8, dp=2, micro_batches=1, drop_last=False, shuffle=False) is None
    True
"""

from __future__ import annotations

from typing import Any

import paddle
from paddle.distributed.auto_parallel.api import ShardDataloader

from autodist.schemas import Plan

from autodist.applier.placement.mesh import stage_mesh


def uneven_problem(
    samples: int, batch_size: int, *, dp: int, micro_batches: int, drop_last: bool, shuffle: bool
) -> str | None:
    """Why ``samples`` samples in global batches of ``batch_size`` (which divides over
    dp x micro-batches) would not train under dp as on one device, or None: Paddle would pad them
    to a multiple of dp with repeats of the first samples and train on those, or the last batch
    would not split into equal micro-batches."""
    last, padding = samples % batch_size, -samples % dp
    if not padding:
        if drop_last or last % (dp * micro_batches) == 0:
            return None
        return (
            f"dataloader: {samples} samples in batches of {batch_size} end with a batch of {last}, which does not "
            f"split into dp={dp} x {micro_batches} micro-batches; give the DataLoader drop_last=True"
        )
    # Unshuffled, the repeats fill the last batch, which drop_last drops unless they make it whole.
    dropped = not shuffle and (samples + padding) // batch_size == samples // batch_size
    if drop_last and dropped:
        return None
    fix = "give the DataLoader drop_last=True" if dropped else f"use paddle.io.Subset(dataset, range({samples - last}))"
    return (
        f"dataloader: {samples} samples do not split over dp={dp}: Paddle's shard_dataloader would pad them to "
        f"{samples + padding} with repeats of the first samples and train on those; {fix}"
    )


class EvenDataloader(ShardDataloader):
    """Paddle's ``ShardDataloader`` that refuses, before each epoch, a dataset it would pad
    (:func:`uneven_problem`): its length may have changed since ``apply_plan`` checked it."""

    def __init__(self, dataloader: paddle.io.DataLoader, plan: Plan, **kwargs: Any):
        super().__init__(dataloader, **kwargs)
        split = kwargs["shard_dims"] is not None and not isinstance(
            dataloader.batch_sampler, paddle.io.DistributedBatchSampler
        )
        self._parts = (plan.strategy.dp, plan.strategy.micro_batches) if split else None

    def __iter__(self) -> EvenDataloader:
        if self._parts is not None:
            (dp, micro_batches), sampler = self._parts, self.batch_sampler
            problem = uneven_problem(
                len(self._dataloader.dataset),
                sampler.batch_size * dp,
                dp=dp,
                micro_batches=micro_batches,
                drop_last=sampler.drop_last,
                shuffle=sampler.shuffle,
            )
            if problem:
                raise ValueError(problem)
        return super().__iter__()


def shard_loader(dataloader: paddle.io.DataLoader, plan: Plan) -> ShardDataloader:
    """Wrap ``dataloader`` so each batch is split over ``plan.data.shard_axes`` (at most one
    axis, checked by validation) and placed on the input and label stages' meshes."""
    inputs, labels = stage_mesh(plan, plan.data.input_stage), stage_mesh(plan, plan.data.label_stage)
    meshes = inputs if plan.data.input_stage == plan.data.label_stage else [inputs, labels]
    shard_axes = plan.data.shard_axes[0] if plan.data.shard_axes else None
    return EvenDataloader(dataloader, plan, meshes=meshes, shard_dims=shard_axes)
