"""Which experts a rank holds under expert parallelism: :func:`ep_index` and :func:`held_experts`.
Which strategies run a model's MoE layers, and how, is schemas/parallel_dims.py's
(``runs_moe_locally``, ``expert_limit``), with the reason.

    >>> [list(held_experts(8, ep=2, index=i)) for i in (ep_index(0, 2), ep_index(3, 2))]
    [[0, 1, 2, 3], [4, 5, 6, 7]]
"""

from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    pass


def ep_index(dp_coordinate: int, ep: int) -> int:
    """The index in its ep group of the rank at ``dp_coordinate`` along the dp axis, which says
    which experts it holds (:func:`held_experts`): an ep group is ``ep`` neighbouring dp ranks
    (coordinates ``k*ep .. k*ep + ep - 1``), so the index is the coordinate mod ep.

    >>> [ep_index(d, ep=2) for d in range(4)]
    [0, 1, 0, 1]
    """
    return dp_coordinate % ep


def held_experts(count: int, ep: int, index: int) -> range:
    """The experts (numbers under the container) the rank at ``index`` (:func:`ep_index`) of its ep group holds:
    the index-th of ``ep`` equal runs (the applier drops the others; ``show`` says which).

    >>> held_experts(8, ep=2, index=1)
    range(4, 8)
    """
    per = count // ep
    return range(index * per, (index + 1) * per)
