"""A model apply_plan distributed, wrapped again by Paddle's own parallel wrappers: refused in one line.

Scripts written for ``fleet`` keep their ``model = fleet.distributed_model(model)`` (or
``paddle.DataParallel(model)``) line. Called on the model apply_plan returns, Paddle 3.3.1
copies its distributed parameters as dense tensors to broadcast them and dies of SIGSEGV on every
rank (``phi::DenseTensor::DenseTensor(const DenseTensor&)``), with no Python traceback.

:func:`refuse_wrapping_again` makes both raise ``ValueError`` first, naming the line to drop, when
the model holds a distributed parameter; a model with none is wrapped by Paddle as before.
(``fleet.distributed_optimizer`` on the returned optimizer trains like one device: tested in
tests/loops/test_loops.py.)

    >>> import paddle
    >>> refuse_wrapping_again()
    >>> _refuse_distributed(paddle.nn.Linear(2, 2), "paddle.DataParallel")  # nothing distributed: Paddle's
    >>> restore()
"""

from __future__ import annotations

import paddle
import paddle.distributed.fleet
import paddle.distributed.parallel

#: Paddle's own: the broadcast every ``paddle.DataParallel`` starts with, and fleet's wrapper.
_PADDLE_SYNC = paddle.distributed.parallel.sync_params_buffers
_PADDLE_DISTRIBUTED_MODEL = paddle.distributed.fleet.distributed_model


def refuse_wrapping_again() -> None:
    """Make ``paddle.DataParallel`` and ``fleet.distributed_model`` refuse a distributed model
    (module docstring); calling again changes nothing, :func:`restore` undoes it."""
    paddle.distributed.parallel.sync_params_buffers = _sync_params_buffers
    paddle.distributed.fleet.distributed_model = _distributed_model


def restore() -> None:
    """Paddle's own back (``autodist.close``).

    >>> refuse_wrapping_again(); restore(); paddle.distributed.fleet.distributed_model is _PADDLE_DISTRIBUTED_MODEL
    True
    """
    paddle.distributed.parallel.sync_params_buffers = _PADDLE_SYNC
    paddle.distributed.fleet.distributed_model = _PADDLE_DISTRIBUTED_MODEL


def _sync_params_buffers(model, *args, **kwargs):
    _refuse_distributed(model, "paddle.DataParallel")
    return _PADDLE_SYNC(model, *args, **kwargs)


def _distributed_model(model, *args, **kwargs):
    _refuse_distributed(model, "fleet.distributed_model")
    return _PADDLE_DISTRIBUTED_MODEL(model, *args, **kwargs)


def _refuse_distributed(model: paddle.nn.Layer, wrapper: str) -> None:
    if any(p.is_dist() for p in model.parameters()):
        raise ValueError(
            f"{wrapper}: this model was distributed by autodist.apply_plan, whose plan already runs its data and "
            f"model parallelism; drop the {wrapper}(model) line and train the model apply_plan returned"
        )
