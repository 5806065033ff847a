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
  the whole-batch run (its ``last_epoch`` counts updates, as on one device, so a checkpoint
  resumes the same schedule under any plan).

The scheduler is the user's object, shared by the rebuilt optimizer (``_learning_rate``), and
the loop steps it, so the only way to keep the loop unchanged is for its ``step`` to skip the
calls between updates: :func:`step_scheduler_per_update` sets ``scheduler.step`` to a
:class:`StepOncePerUpdate` (the instance attribute shadows the class's method; ``__wrapped__``
is the original). Hugging Face Accelerate's ``AcceleratedScheduler`` skips the same way under
gradient accumulation. Applying another plan gives the scheduler back its own ``step`` (or
re-binds it), so wrappers never stack and an old wrapper never freezes the schedule.

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


def accumulate_problems(optimizer: Any, dataloader: Any, plan: Plan) -> list[str]:
    """Why a plan that accumulates cannot be applied so (empty when it can): with a loader and no
    optimizer, the loader ``apply_plan`` returns yields micro-batches, and an optimizer built
    afterwards would update after each of them, another training with no message.

    >>> from types import SimpleNamespace
    >>> from autodist.schemas import Strategy
    >>> plan = SimpleNamespace(strategy=Strategy(micro_batches=2))
    >>> accumulate_problems(None, [], plan)[0][:60]
    'optimizer: none given, but this plan accumulates 2 micro-bat'
    """
    if optimizer is not None or dataloader is None or not accumulates(plan):
        return []
    return [
        f"optimizer: none given, but this plan accumulates {plan.strategy.micro_batches} micro-batches per update: "
        "the loader apply_plan returns yields micro-batches, which only the optimizer it returns sums into one "
        "update; pass yours: model, opt, loader = apply_plan(model, opt, loader, plan)"
    ]


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
        items = [split_batch(item, count) for item in batch]
        return [type(batch)(column[k] for column in items) for k in range(count)]
    if isinstance(batch, dict):
        fields = {key: split_batch(value, count) for key, value in batch.items()}
        return [{key: column[k] for key, column in fields.items()} for k in range(count)]
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

    @property
    def pending(self) -> int:
        """How many micro-batches of the current update have been summed so far (0 between updates)."""
        return self._calls % self.micro_batches

    def clear_grad(self, *args: Any, **kwargs: Any) -> None:
        if self._calls % self.micro_batches == 0:
            self._inner.clear_grad(*args, **kwargs)

    def __getattr__(self, name: str) -> Any:
        return getattr(self._inner, name)


class StepOncePerUpdate:
    """``scheduler.step`` while a plan accumulates: calls the scheduler's own ``step`` only if
    ``optimizer`` updated since the last call that went through (an explicit ``epoch`` always
    goes through)."""

    def __init__(self, step: Any, optimizer: AccumulatingOptimizer):
        self.__wrapped__, self.optimizer, self.seen = step, optimizer, optimizer.updates

    def __call__(self, epoch: Any = None) -> None:
        if epoch is None and self.optimizer.updates == self.seen:
            return
        self.seen = self.optimizer.updates
        self.__wrapped__(epoch)


def step_scheduler_per_update(optimizer: Any, accumulating: AccumulatingOptimizer | None) -> None:
    """Bind the LR scheduler of ``optimizer`` (if it has one) to ``accumulating``'s updates;
    with None, give the scheduler back its own ``step``.

    >>> schedule = paddle.optimizer.lr.StepDecay(1.0, step_size=1)
    >>> layer = paddle.nn.Linear(2, 2)
    >>> sgd = paddle.optimizer.SGD(learning_rate=schedule, parameters=layer.parameters())
    >>> step_scheduler_per_update(sgd, AccumulatingOptimizer(sgd, layer.parameters(), 2))
    >>> schedule.step(); schedule.last_epoch          # no update yet: skipped
    0
    >>> step_scheduler_per_update(sgd, None); schedule.step(); schedule.last_epoch
    1
    """
    scheduler = getattr(optimizer, "_learning_rate", None)
    if not isinstance(scheduler, paddle.optimizer.lr.LRScheduler):
        return
    vars(scheduler).pop("step", None)  # an earlier plan's wrapper: the class's own step again
    if accumulating is not None:
        scheduler.step = StepOncePerUpdate(scheduler.step, accumulating)
