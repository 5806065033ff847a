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

import os
from typing import Any

import paddle
import paddle.distributed as dist
from paddle.distributed.auto_parallel.api import ShardDataloader
from paddle.io import BatchSampler, DistributedBatchSampler, RandomSampler, SequenceSampler

from autodist.schemas import Plan
from autodist.schemas.checkpoint import PROGRESS_ENV, SavedLoader

from autodist.applier.modes.accumulate import MicroBatchLoader
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
    (:func:`uneven_problem`): its length may have changed since ``apply_plan`` checked it.

    It knows where it stands (:meth:`position`: the pass, the batches handed out in it, the
    sampler's shuffle seed), which ``save_checkpoint(..., loader=loader)`` records, and starts
    its next pass there after :meth:`resume` (``load_checkpoint(..., loader=loader)``): the same
    global batches as the uninterrupted run, none skipped, none repeated, under any plan."""

    def __init__(self, dataloader: paddle.io.DataLoader, plan: Plan, **kwargs: Any):
        super().__init__(dataloader, **kwargs)
        split = kwargs["shard_dims"] is not None and not isinstance(
            dataloader.batch_sampler, paddle.io.DistributedBatchSampler
        )
        self._parts = (plan.strategy.dp, plan.strategy.micro_batches) if split else None
        #: The current pass (-1: none begun), the batches handed out in it, its shuffle seed.
        self._epoch, self._step = -1, 0
        self._seed: int | None = None
        self._resume_at: SavedLoader | None = None
        #: Batches handed out by this process, and where the first rank of its machine says so
        #: (autodist-run's summary; on several machines each machine's autodist-run reads its own).
        self._handed = 0
        first_here = os.environ.get("PADDLE_LOCAL_RANK", str(dist.get_rank())) == "0"
        self._progress = os.environ.get(PROGRESS_ENV) if first_here else None

    def position(self) -> SavedLoader:
        """Where the next batch comes from: a pass handed out whole counts as the next one begun
        (the sampler's seed already moved on to it)."""
        sampler = self._resumable()
        if self._resume_at is not None:  # resumed, no pass begun since
            return self._resume_at
        if self._epoch < 0 or self._step >= len(self):
            return SavedLoader(epoch=self._epoch + 1, step=0, batches=len(self), shuffle_seed=_seed(sampler))
        return SavedLoader(epoch=self._epoch, step=self._step, batches=len(self), shuffle_seed=self._seed)

    def resume_problem(self, saved: SavedLoader) -> str | None:
        """Why this loader cannot stand where ``saved`` stood, or None."""
        sampler = self._resumable()
        if saved.batches != len(self) or saved.step > saved.batches:
            return (
                f"the checkpoint's loader stood at batch {saved.step} of {saved.batches} a pass, this loader has "
                f"{len(self)}: another dataset or batch size, so the position would name other samples"
            )
        if (saved.shuffle_seed is None) != (_seed(sampler) is None):
            was, now = ("shuffled", "not") if saved.shuffle_seed is not None else ("not shuffled", "shuffled")
            return f"the checkpoint's loader was {was}, this one is {now}: give the DataLoader the same shuffle"
        return None

    def resume(self, saved: SavedLoader) -> None:
        """Start the next pass where ``saved`` stood (checked by :meth:`resume_problem`): its
        order, its first ``saved.step`` batches read and dropped."""
        self._resume_at = saved

    def _resumable(self) -> DistributedBatchSampler:
        sampler = self._dataloader.batch_sampler
        if not isinstance(sampler, DistributedBatchSampler):
            raise ValueError(
                f"the loader's batch sampler ({type(sampler).__name__}) keeps its own order, so where it stands "
                "cannot be saved or resumed: give the DataLoader batch_size and shuffle (or a paddle.io.BatchSampler)"
            )
        return sampler

    def report_finished(self) -> None:
        """On a machine's first rank under autodist-run: tell it that the steps of every batch handed out so far
        are finished (the next batch is asked for, or a checkpoint saved)."""
        if self._progress:
            _write_quietly(self._progress, f"{self._handed}\n")

    def __next__(self) -> Any:
        self.report_finished()
        batch = super().__next__()
        self._step += 1
        self._handed += 1
        return batch

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
        super().__iter__()
        saved, self._resume_at = self._resume_at, None
        sampler = self._dataloader.batch_sampler
        if saved is not None and saved.shuffle_seed is not None:
            sampler.set_epoch(saved.shuffle_seed)
        self._epoch = saved.epoch if saved is not None else self._epoch + 1
        self._seed, self._step = _seed(sampler), 0
        if saved is not None and saved.step:
            self.iter = self._dataloader.__iter__()
            for _ in range(saved.step):  # read and dropped: trained before the checkpoint
                next(self.iter)
            self._step = saved.step
        return self


def resumable(loader: Any) -> EvenDataloader:
    """The position-keeping loader ``apply_plan`` returned (under its micro-batch splitter too);
    ``ValueError`` (one line) for any other, and for one whose sampler keeps its own order."""
    inner = loader.loader if isinstance(loader, MicroBatchLoader) else loader
    if not isinstance(inner, EvenDataloader):
        raise ValueError(
            f"loader=: a {type(loader).__name__}, not the loader apply_plan returned (only it keeps its place)"
        )
    inner._resumable()
    return inner


def _write_quietly(path: str, text: str) -> None:
    """Replace ``path``'s content by ``text`` at once (a reader sees the old or the new); a
    report that cannot be written must not stop the training."""
    try:
        with open(path + ".tmp", "w") as f:
            f.write(text)
        os.replace(path + ".tmp", path)
    except OSError:
        pass


def _plain(sampler) -> bool:
    """Whether ``sampler`` is the batch sampler ``DataLoader(dataset, batch_size, shuffle=...)``
    makes: in order, or a plain permutation (no replacement, no generator, every sample)."""
    if type(sampler) is not BatchSampler:
        return False
    inner = sampler.sampler
    if not sampler.shuffle:
        return type(inner) is SequenceSampler
    return (
        type(inner) is RandomSampler
        and not inner.replacement
        and inner.generator is None
        and inner._num_samples is None
    )


def _seed(sampler) -> int | None:
    """The shuffle seed of the sampler's next pass (``DistributedBatchSampler`` shuffles with
    ``RandomState(epoch)``, then counts the epoch up); None when it does not shuffle."""
    return sampler.epoch if isinstance(sampler, DistributedBatchSampler) and sampler.shuffle else None


def shard_loader(dataloader: paddle.io.DataLoader, plan: Plan) -> ShardDataloader:
    """Wrap ``dataloader`` so each batch is split over ``plan.data.shard_axes`` (at most one
    axis, checked by validation) and placed on the input and label stages' meshes."""
    inputs, labels = stage_mesh(plan, plan.data.input_stage), stage_mesh(plan, plan.data.label_stage)
    meshes = inputs if plan.data.input_stage == plan.data.label_stage else [inputs, labels]
    shard_axes = plan.data.shard_axes[0] if plan.data.shard_axes else None
    sampler = dataloader.batch_sampler
    if shard_axes is None and _plain(sampler):
        # Unsplit, the order is Paddle's for a split one too (ShardDataloader.__init__): a shuffled
        # loader then reads the same global batches under every plan, and can resume.
        dataloader.batch_sampler = DistributedBatchSampler(
            dataloader.dataset, sampler.batch_size, num_replicas=1, rank=0, shuffle=sampler.shuffle,
            drop_last=sampler.drop_last,
        )  # fmt: skip
    return EvenDataloader(dataloader, plan, meshes=meshes, shard_dims=shard_axes)
