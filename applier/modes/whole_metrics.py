"""Metrics Paddle has no distributed kernel for, run on whole values.

A training script's evaluation often calls ``paddle.metric.accuracy(logits, labels)`` on what the
model returned. Under a plan that is a distributed tensor (replicated, or split over the batch),
and Paddle 3.3.1 has no distributed kernel for its ``accuracy`` op: any such input fails with
``SystemError: (Fatal) Unrecognized egr::EagerVariable type`` (docs/paddle-notes.md).

:func:`measure_whole` makes that op take each distributed input whole on every rank (a
``reshard`` to replicated, then the rank's value, which is then the whole tensor) and run Paddle's
own kernel: one device's accuracy, on every rank. A metric has no gradient to keep. Every call
without a distributed input goes to Paddle unchanged.

    >>> import paddle
    >>> measure_whole()
    >>> float(paddle.metric.accuracy(paddle.to_tensor([[0.1, 0.9], [0.8, 0.2]]), paddle.to_tensor([[1], [1]])))
    0.5
    >>> restore()
"""

from __future__ import annotations

import paddle
import paddle.distributed as dist

#: Paddle's own ``accuracy`` (``paddle.metric.accuracy`` calls it through ``_legacy_C_ops``).
_PADDLE_ACCURACY = paddle._legacy_C_ops.accuracy


def measure_whole() -> None:
    """Make ``accuracy`` run on whole values (module docstring); calling again changes nothing,
    :func:`restore` undoes it."""
    paddle._legacy_C_ops.accuracy = _accuracy


def restore() -> None:
    """Paddle's own back (``autodist.close``).

    >>> measure_whole(); restore(); paddle._legacy_C_ops.accuracy is _PADDLE_ACCURACY
    True
    """
    paddle._legacy_C_ops.accuracy = _PADDLE_ACCURACY


def _accuracy(*args):
    return _PADDLE_ACCURACY(*(whole_value(a) for a in args))


def whole_value(value):
    """A distributed tensor's whole value on this rank, a plain tensor (every rank must call it:
    a reshard); anything else as it is."""
    if not (isinstance(value, paddle.Tensor) and value.is_dist()):
        return value
    replicated = dist.reshard(value, value.process_mesh, [dist.Replicate()] * len(value.placements))
    return replicated._local_value()
