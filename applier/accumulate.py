"""Gradient accumulation for a plan with ``micro_batches > 1`` and no pipeline schedule.

The plan's batch is what the user's loader yields per optimizer step. When the planner split
it into ``m`` micro-batches (to fit activations in memory), ``apply_plan`` makes the ordinary
training loop accumulate, so that loop does not change:

- the loader yields each batch as ``m`` micro-batches (every dp rank splits its own part, so
  no data moves between ranks);
- ``optimizer.step()`` adds up ``m`` backward passes and updates once, with the summed
  gradients divided by ``m``: a mean loss over equal micro-batches then trains exactly as one
  step on the whole batch would; ``optimizer.clear_grad()`` clears only after that update;
- the optimizer's learning-rate scheduler advances only when the optimizer has updated since
  its last advance, so ``scheduler.step()`` once per loop iteration keeps the schedule of
  the whole-batch run.

Example::

    >>> model, opt, loader = apply_plan(model, opt, loader, "plan.json")   # doctest: +SKIP
    >>> loader.micro_batches, opt.micro_batches                           # doctest: +SKIP
    (4, 4)
    >>> for input_ids, labels in loader:      # 4 iterations per optimizer update  # doctest: +SKIP
    ...     loss = loss_fn(model(input_ids), labels)
    ...     loss.backward()
    ...     opt.step(); opt.clear_grad(); scheduler.step()
"""

from __future__ import annotations

from typing import Any, Iterator

import paddle
from paddle.distributed.auto_parallel.api import dtensor_from_local

from autodist.schemas import Plan


def accumulates(plan: Plan) -> bool:
    """True when the plan's micro-batches are gradient-accumulation steps of an ordinary
    training loop (no pipeline schedule runs them)."""
    return plan.strategy.micro_batches > 1 and plan.strategy.schedule == "none"


def accumulation_problems(plan: Plan) -> list[str]:
    """Why the plan's micro-batches cannot be applied (empty when they can)."""
    if plan.strategy.micro_batches > 1 and plan.strategy.schedule == "sequential":
        return [
            f"$.strategy.micro_batches: {plan.strategy.micro_batches} with the 'sequential' schedule: apply_plan "
            "accumulates micro-batches only without a pipeline; re-plan with --micro-batches 1 or a 1F1B schedule"
        ]
    return []


def split_batch(batch: Any, count: int) -> list[Any]:
    """``batch`` (a tensor, or a list, tuple or dict of them) as ``count`` micro-batches along
    dim 0. A distributed tensor is split on each rank's local part and keeps its mesh and
    placements, so a dp-sharded batch gives dp-sharded micro-batches without communication.

    >>> [piece.tolist() for piece in split_batch(paddle.arange(4), 2)]
    [[0, 1], [2, 3]]
    """
    if isinstance(batch, paddle.Tensor):
        if not batch.is_dist():
            return paddle.split(batch, count, axis=0)
        local = paddle.split(batch._local_value(), count, axis=0)
        return [dtensor_from_local(piece, batch.process_mesh, batch.placements) for piece in local]
    if isinstance(batch, (list, tuple)):
        columns = [split_batch(item, count) for item in batch]
        return [type(batch)(column[k] for column in columns) for k in range(count)]
    if isinstance(batch, dict):
        columns = {key: split_batch(value, count) for key, value in batch.items()}
        return [{key: column[k] for key, column in columns.items()} for k in range(count)]
    return [batch] * count  # not a tensor (a name, a flag): every micro-batch sees it


class MicroBatchLoader:
    """Yields each batch of ``loader`` as ``micro_batches`` micro-batches."""

    def __init__(self, loader: Any, micro_batches: int):
        self.loader, self.micro_batches = loader, micro_batches

    def __iter__(self) -> Iterator[Any]:
        for batch in self.loader:
            yield from split_batch(batch, self.micro_batches)

    def __len__(self) -> int:
        return len(self.loader) * self.micro_batches

    def __getattr__(self, name: str) -> Any:
        return getattr(self.loader, name)


class AccumulatingOptimizer:
    """Updates once per ``micro_batches`` calls of ``step()``, with the summed gradients
    divided by ``micro_batches``; anything else is the wrapped optimizer's."""

    def __init__(self, optimizer: Any, parameters: list[paddle.Tensor], micro_batches: int):
        self._inner, self._parameters, self.micro_batches = optimizer, parameters, micro_batches
        self._calls = 0
        self.updates = 0
        scheduler = getattr(optimizer, "_learning_rate", None)
        if isinstance(scheduler, paddle.optimizer.lr.LRScheduler):
            _advance_once_per_update(scheduler, self)

    def step(self) -> None:
        self._calls += 1
        if self._calls % self.micro_batches:
            return
        with paddle.no_grad():
            for param in self._parameters:
                if param.grad is not None:
                    param.grad.scale_(1.0 / self.micro_batches)
        self._inner.step()
        self.updates += 1

    def clear_grad(self, *args: Any, **kwargs: Any) -> None:
        if self._calls % self.micro_batches == 0:
            self._inner.clear_grad(*args, **kwargs)

    def __getattr__(self, name: str) -> Any:
        return getattr(self._inner, name)


def _advance_once_per_update(scheduler: paddle.optimizer.lr.LRScheduler, optimizer: AccumulatingOptimizer) -> None:
    """Make ``scheduler.step()`` a no-op unless ``optimizer`` updated since its last advance
    (an explicit ``epoch`` always goes through)."""
    original, seen = scheduler.step, [0]

    def step(epoch: Any = None) -> None:
        if epoch is None and optimizer.updates == seen[0]:
            return
        seen[0] = optimizer.updates
        original(epoch)

    scheduler.step = step
