"""Norms and log-sum-exps of distributed tensors, exact where Paddle 3.3's rules are not.

Paddle 3.3.1's ``p_norm`` reduces a split dim of a DistTensor to a pending *sum* of the ranks'
local norms (``Partial(SUM)``; docs/paddle-notes.md): the 2-norm of a tensor split in two comes
out as the sum of the halves' norms, and its gradient is as wrong. ``paddle.linalg.norm``,
``F.normalize`` and ``paddle.nn.utils.clip_grad_norm_`` all run through it: a user's loop that
clips with ``clip_grad_norm_`` under mp2 got 3.20 for a gradient norm of 2.22 and clipped by
it, without a word. ``logsumexp`` is as wrong (the sum of the halves' log-sum-exps): a z-loss
on vocabulary-split logits, ``paddle.logsumexp(logits, -1) ** 2``, trained another model. (Paddle's
``max``, ``min``, ``sum``, ``softmax``, ``log_softmax`` and ``cross_entropy`` over a split dim are
right; tests/test_exact_reductions.py measures which.) ``cumsum`` along a *negative* axis of a
DistTensor misreads it: ``cumsum(x, -2)`` of a tensor split along dim 0 ran on each rank's rows
alone, and ``cumsum(x, -1)`` of one split along its last dim aborts the process.

:func:`norm_exactly` makes ``_C_ops.p_norm`` and ``_C_ops.logsumexp`` exact for a DistTensor
split along a dim they reduce (a pending sum Paddle completes first, rightly):

- a p-norm with ``0 < p < inf`` sums ``|x| ** p`` (a sum's rule is right), completes that sum
  over the ranks, then takes the ``1/p`` power: no tensor is gathered, as a gradient clip needs;
- any other order (the infinity norms) gathers the reduced dims first, then reduces;
- a log-sum-exp takes the maximum (right), sums ``exp(x - max)`` (right), completes the sum and
  takes its log, plus the maximum (held constant: the gradient is ``softmax(x)`` either way);
- a ``cumsum`` (and ``cumsum_``) along a negative axis is Paddle's along the same axis counted from
  the front, which its rule reads right.

Every other call goes to Paddle unchanged: plain tensors, static programs, and reductions that
leave the split dims alone.

Where ranks hold parameters no placement describes (each rank's own experts, whose gradients are
summed over their holders only at the optimizer's step; a pipeline stage's parameters), no norm
of one rank's gradients is the model's, exact or not: there ``clip_grad_norm_`` is refused in one
line (:func:`refuse_clip_grad_norm`, however it was imported, whatever its ``norm_type``: its
infinity norm runs through ``max``, not ``p_norm``), naming the optimizer's ``ClipGradByGlobalNorm``,
which apply_plan clips over every rank (placement/clip.py).

    >>> import paddle
    >>> norm_exactly()
    >>> float(paddle.linalg.norm(paddle.to_tensor([3.0, 4.0])))  # plain tensors as before
    5.0
    >>> restore()
"""

from __future__ import annotations

import math
import sys
from types import FrameType

import paddle
import paddle.distributed as dist

#: Paddle's own ``p_norm``, called for everything not run exactly here.
_PADDLE_P_NORM = paddle._C_ops.p_norm
#: Paddle's own ``logsumexp``.
_PADDLE_LOGSUMEXP = paddle._C_ops.logsumexp
#: Paddle's own ``cumsum`` and its in-place twin.
_PADDLE_CUMSUM, _PADDLE_CUMSUM_ = paddle._C_ops.cumsum, paddle._C_ops.cumsum_
#: Paddle's own ``max``, which ``clip_grad_norm_``'s infinity norm calls instead of ``p_norm``.
_PADDLE_MAX = paddle._C_ops.max
#: The code Paddle's ``clip_grad_norm_`` runs, whatever name a script imported it by.
_CLIP_CODE = getattr(paddle.nn.utils.clip_grad_norm_, "__wrapped__", paddle.nn.utils.clip_grad_norm_).__code__
#: Why ``clip_grad_norm_`` is refused in this process (:func:`refuse_clip_grad_norm`), or None.
_clip_refused: str | None = None


def norm_exactly() -> None:
    """Make ``_C_ops.p_norm``, ``logsumexp`` and ``cumsum`` exact on distributed tensors (module
    docstring). Calling again changes nothing; :func:`restore` undoes it."""
    paddle._C_ops.p_norm, paddle._C_ops.logsumexp = _p_norm, _logsumexp
    paddle._C_ops.cumsum, paddle._C_ops.cumsum_ = _cumsum(_PADDLE_CUMSUM), _cumsum(_PADDLE_CUMSUM_)


