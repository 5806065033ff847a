"""``paddle.einsum`` of a distributed tensor, where it is exact on local values.

Paddle 3.3 runs no ``einsum`` on distributed tensors (docs/paddle-notes.md): any operand a
DistTensor raises ``PreconditionNotMet``. An einsum that only reorders its one operand's dims (the
``unpatchify`` in DiT's own forward, :func:`~autodist.schemas.einsum.einsum_permutation`) is
exact on each rank's local value, whatever the placements: :func:`run_permutations_locally` makes
``paddle.einsum`` run such a call on the local value and give back a distributed tensor whose
split dims moved with the permutation (its gradient goes back the same way). Every other call
goes to Paddle's own ``einsum`` unchanged (plain tensors, and an einsum of DistTensors Paddle
refuses as before: the planner refuses a model with one outside a local view).

    >>> import paddle
    >>> run_permutations_locally()
    >>> list(paddle.einsum("abc->cab", paddle.ones([2, 3, 4])).shape)  # plain tensors as before
    [4, 2, 3]
"""

from __future__ import annotations

import paddle
import paddle.distributed as dist
from paddle.distributed.auto_parallel.api import dtensor_from_local, dtensor_to_local

from autodist.schemas.einsum import einsum_permutation

#: Paddle's own einsum, called by :func:`_einsum` for everything it does not run locally.
_PADDLE_EINSUM = paddle.einsum


def run_permutations_locally() -> None:
    """Make ``paddle.einsum`` run a permutation of a distributed tensor on its local value (once
    per process; calling again changes nothing). :func:`restore` undoes it."""
    paddle.einsum = _einsum


def restore() -> None:
    """Paddle's own ``einsum`` back (``autodist.close``).

    >>> run_permutations_locally(); restore(); paddle.einsum is _PADDLE_EINSUM
    True
    """
    paddle.einsum = _PADDLE_EINSUM


def _einsum(equation, *operands, **kwargs):
    order = einsum_permutation(equation) if isinstance(equation, str) else None
    eager_dist = len(operands) == 1 and isinstance(operands[0], paddle.Tensor) and operands[0].is_dist()
    if order is None or kwargs or not eager_dist:  # a traced value (a static program) goes to Paddle too
        return _PADDLE_EINSUM(equation, *operands, **kwargs)
    (x,) = operands
    local = _PADDLE_EINSUM(equation, dtensor_to_local(x, x.process_mesh, x.placements))
    moved = [dist.Shard(order.index(p.get_dim())) if p.is_shard() else p for p in x.placements]
    return dtensor_from_local(local, x.process_mesh, moved)
