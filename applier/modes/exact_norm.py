"""Norms of distributed tensors, exact where Paddle 3.3's rule is not.

Paddle 3.3.1's ``p_norm`` reduces a split dim of a DistTensor to a pending *sum* of the ranks'
local norms (``Partial(SUM)``; docs/paddle-notes.md): the 2-norm of a tensor split in two comes
out as the sum of the halves' norms, and its gradient is as wrong. ``paddle.linalg.norm``,
``F.normalize`` and ``paddle.nn.utils.clip_grad_norm_`` all run through it: a user's loop that
clips with ``clip_grad_norm_`` under mp2 got 3.20 for a gradient norm of 2.22 and clipped by
it, without a word. (Paddle's ``max``, ``min`` and ``sum`` over a split dim are right.)

:func:`norm_exactly` makes ``_C_ops.p_norm`` exact for a DistTensor split along a dim it
reduces (a pending sum Paddle completes first, rightly):

- a p-norm with ``0 < p < inf`` sums ``|x| ** p`` (a sum's rule is right), completes that sum
  over the ranks, then takes the ``1/p`` power: no tensor is gathered, as a gradient clip needs;
- any other order (the infinity norms) gathers the reduced dims first, then reduces.

Every other call goes to Paddle unchanged: plain tensors, static programs, and norms that leave
the split dims alone.

    >>> import paddle
    >>> norm_exactly()
    >>> float(paddle.linalg.norm(paddle.to_tensor([3.0, 4.0])))  # plain tensors as before
    5.0
    >>> restore()
"""

from __future__ import annotations

import math

import paddle
import paddle.distributed as dist

#: Paddle's own ``p_norm``, called for everything not run exactly here.
_PADDLE_P_NORM = paddle._C_ops.p_norm


def norm_exactly() -> None:
    """Make ``_C_ops.p_norm``, ``max`` and ``min`` exact on distributed tensors (module
    docstring). Calling again changes nothing; :func:`restore` undoes it."""
    paddle._C_ops.p_norm = _p_norm


def restore() -> None:
    """Paddle's own reductions back (``autodist.close``).

    >>> norm_exactly(); restore(); paddle._C_ops.p_norm is _PADDLE_P_NORM
    True
    """
    paddle._C_ops.p_norm = _PADDLE_P_NORM


def _p_norm(x, porder, axis, epsilon, keepdim, asvector):
    reduced = range(x.ndim) if asvector else [axis % max(x.ndim, 1)]
    if not _misreduced(x, reduced):
        return _PADDLE_P_NORM(x, porder, axis, epsilon, keepdim, asvector)
    if 0 < porder < math.inf:  # split dims reduced: sum |x| ** p there, whose pending sum is right
        summed = paddle.sum(paddle.abs(x) ** porder, axis=None if asvector else axis, keepdim=keepdim)
        done = [dist.Replicate() if p.is_partial() else p for p in summed.placements]
        return dist.reshard(summed, summed.process_mesh, done) ** (1.0 / porder)
    return _PADDLE_P_NORM(_gathered(x, reduced), porder, axis, epsilon, keepdim, asvector)


def _misreduced(x, reduced) -> bool:
    """Whether ``x`` is an eager DistTensor split along one of the ``reduced`` dims (a pending
    sum Paddle completes first, rightly)."""
    if not (isinstance(x, paddle.Tensor) and x.is_dist()):  # a static program's value too
        return False
    return any(p.is_shard() and p.get_dim() in reduced for p in x.placements)


def _gathered(x, reduced):
    """``x`` with the ``reduced`` dims whole on every rank."""
    whole = [dist.Replicate() if p.is_shard() and p.get_dim() in reduced else p for p in x.placements]
    return dist.reshard(x, x.process_mesh, whole)
