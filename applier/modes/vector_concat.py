"""``paddle.concat`` of 1-D distributed tensors, run as a concat of rows.

Paddle 3.3.1 concatenates 1-D DistTensors forward, but the backward raises ``ValueError:
(InvalidArgument) align_axis is empty`` (concat's SPMD rule; docs/paddle-notes.md), replicated
or split, with a plain tensor among them or not. timm's BEiT builds its qkv bias so,
``paddle.concat((self.q_bias, self.k_bias, self.v_bias))``, and could not train under any plan.
The same concat of the tensors as one row each, taken back as a vector, trains:
:func:`concat_vectors_as_rows` makes ``paddle.concat`` run such a call that way. The values and
gradients are the same; every other call goes to Paddle unchanged.

    >>> import paddle
    >>> concat_vectors_as_rows()
    >>> paddle.concat([paddle.ones([2]), paddle.zeros([1])]).tolist()  # plain tensors as before
    [1.0, 1.0, 0.0]
    >>> restore()
"""

from __future__ import annotations

import paddle

#: Paddle's own ``concat`` (``paddle.concat`` calls it through ``_C_ops``).
_PADDLE_CONCAT = paddle._C_ops.concat


def concat_vectors_as_rows() -> None:
    """Make ``paddle.concat`` of 1-D distributed tensors a concat of rows (module docstring);
    calling again changes nothing, :func:`restore` undoes it."""
    paddle._C_ops.concat = _concat


def restore() -> None:
    """Paddle's own back (``autodist.close``).

    >>> concat_vectors_as_rows(); restore(); paddle._C_ops.concat is _PADDLE_CONCAT
    True
    """
    paddle._C_ops.concat = _PADDLE_CONCAT


def _concat(x, axis, *args, **kwargs):
    vectors = isinstance(x, (list, tuple)) and all(isinstance(t, paddle.Tensor) and t.ndim == 1 for t in x)
    if vectors and isinstance(axis, int) and axis in (0, -1) and not args and kwargs.get("out") is None:
        if any(t.is_dist() for t in x):
            return _PADDLE_CONCAT([t.unsqueeze(0) for t in x], 1).squeeze(0)
    return _PADDLE_CONCAT(x, axis, *args, **kwargs)
