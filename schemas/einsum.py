"""Which ``einsum`` runs exactly on each rank's local values: one that only reorders its one
operand's dims (DiT's and MAE's ``unpatchify``, ``einsum("nhwpqc->nchpwq", x)``). It contracts,
repeats and drops no index, so a dim split over ranks (a batch shard, a column split) stays split
whole, at its new position, and a partial sum stays a partial sum: each rank's piece of the output
is the einsum of its piece of the input. Paddle 3.3 runs no ``einsum`` on distributed tensors
(docs/paddle-notes.md); the planner counts such an einsum as runnable
(``cost/graph_cost._local_only``) because the applier runs it on local values
(``applier/modes/local_einsum.py``), both by :func:`einsum_permutation`.

    >>> einsum_permutation("nhwpqc->nchpwq")   # output dim i is input dim order[i]
    (0, 5, 1, 3, 2, 4)
    >>> einsum_permutation("bij,bjk->bik") is None, einsum_permutation("ii->i") is None
    (True, True)
"""

from __future__ import annotations


def einsum_permutation(equation: str) -> tuple[int, ...] | None:
    """For an einsum of one operand whose output holds each input index once, in any order: per
    output dim, the input dim it is. None for any other equation (a contraction, a second
    operand, a repeated or dropped index, an implicit output, an ellipsis).

    >>> einsum_permutation("ab->ba"), einsum_permutation("ab->a"), einsum_permutation("ab")
    ((1, 0), None, None)
    """
    source, arrow, target = equation.replace(" ", "").partition("->")
    if not arrow or not source.isalpha() or len(set(source)) != len(source):
        return None
    if sorted(source) != sorted(target):
        return None
    return tuple(source.index(index) for index in target)