def refuse_clip_grad_norm(why: str) -> None:
    """From now on (until :func:`restore`), Paddle's ``clip_grad_norm_`` raises ``ValueError``
    naming ``why`` (what ranks hold that its norm misses) and the rewrite, before it scales
    anything (its 0-, 1- and 2-norms run through ``p_norm``, its infinity norm through ``max``).

    >>> refuse_clip_grad_norm("nothing")
    >>> w = paddle.create_parameter([2], "float32")
    >>> w.sum().backward()
    >>> paddle.nn.utils.clip_grad_norm_([w], 1.0, norm_type=float("inf"))
    Traceback (most recent call last):
    ValueError: paddle.nn.utils.clip_grad_norm_ under this plan sees nothing, so its norm is not ...
    >>> restore()
    """
    global _clip_refused
    _clip_refused = why
    paddle._C_ops.p_norm, paddle._C_ops.max = _p_norm, _max


def restore() -> None:
    """Paddle's own ``p_norm`` back, and ``clip_grad_norm_`` allowed (``autodist.close``).

    >>> norm_exactly(); restore(); paddle._C_ops.p_norm is _PADDLE_P_NORM
    True
    """
    global _clip_refused
    paddle._C_ops.p_norm, paddle._C_ops.logsumexp, paddle._C_ops.max = _PADDLE_P_NORM, _PADDLE_LOGSUMEXP, _PADDLE_MAX
    paddle._C_ops.cumsum, paddle._C_ops.cumsum_ = _PADDLE_CUMSUM, _PADDLE_CUMSUM_
    _clip_refused = None


def _max(x, axis, keepdim):
    _refuse_if_clipping()
    return _PADDLE_MAX(x, axis, keepdim)


def _p_norm(x, porder, axis, epsilon, keepdim, asvector):
    _refuse_if_clipping()
    reduced = range(x.ndim) if asvector else [axis % max(x.ndim, 1)]
    if not _misreduced(x, reduced):
        return _PADDLE_P_NORM(x, porder, axis, epsilon, keepdim, asvector)
    if 0 < porder < math.inf:  # split dims reduced: sum |x| ** p there, whose pending sum is right
        summed = paddle.sum(paddle.abs(x) ** porder, axis=None if asvector else axis, keepdim=keepdim)
        done = [dist.Replicate() if p.is_partial() else p for p in summed.placements]
        return dist.reshard(summed, summed.process_mesh, done) ** (1.0 / porder)
    return _PADDLE_P_NORM(_gathered(x, reduced), porder, axis, epsilon, keepdim, asvector)


def _logsumexp(x, axis=None, keepdim=False, *args, **kwargs):
    """``paddle.logsumexp(x, axis, keepdim)`` (Paddle 3.3 calls ``_C_ops.logsumexp`` with its
    own arguments), exact where ``x`` is split along a reduced dim."""
    axes = [axis] if isinstance(axis, int) else list(axis or [])
    reduced = [a % max(x.ndim, 1) for a in axes] or list(range(x.ndim))
    if not _misreduced(x, reduced):
        return _PADDLE_LOGSUMEXP(x, axis, keepdim, *args, **kwargs)
    over = reduced if axes else None
    top = paddle.max(x, axis=over, keepdim=True).detach()
    top = paddle.where(paddle.isinf(top), paddle.zeros_like(top), top)  # all -inf: exp(-inf) sums to 0
    summed = paddle.sum(paddle.exp(x - top), axis=over, keepdim=keepdim)
    done = [dist.Replicate() if p.is_partial() else p for p in summed.placements]
    whole = dist.reshard(summed, summed.process_mesh, done)
    return paddle.log(whole) + (top if keepdim else top.squeeze(over) if over is not None else top.reshape([]))


def _cumsum(paddle_cumsum):
    """``paddle_cumsum(x, axis, flatten, exclusive, reverse, ...)`` with a distributed ``x``'s
    negative ``axis`` counted from the front (module docstring)."""

    def cumsum(x, axis, *args, **kwargs):
        if isinstance(x, paddle.Tensor) and x.is_dist() and axis < 0:
            axis += x.ndim
        return paddle_cumsum(x, axis, *args, **kwargs)

    return cumsum


def _refuse_if_clipping() -> None:
    if _clip_refused is not None and _called_by_clip_grad_norm():
        raise ValueError(
            f"paddle.nn.utils.clip_grad_norm_ under this plan sees {_clip_refused}, so its norm is not the "
            "model's: clip in the optimizer instead, grad_clip=paddle.nn.ClipGradByGlobalNorm(max_norm), which "
            "apply_plan clips over every rank"
        )


def _called_by_clip_grad_norm() -> bool:
    frame: FrameType | None = sys._getframe(3)
    for _ in range(12):  # clip_grad_norm_ -> linalg.norm -> vector_norm -> ... -> p_norm, decorators between
        if frame is None or frame.f_code is _CLIP_CODE:
            return frame is not None
        frame = frame.f_back
    return False


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
